"""`kvlab size MODEL --context 32k --batch 16 --kv-dtype fp8 --gpu H100-SXM [--tp 8 --pp 2]`: the sizing chapter
in one line; with `--tp`/`--pp`, what ONE GPU holds (chapter *Many GPUs*).

`kvlab plan MODEL --gpu H100-SXM --context 8k --ttft 500ms --itl 50ms --rate 4/s`: a capacity plan against
latency targets (`kvlab.planning.plan`, chapter *Capacity planning*).

Both take `--speculative K --draft MODEL` (or `--draft-layers N`, an EAGLE-style head): speculative decoding's
draft weights, draft cache layers and lookahead slots in the memory budget (`kvlab.specs.sizing`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvlab.book import sweep
from kvlab.costs import budget
from kvlab.specs import arch, hardware, shape, sizing, vllm_defaults
from kvlab.units import format_bytes, format_count, format_tokens, parse_millis, parse_rate, parse_tokens

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvlab.specs.images import ImageCost

_T = TypeVar("_T")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _gpu(text: str) -> str:
    try:
        return hardware.get(text).name
    except hardware.UnknownAcceleratorError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _argument(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """A `kvlab.units` parser as an argparse type: its one-line ValueError becomes argparse's error."""

    def convert(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


_tokens = _argument(parse_tokens)
_millis = _argument(parse_millis)
_rate = _argument(parse_rate)


def _length(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a mean length in tokens, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a mean length of at least 1 token, got {text!r}")
    return value


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a registry name (see `kvlab models`) or a Hugging Face id")
    p.add_argument("--gpu", type=_gpu, required=True, help=f"one of {', '.join(hardware.registry())}")
    p.add_argument("--context", type=_tokens, default=8192, help="max_model_len, e.g. 8k")
    p.add_argument("--ttft", type=_millis, help="TTFT target, e.g. 500ms")
    p.add_argument("--itl", type=_millis, help="ITL target, checked on each request's TPOT, e.g. 50ms")
    p.add_argument("--e2el", type=_millis, help="end-to-end latency target, e.g. 20s")
    p.add_argument(
        "--percentile", type=float, default=99.0, help="share of requests that must meet them (99)"
    )
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_rate, help="Poisson arrival rate, e.g. 4/s")
    load.add_argument("--concurrency", type=_positive_int, help="requests in flight (closed loop)")
    p.add_argument("--input-len", type=_length, default=161.31, help="mean prompt tokens (ShareGPT's 161.31)")
    p.add_argument(
        "--output-len", type=_length, default=337.99, help="mean output tokens (ShareGPT's 337.99)"
    )
    p.add_argument("--requests", type=_positive_int, default=200, help="requests simulated per run")
    p.add_argument(
        "--prefix-fraction", type=_share, default=0.0, help="share of requests with a shared prefix"
    )
    p.add_argument("--prefix-len", type=_nonnegative_int, default=0, help="tokens of that shared prefix")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs per replica")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel stages per replica")
    p.add_argument(
        "--dp", type=_positive_int, help="data-parallel replicas (default: the smallest meeting the targets)"
    )
    p.add_argument("--max-gpus", type=_positive_int, default=64, help="search limit on tp × pp × dp")
    p.add_argument(
        "--allreduce-latency",
        type=_millis,
        default=0.0,
        help="latency of one TP all-reduce on top of its bytes over the link, e.g. 20us (default 0)",
    )
    p.add_argument(
        "--frontend-delay",
        type=_millis,
        default=0.0,
        help="the serving front end's fixed delay per request (HTTP, tokenizing), added to TTFT and latency, "
        "e.g. 20ms (default 0; benchmarks/planner_vs_measured.py fits one on measured runs)",
    )
    p.add_argument("--weight-dtype", default="bf16", choices=budget.DTYPES)
    p.add_argument("--kv-dtype", default="bf16", choices=budget.DTYPES)
    p.add_argument(
        "--max-num-seqs", type=_positive_int, help="default: vLLM's for the GPU (kvlab.specs.vllm_defaults)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="default: vLLM's for the GPU (kvlab.specs.vllm_defaults)",
    )
    p.add_argument("--usage-context", choices=["serve", "llm"], help="vllm serve (default) or the LLM class")
    p.add_argument("--block-size", type=_positive_int, help="default: the vLLM release's (--vllm-version)")
    p.add_argument(
        "--gpu-memory-utilization", type=_fraction, help="default: the vLLM release's (--vllm-version)"
    )
    _add_vllm_version_argument(p)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument(
        "--disagg",
        metavar="P:D",
        help="also compare P prefill + D decode GPUs (K/V sent over --kv-link) with P+D colocated replicas",
    )
    p.add_argument(
        "--router",
        choices=["round_robin", "least_loaded", "prefix_affinity", "kv_cost"],
        help="also compare this routing policy over --dp replicas with round-robin",
    )
    p.add_argument(
        "--kv-link",
        default="400 Gb InfiniBand NDR",
        help="the link --disagg sends K/V over (kvlab.offload.tiers: LINKS or CLUSTER_LINKS)",
    )
    _add_speculative_arguments(p)
    _add_limit_images_argument(p)


def _add_limit_images_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--limit-images",
        type=_nonnegative_int,
        help="images a prompt may carry (vLLM's --limit-mm-per-prompt); 0: a text-only server, "
        "no encoder cache reserved",
    )


def _add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        type=_nonnegative_int,
        help="K speculative tokens a step (vLLM's num_speculative_tokens); needs --draft or --draft-layers",
    )
    p.add_argument(
        "--draft",
        help="the draft model (vLLM's method draft_model): a registry name, same vocabulary as MODEL",
    )
    p.add_argument(
        "--draft-layers",
        type=_nonnegative_int,
        help="instead of --draft: an EAGLE/MTP-style head of N decoder layers of MODEL's own shape",
    )


def _speculation(args: argparse.Namespace) -> sizing.Speculation | None:
    """The checked speculative settings of a command line (a one-line ValueError when they are wrong)."""
    return sizing.speculation(
        shape.prepare(args.model),
        args.speculative or 0,
        args.draft,
        args.draft_layers or 0,
        args.tp or 1,
        args.pp or 1,
    )


def plan_report(args: argparse.Namespace) -> str:
    """The text `kvlab plan` prints (`kvlab.planning.plan.plan`)."""
    # An unknown model, or a wrong --speculative/--draft, is one line before the planner (and torch) loads.
    _speculation(args)
    from kvlab.costs.workloads import Workload
    from kvlab.planning import plan

    targets = plan.Targets(args.ttft, args.itl, args.e2el, args.percentile)
    workload = Workload(
        mean_input=args.input_len,
        mean_output=args.output_len,
        rate=args.rate,
        concurrency=args.concurrency,
        num_requests=args.requests,
        prefix_fraction=args.prefix_fraction,
        prefix_len=args.prefix_len,
    )
    split = None if args.disagg is None else plan.parse_split(args.disagg)
    if split is not None or args.router is not None:
        # Wrong layouts fail before the plan's own search runs.
        plan.check_layouts(
            _settings(args), workload, split, args.router, args.dp, args.max_gpus, args.kv_link
        )
    common = dict(
        context=args.context,
        workload=workload,
        targets=targets,
        settings=_settings(args),
        enable_prefix_caching=not args.no_prefix_caching,
        dp=args.dp,
        max_gpus=args.max_gpus,
    )
    from kvlab.planning.frontend import Frontend

    result = plan.plan(
        args.model,
        args.gpu,
        allreduce_latency_s=args.allreduce_latency / 1e3,
        frontend=Frontend(args.frontend_delay / 1e3),
        **common,
    )
    # How far off the planner has been on measured runs of real engines like this one (chapter 14).
    from kvlab.planning.measured import track_record

    report = result.report() + "\n" + track_record(result.gpu, args.model)
    if split is None and args.router is None:
        return report
    layouts = plan.plan_cluster(
        args.model, args.gpu, disagg=split, router=args.router, kv_link=args.kv_link, goodput=True, **common
    )
    return report + "\n" + layouts.report()


def _settings(args: argparse.Namespace) -> budget.BudgetSettings:
    """The budget settings of a `kvlab size` or `kvlab plan` command line (`size` has no --max-num-seqs)."""
    weight_dtype = int(args.weight_dtype) if args.weight_dtype.isdigit() else args.weight_dtype
    given = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name, None) is not None}
    return budget.BudgetSettings(**(given | {"weight_dtype": weight_dtype}))


_SETTINGS = [f.name for f in dataclasses.fields(budget.BudgetSettings)]


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def size_report(
    model: str,
    context: int,
    batch: int,
    settings: budget.BudgetSettings | None = None,
    gpu: str | None = None,
    per_gpu: bool = False,
    engine: str = "vllm",
    mem_fraction_static: float | None = None,
    images: ImageRequest | None = None,
    eviction: Eviction | None = None,
    facts: dict[str, Any] | None = None,
) -> str:
    """The text `kvlab size` prints; with `gpu`, the memory budget line by line (`kvlab.costs.budget`).

    With `eviction`, each sequence keeps only some of its tokens (`kvlab.specs.sizing.evicted_context`), and every
    per-sequence figure and the sequences that fit count those.

    With `images` (an image-text model), each sequence holds those images' tokens beside its `context` text
    tokens, and the budget charges vLLM's encoder cache (`kvlab.specs.images`).

    With `per_gpu` (a parallel plan: `--tp` and/or `--pp` given) every figure is what ONE GPU of the largest
    stage holds, and a plan whose budget does not fit the GPU is an error naming the smallest tensor-parallel
    size that would.

    With `facts` (a dict), the figures are also stored in it by name, for `kvlab size --json` (`size_json`).
    """
    s = settings or budget.BudgetSettings()
    tp, pp = s.tp, s.pp
    # A registry name stays a name: its stored shape sizes it without torch or transformers (kvlab.specs.shape).
    config = shape.prepare(model)
    spec = shape.shape(config).spec
    sizing.check_parallel(spec, tp, pp)
    per_token = sizing.kv_bytes_per_token(config, s.kv_dtype, tp=tp, pp=pp)
    if images is not None and s.limit_images is not None and images.count > s.limit_images:
        raise ValueError(f"--images {images.count} is more than --limit-images {s.limit_images}")
    image_cost = None if images is None else images.cost(model, per_token, s, gpu)
    text_context = context
    if image_cost is not None:
        context += image_cost.prompt_tokens
    seen = context
    if eviction is not None:
        sizing.check_evictable(spec)
        context = eviction.kept(seen)
    per_seq = sizing.kv_cache_bytes(config, context, 1, s.kv_dtype, tp=tp, pp=pp)
    total = per_seq * batch
    weights = sizing.weight_bytes_per_gpu(config, s.weight_dtype, tp=tp, pp=pp)
    kinds = ", ".join(f"{n} {k}" for k, n in spec.kinds.items())
    spec_decode = sizing.speculation(config, s.speculative, s.draft, s.draft_layers, tp, pp)
    lines = [
        f"model        {model} ({spec.attention_type}, {spec.num_layers} layers: {kinds}; "
        f"kv_heads={spec.kv_heads}, head_dim={spec.head_dim})",
    ]
    if per_gpu:
        copies = max(layer.replicas(tp) for layer in spec.layers)
        lines.append(
            f"per GPU      tp={tp}, pp={pp}: {tp * pp} GPUs; each keeps "
            f"{max(layer.kv_heads_per_rank(tp) for layer in spec.layers)} KV head(s) per layer"
            + (f", every cached head copied on {copies} GPUs" if copies > 1 else "")
        )
    lines += [
        f"KV per token {format_bytes(per_token)} ({per_token:,} B, {s.kv_dtype})",
        *_draft_lines(config, spec_decode, s),
        *_image_lines(image_cost, text_context),
        *([] if eviction is None else [eviction.line(seen)]),
        f"KV per seq   {format_bytes(per_seq)} at {format_tokens(context)} tokens",
        *_state_line(config, spec, s.kv_dtype),
        f"KV total     {format_bytes(total)} for {_sequences(batch)}",
        f"weights      {format_bytes(weights)} ({s.weight_dtype})",
        f"weights + KV {format_bytes(weights + total)}",
    ]
    if facts is not None:
        facts.update(
            model=model,
            architecture=dict(
                attention_type=spec.attention_type,
                layer_mix=spec.layer_mix,
                num_layers=spec.num_layers,
                layer_kinds=spec.kinds,
                kv_heads=spec.kv_heads,
                head_dim=spec.head_dim,
            ),
            per_gpu=per_gpu,
            tokens_seen=seen,
            tokens_per_sequence=context,
            kv_bytes_per_token=per_token,
            kv_bytes_per_sequence=per_seq,
            state_bytes_per_sequence=(
                sizing.state_bytes_per_sequence(config, s.kv_dtype) if spec.has_state else None
            ),
            kv_bytes_total=total,
            weight_bytes=weights,
            weight_and_kv_bytes=weights + total,
            image_tokens_per_sequence=None if image_cost is None else image_cost.prompt_tokens,
            budget=None,
            sequences_fit=None,
            batch_fits=None,
        )
    if gpu is not None and engine == "sglang":
        lines += _sglang_lines(config, gpu, s, context, batch, mem_fraction_static, facts)
    elif gpu is not None:
        plan = s.memory_budget(config, gpu)
        if image_cost is not None:
            plan = budget.charge_encoder_cache(plan, image_cost)
        if per_gpu and not plan.fits:
            raise ValueError(_no_fit(config, model, gpu, s, plan))
        seqs = plan.max_sequences(context) if plan.fits else 0
        verdict = "fits" if seqs >= batch else "does NOT fit"
        lines += [f"on {hardware.get(gpu).name}: the memory budget", *plan.lines(context)]
        lines.append(f"  {_sequences(batch)} of {format_tokens(context)} tokens: {verdict} (room for {seqs})")
        if facts is not None:
            facts.update(budget=_budget_facts(plan), sequences_fit=seqs, batch_fits=seqs >= batch)
    return "\n".join(lines)


def _public_facts(plan: Any) -> dict[str, Any]:
    """Every field and public property of a budget dataclass (a nested `MemoryBudget`, such as a budget's
    floor, likewise), for `kvlab size --json`."""
    cls = type(plan)
    names = [f.name for f in dataclasses.fields(plan)]
    names += [n for n in dir(cls) if not n.startswith("_") and isinstance(getattr(cls, n), property)]
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(plan, name)
        out[name] = _budget_facts(value) if isinstance(value, budget.MemoryBudget) else value
    return out


def _terms(stack: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    return [{"name": n, "bytes": v, "text": format_bytes(v), "note": note} for n, v, note in stack]


def _budget_facts(plan: budget.MemoryBudget) -> dict[str, Any]:
    """`_public_facts` of a `MemoryBudget`, and its terms from the capacity down to the pool
    (`MemoryBudget.stack`; None when they exceed the capacity), for `kvlab size --json`."""
    out = _public_facts(plan)
    out["max_tokens"] = plan.max_tokens()
    stack = [
        *plan.stack(),
        ("block rounding", plan.rounding_bytes, f"whole blocks of {plan.block_size} tokens"),
        ("KV pool", plan.kv_pool_bytes, f"{plan.num_blocks:,} blocks of {plan.block_size} tokens"),
    ]
    out["terms"] = None if plan.kv_headroom_bytes < 0 else _terms(stack)
    return out


def _sglang_facts(pool: Any) -> dict[str, Any]:
    """`_public_facts` of SGLang's pool (`kvlab.costs.sglang.SGLangPool`) and its terms from the capacity down
    to the pool (None when the weights leave it no room), for `kvlab size --engine sglang --json`."""
    out = _public_facts(pool)
    out["engine"] = "sglang"
    out["min_mem_fraction_static"] = pool.min_mem_fraction_static()
    rounding = pool.rest_bytes - pool.kv_pool_bytes
    stack = [
        *pool.stack(),
        ("token rounding", rounding, "what is left below one token's cell"),
        ("KV pool", pool.kv_pool_bytes, f"max_total_num_tokens = {pool.max_total_num_tokens:,}"),
    ]
    out["terms"] = _terms(stack) if pool.fits else None
    return out


def size_json(args: argparse.Namespace) -> dict[str, Any]:
    """The one JSON object `kvlab size --json` prints: `size_report`'s figures by name, the settings they were
    sized at, its text, and the `vllm serve` command that reproduces the setting (`kvlab.specs.vllm_serve`)."""
    from kvlab.specs import vllm_serve

    _check_engine(args)
    facts: dict[str, Any] = {}
    settings = _settings(args)
    eviction = _eviction(args)
    report = size_report(
        args.model,
        args.context,
        args.batch,
        settings,
        args.gpu,
        args.tp is not None or args.pp is not None,
        args.engine,
        args.mem_fraction_static,
        images=_image_request(args),
        eviction=eviction,
        facts=facts,
    )
    settings_facts = {
        "context": args.context,
        "batch": args.batch,
        "gpu": args.gpu,
        "images": args.images,
        "image_size": args.image_size if args.images is not None else None,
        "keep_ratio": args.keep_ratio,
        "window": args.window,
        "sinks": args.sinks,
        "engine": args.engine,
        **dataclasses.asdict(settings),
    }
    texts = {
        name: format_bytes(value)
        for name, value in [*facts.items(), *(facts["budget"] or {}).items()]
        if "bytes" in name and isinstance(value, int) and not isinstance(value, bool)
    }
    if args.engine == "sglang":
        settings_facts["mem_fraction_static"] = args.mem_fraction_static
        # SGLang's pool has no `vllm serve` command; kvlab writes no `sglang serve` one.
        return {"settings": settings_facts, **facts, "texts": texts, "vllm_serve": None, "report": report}
    tokens, seqs = (
        settings.batch_limits(args.gpu, shape.prepare(args.model))
        if args.gpu is not None
        else (settings.max_num_batched_tokens, None)
    )
    serve = vllm_serve.serve_command(
        args.model,
        max_model_len=facts["tokens_seen"],
        kv_dtype=settings.kv_dtype,
        weight_dtype=settings.weight_dtype,
        tp=settings.tp,
        pp=settings.pp,
        # the values the budget was sized with (a release's defaults resolved), else the ones given
        gpu_memory_utilization=(facts["budget"] or {}).get(
            "gpu_memory_utilization", settings.gpu_memory_utilization
        ),
        block_size=(facts["budget"] or {}).get("block_size", settings.block_size),
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        usage_context=settings.usage_context,
        limit_images=settings.limit_images,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        speculative=settings.speculative,
        draft=settings.draft,
        draft_layers=settings.draft_layers,
        evicts=eviction is not None,
    )
    return {
        "settings": settings_facts,
        **facts,
        # each byte count above as the report writes it (kvlab.units.format_bytes), for a page to show
        "texts": texts,
        "vllm_serve": serve.as_dict(),
        "report": report,
    }


def _check_engine(args: argparse.Namespace) -> None:
    """`kvlab size --engine sglang`'s own refusals (its text and its --json alike)."""
    if args.engine == "sglang" and args.gpu is None:
        raise ValueError("--engine sglang sizes SGLang's pool on a GPU: give --gpu")
    if args.engine == "sglang" and _speculation(args) is not None:
        raise ValueError("--speculative sizes vLLM's budget only: drop --engine sglang")


@dataclass(frozen=True)
class Eviction:
    """`kvlab size --keep-ratio R` or `--window W [--sinks S]`: the tokens a sequence keeps."""

    keep_ratio: float | None = None
    sinks: int = 0
    window: int | None = None

    def kept(self, context: int) -> int:
        return sizing.evicted_context(context, self.keep_ratio, self.sinks, self.window)

    def line(self, context: int) -> str:
        rule = (
            f"--keep-ratio {self.keep_ratio:g}"
            if self.window is None
            else f"{self.sinks} sinks + a {self.window:,}-token window"
        )
        return (
            f"evicted      keeps {self.kept(context):,} of {context:,} tokens per sequence ({rule}; "
            "the accuracy this costs is not in these figures)"
        )


def _eviction(args: argparse.Namespace) -> Eviction | None:
    if args.keep_ratio is None and args.window is None:
        if args.sinks:
            raise ValueError("--sinks go with --window")
        return None
    eviction = Eviction(args.keep_ratio, args.sinks, args.window)
    # The rule's own checks, once, before any sizing
    eviction.kept(1)
    return eviction


@dataclass(frozen=True)
class ImageRequest:
    """`kvlab size --images N --image-size WxH [--min-pixels P --max-pixels P]`."""

    count: int
    width: int
    height: int
    min_pixels: int | None = None
    max_pixels: int | None = None

    def cost(
        self, model: str, kv_bytes_per_token: int, s: budget.BudgetSettings, gpu: str | None
    ) -> ImageCost:
        from kvlab.specs import images

        # vLLM's encoder budget follows the step's token budget: the GPU's default, or the one given.
        tokens = s.batch_limits(gpu, model)[0] if gpu is not None else s.max_num_batched_tokens
        return images.image_cost(
            model,
            self.count,
            self.width,
            self.height,
            kv_bytes_per_token=kv_bytes_per_token,
            max_num_batched_tokens=tokens or budget.MAX_NUM_BATCHED_TOKENS,
            dtype=s.weight_dtype if isinstance(s.weight_dtype, str) else "bf16",
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )


def _image_lines(cost: ImageCost | None, text_context: int) -> list[str]:
    """What the images add to each sequence, and the encoder cache vLLM reserves for them."""
    if cost is None:
        return []
    rule = cost.rule
    how = (
        f"{rule.fixed_tokens} per image, whatever its size"
        if rule.kind == "fixed"
        else f"resized to {rule.factor}-pixel squares within {rule.min_pixels:,}-{rule.max_pixels:,} pixels"
    )
    return [
        f"images       {cost.images} × {cost.width}x{cost.height}: {cost.tokens_per_image:,} tokens each "
        f"({cost.tokens_per_image - rule.boundary_tokens:,} image + {rule.boundary_tokens} boundary; {how})",
        f"  + {cost.prompt_tokens:,} image tokens beside {format_tokens(text_context)} of text: "
        f"{format_bytes(cost.kv_bytes)} of KV per seq",
        f"  encoder    vLLM reserves {cost.encoder_cache_tokens:,} image tokens of embeddings: "
        f"{format_bytes(cost.encoder_cache_bytes)}, profiled as {cost.profiled_images} largest image(s) "
        f"({cost.encoder_cache_note})",
    ]


def _draft_lines(
    config: PretrainedConfig | str, spec: sizing.Speculation | None, s: budget.BudgetSettings
) -> list[str]:
    """Under speculation: what the drafter adds per token and in weights, and the slots a sequence holds ahead."""
    if spec is None:
        return []
    kv = sizing.draft_kv_bytes_per_token(config, spec, s.kv_dtype, tp=s.tp)
    weights = sizing.draft_weight_bytes_per_gpu(config, spec, s.weight_dtype, tp=s.tp)
    estimate = " (an estimate: layers of the target's shape)" if spec.draft is None else ""
    return [
        f"draft        {spec.describe()}",
        f"  + draft KV {format_bytes(kv)} ({kv:,} B) per token in the same pool{estimate}; weights "
        f"{format_bytes(weights)}",
        f"  lookahead  {spec.lookahead_slots} slots per running sequence ({spec.num_speculative_tokens} drafts "
        f"verified + {spec.num_speculative_tokens} lookahead); KV per seq and total: the target's alone",
    ]


def _state_line(config: PretrainedConfig | str, spec: arch.ArchSpec, kv_dtype: str) -> list[str]:
    """For a model with state layers, the fixed state inside "KV per seq" (`sizing.state_bytes_per_sequence`)."""
    if not spec.has_state:
        return []
    state = sizing.state_bytes_per_sequence(config, kv_dtype)
    count = sum(1 for layer in spec.layers if layer.state_shape)
    return [
        f"KV state/seq {format_bytes(state)} fixed, in {count} state layers (conv + fp32 recurrent; in KV per seq)"
    ]


def _sglang_lines(
    config: PretrainedConfig | str,
    gpu: str,
    s: budget.BudgetSettings,
    context: int,
    batch: int,
    mem_fraction_static: float | None,
    facts: dict[str, Any] | None = None,
) -> list[str]:
    """SGLang's pool on `gpu` at the settings' dtypes and parallel sizes (`kvlab.costs.sglang`); with `facts`,
    its figures by name too (`size_report`)."""
    from kvlab.costs import sglang

    pool = sglang.sglang_pool(
        config,
        gpu,
        kv_dtype=s.kv_dtype,
        weight_dtype=s.weight_dtype,
        mem_fraction_static=mem_fraction_static,
        tp=s.tp,
        pp=s.pp,
    )
    seqs = pool.max_sequences(context) if pool.fits else 0
    verdict = "fits" if seqs >= batch else "does NOT fit"
    if facts is not None:
        facts.update(budget=_sglang_facts(pool), sequences_fit=seqs, batch_fits=seqs >= batch)
    return [
        f"on {hardware.get(gpu).name}: SGLang {sglang.SGLANG_VERSION}'s pool",
        *pool.lines(context),
        f"  {_sequences(batch)} of {format_tokens(context)} tokens: {verdict} (room for {seqs})",
    ]


def _sequences(n: int) -> str:
    return format_count(n, "sequence")


def _no_fit(
    config: PretrainedConfig | str, model: str, gpu: str, s: budget.BudgetSettings, plan: budget.MemoryBudget
) -> str:
    spec = shape.shape(config).spec
    hint = "no tensor-parallel size up to 64 fits"
    for candidate in (2**k for k in range(7)):
        if candidate <= s.tp:
            continue
        try:
            sizing.check_parallel(spec, candidate, s.pp)
        except ValueError:
            continue
        if dataclasses.replace(s, tp=candidate).memory_budget(config, gpu).fits:
            hint = f"the smallest tensor-parallel size that fits is --tp {candidate}"
            break
    return (
        f"{model} does not fit one {hardware.get(gpu).name} at tp={s.tp}, pp={s.pp}: "
        f"{format_bytes(plan.weight_bytes)} of weights per GPU, "
        f"{format_bytes(max(plan.kv_headroom_bytes + plan.weight_bytes, 0))} left for weights and cache; {hint}"
    )


def _add_size_arguments(size: argparse.ArgumentParser) -> None:
    size.add_argument("model", help="a registry name (see `kvlab models`) or a Hugging Face id")
    size.add_argument("--context", type=_tokens, default=4096, help="tokens per sequence, e.g. 4096 or 32k")
    size.add_argument("--batch", type=_positive_int, default=1, help="concurrent sequences")
    size.add_argument("--kv-dtype", default="bf16", choices=budget.DTYPES)
    size.add_argument(
        "--weight-dtype",
        default="bf16",
        choices=[*budget.DTYPES, "4"],
        help="weight precision; 4 means 4-bit",
    )
    size.add_argument(
        "--gpu", type=_gpu, help=f"check the plan against this GPU: {', '.join(hardware.registry())}"
    )
    size.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        help="share of the GPU the engine may use (default: the vLLM release's, 1.0 on 0.34 with its "
        "extensible KV cache)",
    )
    size.add_argument(
        "--block-size", type=_positive_int, help="tokens per KV block (default: the vLLM release's)"
    )
    _add_vllm_version_argument(size)
    size.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="largest token batch of a step (sizes the activation peak); default: vLLM's for the GPU",
    )
    size.add_argument(
        "--usage-context", choices=["serve", "llm"], help="vllm serve (default) or the LLM class"
    )
    size.add_argument(
        "--tp", type=_positive_int, help="tensor-parallel GPUs: print what one GPU holds (vLLM's sharding)"
    )
    size.add_argument("--pp", type=_positive_int, help="pipeline stages: print the largest stage's GPU")
    size.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="whose pool --gpu sizes: vLLM's budget, or SGLang's static fraction (kvlab.costs.sglang)",
    )
    size.add_argument(
        "--mem-fraction-static",
        type=_fraction,
        help="SGLang's --mem-fraction-static (default: SGLang's own choice for the GPU and TP size)",
    )
    _add_speculative_arguments(size)
    _add_image_arguments(size)
    _add_limit_images_argument(size)
    _add_eviction_arguments(size)
    size.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the figures, the budget term by term, the vllm serve command (a refusal: "
        '{"error": ...}, exit 2)',
    )


def _add_eviction_arguments(size: argparse.ArgumentParser) -> None:
    size.add_argument(
        "--keep-ratio",
        type=_share,
        help="KV eviction (SnapKV, H2O, uniform): each sequence keeps this share of its tokens",
    )
    size.add_argument(
        "--window",
        type=_positive_int,
        help="KV eviction (StreamingLLM): keep the last W tokens and the sinks",
    )
    size.add_argument(
        "--sinks", type=_nonnegative_int, default=0, help="with --window: the first S tokens kept as well"
    )


def _add_image_arguments(size: argparse.ArgumentParser) -> None:
    size.add_argument(
        "--images",
        type=_positive_int,
        help="images per request (Qwen2/2.5/3-VL, Gemma 3): their tokens join --context",
    )
    size.add_argument("--image-size", default="1280x720", help="each image's WIDTHxHEIGHT in pixels")
    size.add_argument(
        "--min-pixels",
        type=_positive_int,
        help="the image processor's min_pixels (vLLM's --mm-processor-kwargs)",
    )
    size.add_argument(
        "--max-pixels", type=_positive_int, help="the image processor's max_pixels (default: the model's own)"
    )


def _image_request(args: argparse.Namespace) -> ImageRequest | None:
    if args.images is None:
        if args.min_pixels is not None or args.max_pixels is not None:
            raise ValueError("--min-pixels and --max-pixels size images: give --images")
        return None
    from kvlab.specs.images import parse_image_size

    width, height = parse_image_size(args.image_size)
    return ImageRequest(args.images, width, height, args.min_pixels, args.max_pixels)


def _vllm_version(text: str) -> str:
    try:
        vllm_defaults.resolve(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _add_vllm_version_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vllm-version",
        type=_vllm_version,
        help=f"the vLLM release whose sizing rule and defaults apply (e.g. 0.33, 0.6.3, or v0/v1; default "
        f"{vllm_defaults.VLLM_VERSION})",
    )
    p.add_argument(
        "--no-extensible-kv-cache",
        dest="extensible_kv_cache",
        action="store_const",
        const=False,
        help="vLLM 0.34's estimate-rule fallback (kv_cache_memory_bytes set, legacy-IPC connectors, no VMM)",
    )


def _add_explain_vllm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("logfile", help="a vLLM server's start-up log (v1 or v0 format)")
    p.add_argument("--model", help="the model, when the log prints no engine config line")
    p.add_argument(
        "--gpu-memory-gib", type=float, help="the GPU's total memory in GiB, when the log prints none"
    )
    p.add_argument(
        "--vllm-version",
        type=_vllm_version,
        help="the vLLM release that wrote the log, when it prints none (or to size it by another rule)",
    )


def _add_diagnose_arguments(p: argparse.ArgumentParser) -> None:
    from kvlab.planning import diagnose

    diagnose.add_arguments(p)


# Subcommand: (its help line, what adds its arguments). Only the subcommand on the command line gets its
# arguments, so `kvlab --help` imports nothing a subcommand needs.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "size": ("KV cache and weight bytes for a model, context and batch", _add_size_arguments),
    "plan": (
        "capacity plan against latency targets (modelled: kvlab.planning.simulate)",
        _add_plan_arguments,
    ),
    "diagnose": ("which KV-cache lever applies first to a workload, and why", _add_diagnose_arguments),
    "explain-vllm": (
        "a vLLM start-up log's memory budget, term by term, beside kvlab's",
        _add_explain_vllm_arguments,
    ),
    "models": ("list the offline registry, grouped by what holds each model's cache", lambda p: None),
    "sweep": ("run a lab over a parameter grid; glued scalars to CSV", sweep.add_arguments),
}


def models_report() -> str:
    """The offline registry grouped by what holds each model's cache: the kinds of layer, then how query heads
    share KV heads (from the stored shapes, so no model is loaded)."""
    groups: dict[str, list[str]] = {}
    for name in arch.registry():
        spec = shape.shape(name).spec
        # MLA names itself in the layer mix; a model without attention has no head sharing to name
        heads = "" if spec.attention_type in ("MLA", "none") else f", {spec.attention_type}"
        groups.setdefault(spec.layer_mix + heads, []).append(name)
    return "\n".join(
        f"{kind} ({len(names)}):\n" + "\n".join(f"  {name}" for name in names)
        for kind, names in sorted(groups.items())
    )


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `kvlab` parser, with the arguments of `command` (None: the subcommands' names and help only)."""
    parser = argparse.ArgumentParser(prog="kvlab", description="Size the KV cache of an LLM deployment.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_line, add) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line)
        if name == command:
            add(p)
    return parser


def _json_refusal(message: str) -> int:
    """`kvlab size --json`'s answer to input it refuses: {"error": the one line}, exit 2."""
    print(json.dumps({"error": message}))
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    as_json = command == "size" and "--json" in argv
    if as_json:
        # argparse prints a bad flag's one line to stderr and exits 2; --json answers it as JSON instead.
        import contextlib
        import io

        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = build_parser(command).parse_args(argv)
        except SystemExit as stop:
            if stop.code == 0:
                raise
            line = stderr.getvalue().strip().splitlines()[-1]
            return _json_refusal(line.split(" error: ", 1)[-1])
    else:
        args = build_parser(command).parse_args(argv)
    try:
        if as_json:
            print(json.dumps(size_json(args), indent=1))
            return 0
        if args.command == "sweep":
            return sweep.main(args)
        if args.command == "models":
            print(models_report())
        elif args.command == "diagnose":
            from kvlab.planning import diagnose

            print(diagnose.diagnose(diagnose.deployment_from_args(args)).report())
        elif args.command == "explain-vllm":
            from kvlab.planning import explain_vllm

            total = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * 2**30)
            print(explain_vllm.main(args.logfile, args.model, total, args.vllm_version))
        elif args.command == "plan":
            print(plan_report(args))
        else:
            per_gpu = args.tp is not None or args.pp is not None
            _check_engine(args)
            print(
                size_report(
                    args.model,
                    args.context,
                    args.batch,
                    _settings(args),
                    args.gpu,
                    per_gpu,
                    args.engine,
                    args.mem_fraction_static,
                    _image_request(args),
                    _eviction(args),
                )
            )
    except (arch.UnknownModelError, arch.UnsupportedConfigError, ValueError) as err:
        if as_json:
            return _json_refusal(str(err))
        print(f"kvlab: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
