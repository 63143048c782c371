"""Where to start: from a workload description to the first KV-cache lever that applies, with the numbers.

`diagnose(workload)` walks the optimisation order of the book's chapter *Where to start* (claim 18) and
reports, for every lever, whether it applies to this workload, why, and with which figures:

1. context and output statistics (is `max_model_len` far above what requests use?)  -- chapters 5, 6
2. active sequences and tokens (does the pool hold the tokens the load keeps resident?) -- chapter 5
3. MHA/GQA/MQA (is the model's attention the reason a token costs so much?)             -- chapter 2
4. KV precision (would fp8 make the resident tokens fit?)                                -- chapter 11
5. prefix reuse (is a shared prefix recomputed and stored once per request?)             -- chapter 9
6. paging and fragmentation (contiguous reservations, or big blocks on short requests)  -- chapter 7
7. batching of short requests (does `max_num_seqs` cap the batch below the load?)       -- chapters 4, 8
8. true long-context capacity (does one long request take a large share of the pool?)   -- chapters 6, 12
9. multi-GPU topology (do the weights fit one GPU at all? what TP would?)               -- chapter 13

The first lever that applies is the one to use first. Every memory figure comes from `kvlab.budget.memory_budget`
(the one KV budget) and `kvlab.sizing`; the concurrency an arrival rate keeps in flight comes from Little's law
with the realistic step-cost model of `kvlab.roofline` (*modelled*, not measured).

Engine settings each lever maps to, with their documentation:
vLLM engine arguments, https://docs.vllm.ai/en/latest/configuration/engine_args.html
(`--max-model-len`, `--max-num-seqs`, `--gpu-memory-utilization`, `--kv-cache-dtype`, `--enable-prefix-caching`,
`--block-size`, `--max-num-batched-tokens`, `--tensor-parallel-size`, `--pipeline-parallel-size`);
SGLang server arguments, https://docs.sglang.io/advanced_features/server_arguments.html
(`--context-length`, `--max-running-requests`, `--mem-fraction-static`, `--kv-cache-dtype`, the radix cache on
unless `--disable-radix-cache`, `--schedule-policy lpm` (the default is `fcfs`), `--page-size` (default 1),
`--chunked-prefill-size`, `--tp-size`, `--pp-size`, `--dp-size`); checked against that page's source,
docs/advanced_features/server_arguments.md in sgl-project/sglang.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab import arch, budget, hardware, roofline, sizing
from kvlab.units import format_bytes, parse_tokens

VLLM_DOCS = "https://docs.vllm.ai/en/latest/configuration/engine_args.html"
SGLANG_DOCS = "https://docs.sglang.io/advanced_features/server_arguments.html"

# Thresholds of the rules below: each one a stated choice, not a measured constant.
OVERSIZED_CONTEXT = 4.0  # max_model_len at least this many times the mean request length
PREFIX_SHARE = 0.25  # a shared prefix at least this share of the mean prompt is worth caching
FRAGMENTATION_SHARE = 0.10  # block rounding above this share of the resident tokens
LONG_REQUEST_SHARE = 0.25  # one longest request taking at least this share of the pool
LONGEST_OVER_MEAN = 4  # the longest prompt or output, when not given, as a multiple of the mean
GQA_HEADS = 8  # the KV heads of the GQA alternative an MHA model is compared with (Llama-3's choice)
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")


class WorkloadError(ValueError):
    """A workload description kvlab cannot diagnose (the message names the problem)."""


@dataclass(frozen=True)
class Workload:
    """What a deployment serves, on what, with which engine settings (vLLM's names)."""

    model: str
    gpu: str
    mean_input: float  # prompt tokens per request
    mean_output: float  # generated tokens per request
    max_input: int | None = None  # the longest prompt (P99 or max); default LONGEST_OVER_MEAN × the mean
    max_output: int | None = None  # the longest output; default LONGEST_OVER_MEAN × the mean
    rate: float | None = None  # requests per second (open loop) ...
    concurrency: int | None = None  # ... or requests in flight (closed loop)
    prefix_fraction: float = 0.0  # share of requests that start with one shared prefix
    prefix_len: int = 0  # tokens of that prefix
    output_cv: float = 0.0  # coefficient of variation of the output length (std / mean); 0: all equal
    kv_dtype: str = "bf16"
    weight_dtype: str = "bf16"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = budget.MAX_NUM_SEQS
    max_num_batched_tokens: int = budget.MAX_NUM_BATCHED_TOKENS
    block_size: int = budget.BLOCK_SIZE
    gpu_memory_utilization: float = budget.GPU_MEMORY_UTILIZATION
    prefix_caching: bool = False
    paged: bool = True  # False: every request reserves max_model_len contiguously
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        try:
            config = arch.get(self.model)
        except (arch.UnknownModelError, arch.UnsupportedConfigError) as err:
            message = str(err.args[0]) if err.args else str(err)
            raise WorkloadError(
                message if "unknown model" in message else f"model {self.model!r}: {message}"
            ) from None
        try:
            hardware.get(self.gpu)
        except hardware.UnknownAcceleratorError as err:
            raise WorkloadError(str(err.args[0]) if err.args else str(err)) from None
        for name in ("mean_input", "mean_output"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
                raise WorkloadError(f"{name} must be at least 1 token, got {value!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tp", "pp"):
            _check_int(name, getattr(self, name), 1)
        for name in ("max_input", "max_output", "max_model_len", "concurrency"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        _check_int("prefix_len", self.prefix_len, 0)
        if (self.rate is None) == (self.concurrency is None):
            raise WorkloadError("give exactly one of rate (requests/s) and concurrency (requests in flight)")
        if self.rate is not None and (
            isinstance(self.rate, bool)
            or not isinstance(self.rate, (int, float))
            or not 0 < self.rate < math.inf
        ):
            raise WorkloadError(f"rate must be a positive number of requests per second, got {self.rate!r}")
        if (
            isinstance(self.output_cv, bool)
            or not isinstance(self.output_cv, (int, float))
            or not 0 <= self.output_cv < math.inf
        ):
            raise WorkloadError(f"output_cv must be a number >= 0, got {self.output_cv!r}")
        if not isinstance(self.prefix_fraction, (int, float)) or not 0 <= self.prefix_fraction <= 1:
            raise WorkloadError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction!r}")
        if (
            not isinstance(self.gpu_memory_utilization, (int, float))
            or not 0 < self.gpu_memory_utilization <= 1
        ):
            raise WorkloadError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("kv_dtype", "weight_dtype"):
            if getattr(self, name) not in KV_DTYPES:
                raise WorkloadError(
                    f"{name} must be one of {', '.join(KV_DTYPES)}, got {getattr(self, name)!r}"
                )
        try:
            sizing.check_parallel(arch.describe(config), self.tp, self.pp)
        except ValueError as err:
            raise WorkloadError(str(err)) from None
        if self.max_input is not None and self.max_input < self.mean_input:
            raise WorkloadError(f"max_input {self.max_input} is below mean_input {self.mean_input}")
        if self.max_output is not None and self.max_output < self.mean_output:
            raise WorkloadError(f"max_output {self.max_output} is below mean_output {self.mean_output}")

    @property
    def longest_input(self) -> int:
        return self.max_input or math.ceil(LONGEST_OVER_MEAN * self.mean_input)

    @property
    def longest_output(self) -> int:
        return self.max_output or math.ceil(LONGEST_OVER_MEAN * self.mean_output)

    @property
    def model_max_len(self) -> int:
        text = arch.get(self.model).get_text_config()
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        return int(limit) if limit else 2048

    @property
    def context_limit(self) -> int:
        """max_model_len as the engine would run it."""
        return self.max_model_len or self.model_max_len

    @property
    def mean_length(self) -> float:
        """Tokens a request holds when it finishes: prompt plus output."""
        return self.mean_input + self.mean_output

    @property
    def mean_resident(self) -> float:
        """Tokens a running request holds, averaged over engine steps: a request generating `n` tokens after a
        `p`-token prompt holds `p, p + 1, ..., p + n - 2` in its `n - 1` decode steps' ends, and requests with
        long outputs occupy more steps, so the average weights each request by `n`:
        `E[p] + (E[n^2] / E[n] - 1) / 2 = mean_input + (mean_output × (1 + output_cv²) - 1) / 2`
        (prompt and output lengths independent). With `output_cv = 0` every output has the mean length."""
        return self.mean_input + max(0.0, self.mean_output * (1 + self.output_cv**2) - 1) / 2


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Lever:
    """One step of the optimisation order, as it applies to one workload."""

    step: int
    name: str
    applies: bool
    why: str
    chapters: tuple[str, ...]  # book pages that measure it, relative to book/
    vllm: str
    sglang: str
    numbers: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        mark = "APPLIES" if self.applies else "ok     "
        return f"{self.step}. {mark} {self.name}: {self.why}"


@dataclass(frozen=True)
class Diagnosis:
    workload: Workload
    memory: budget.MemoryBudget
    concurrency: float  # requests in flight the load keeps (given, or from the rate by Little's law)
    levers: tuple[Lever, ...]

    @property
    def first(self) -> Lever | None:
        """The first lever, in the book's order, that applies; None when none does."""
        return next((lever for lever in self.levers if lever.applies), None)

    def report(self) -> str:
        w, m = self.workload, self.memory
        load = f"{w.rate:g} requests/s" if w.rate is not None else f"{w.concurrency} requests in flight"
        lines = [
            f"workload  {w.model} on {hardware.get(w.gpu).name} (tp={w.tp}, pp={w.pp}), {load}; "
            f"{w.mean_input:g} prompt + {w.mean_output:g} output tokens on average, max_model_len {w.context_limit:,}",
            f"KV pool   {m.max_tokens():,} tokens ({format_bytes(m.kv_pool_bytes)}, "
            f"{format_bytes(m.kv_bytes_per_token)} per token, {w.kv_dtype})"
            if m.fits
            else "KV pool   none: the weights and runtime leave no room for a single block",
            f"in flight {self.concurrency:,.1f} requests, {self.concurrency * w.mean_resident:,.0f} resident tokens "
            "on average" + (" (Little's law with the realistic step-cost model, modelled)" if w.rate else ""),
            "",
        ]
        for lever in self.levers:
            lines.append(lever.line())
        first = self.first
        lines.append("")
        if first is None:
            lines.append(
                "start with: nothing to change for the KV cache; measure the latency targets (kvlab plan)"
            )
        else:
            lines += [
                f"start with: {first.step}. {first.name}",
                f"  vLLM:   {first.vllm}  ({VLLM_DOCS})",
                f"  SGLang: {first.sglang}  ({SGLANG_DOCS})",
                f"  book:   {', '.join(first.chapters)}",
            ]
        return "\n".join(lines)


def _memory(w: Workload, **changes: Any) -> budget.MemoryBudget:
    settings: dict[str, Any] = dict(
        kv_dtype=w.kv_dtype,
        weight_dtype=w.weight_dtype,
        gpu_memory_utilization=w.gpu_memory_utilization,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_num_seqs=w.max_num_seqs,
        block_size=w.block_size,
        tp=w.tp,
        pp=w.pp,
    )
    settings.update(changes)
    return budget.memory_budget(w.model, w.gpu, **settings)


def concurrency(w: Workload) -> float:
    """Requests in flight: given, or `rate × latency` (Little's law), the latency being a prefill of the mean
    prompt plus `mean_output` decode steps at that same batch, from the realistic cost model (a fixed point)."""
    if w.concurrency is not None:
        return float(w.concurrency)
    assert w.rate is not None
    hw = hardware.get(w.gpu)
    prompt = max(1, round(w.mean_input))
    context = max(1, round(w.mean_resident))
    prefill = roofline.prefill_time(w.model, hw, 1, prompt, w.weight_dtype, w.kv_dtype, realistic=True) / (
        w.tp * w.pp
    )
    in_flight = 1.0
    for _ in range(50):
        batch = max(1, math.ceil(in_flight))
        step = (
            roofline.decode_step_time(w.model, hw, batch, context, w.weight_dtype, w.kv_dtype, realistic=True)
            / w.tp
        )
        new = w.rate * (prefill + w.mean_output * step)
        if abs(new - in_flight) < 1e-3:
            break
        in_flight = new
    return in_flight


def _smallest_fitting_tp(w: Workload) -> int | None:
    spec = arch.describe(arch.get(w.model))
    for tp in (2**k for k in range(7)):
        try:
            sizing.check_parallel(spec, tp, w.pp)
        except ValueError:
            continue
        if _memory(w, tp=tp).fits:
            return tp
    return None


def diagnose(w: Workload) -> Diagnosis:
    """Every lever of the book's order, evaluated on `w`; `Diagnosis.first` is where to start."""
    memory = _memory(w)
    spec = arch.describe(arch.get(w.model))
    in_flight = concurrency(w)
    resident = in_flight * w.mean_resident  # tokens the load keeps in the cache on average
    pool = memory.max_tokens() if memory.fits else 0
    limit = w.context_limit
    per_token = memory.kv_bytes_per_token
    levers: list[Lever] = []

    # 1. Context and output statistics.
    worst_case = (
        pool // limit if limit else 0
    )  # what vLLM logs: "Maximum concurrency for N tokens per request"
    typical = pool // max(1, math.ceil(w.mean_length))
    oversized = limit >= OVERSIZED_CONTEXT * w.mean_length
    needed_len = w.longest_input + w.longest_output
    applies = memory.fits and oversized and needed_len < limit and worst_case < in_flight <= typical
    levers.append(
        Lever(
            1,
            "context and output statistics",
            applies,
            (
                f"max_model_len {limit:,} is {limit / w.mean_length:.0f}x the mean request ({w.mean_length:,.0f} "
                f"tokens): the worst-case bound admits {worst_case:,} requests, the measured lengths {typical:,}; "
                f"set max_model_len to the longest request you serve ({needed_len:,})"
                if applies
                else f"max_model_len {limit:,} against a mean request of {w.mean_length:,.0f} tokens: "
                + (
                    "the worst-case bound already covers the load"
                    if worst_case >= in_flight
                    else "not the limit"
                )
            ),
            ("05_active_tokens/index", "06_long_context/index"),
            f"--max-model-len {needed_len}",
            f"--context-length {needed_len}",
            {"worst_case": worst_case, "typical": typical, "ratio": limit / w.mean_length},
        )
    )

    # 2. Active sequences and tokens.
    fits_seqs = pool // max(1, math.ceil(w.mean_resident))
    applies = memory.fits and resident > pool
    levers.append(
        Lever(
            2,
            "active sequences and tokens",
            applies,
            (
                f"{in_flight:,.1f} requests in flight hold {resident:,.0f} tokens on average; the pool holds "
                f"{pool:,} ({fits_seqs:,} such requests): cap the running requests there or requests are preempted"
                if applies
                else f"{resident:,.0f} resident tokens of a {pool:,}-token pool ({resident / max(pool, 1):.0%})"
            ),
            ("05_active_tokens/index", "08_continuous_batching/index"),
            f"--max-num-seqs {max(1, fits_seqs)} (or a higher --gpu-memory-utilization)",
            f"--max-running-requests {max(1, fits_seqs)} (or a higher --mem-fraction-static)",
            {"resident": resident, "pool": pool, "fits_seqs": fits_seqs},
        )
    )

    # 3. MHA/GQA/MQA.
    attention = spec.attention_type
    gqa_per_token = (
        per_token * min(GQA_HEADS, spec.kv_heads) // spec.kv_heads if attention == "MHA" else per_token
    )
    applies = memory.fits and attention == "MHA" and resident > pool
    levers.append(
        Lever(
            3,
            "MHA/GQA/MQA",
            applies,
            (
                f"{attention}: {spec.kv_heads} KV heads cost {format_bytes(per_token)} per token; a GQA model "
                f"with {GQA_HEADS} KV heads and the same layers would store {format_bytes(gqa_per_token)}"
                if applies
                else f"{attention} with {spec.kv_heads} KV head(s): {format_bytes(per_token)} per token"
            ),
            ("02_sizing/index",),
            "a model with grouped-query (GQA), multi-query (MQA) or latent (MLA) attention; no engine flag",
            "the same: a model choice, no server flag",
            {"per_token": per_token, "gqa_per_token": gqa_per_token},
        )
    )

    # 4. KV precision.
    wide = w.kv_dtype in ("fp32", "fp16", "bf16")
    fp8_pool = _memory(w, kv_dtype="fp8").max_tokens() if memory.fits and wide else pool
    applies = memory.fits and wide and resident > pool
    levers.append(
        Lever(
            4,
            "KV precision",
            applies,
            (
                f"{w.kv_dtype} cache: fp8 would hold {fp8_pool:,} tokens instead of {pool:,} "
                f"({fp8_pool / max(pool, 1):.2f}x)"
                + (", enough for the load" if fp8_pool >= resident else "")
                if applies
                else f"{w.kv_dtype} cache" + (": the load fits without narrowing it" if wide else "")
            ),
            ("11_kv_quantization/index",),
            "--kv-cache-dtype fp8",
            "--kv-cache-dtype fp8_e5m2 (or fp8_e4m3)",
            {"fp8_pool": fp8_pool},
        )
    )

    # 5. Prefix reuse.
    shared = w.prefix_fraction * w.prefix_len  # prompt tokens per request a prefix cache could serve
    share = shared / w.mean_input
    applies = not w.prefix_caching and share >= PREFIX_SHARE
    levers.append(
        Lever(
            5,
            "prefix reuse",
            applies,
            (
                f"{w.prefix_fraction:.0%} of requests start with the same {w.prefix_len:,} tokens: {share:.0%} of "
                "the mean prompt is recomputed and stored once per request; cache it once"
                if applies
                else (
                    "prefix caching is on"
                    if w.prefix_caching
                    else f"shared prefix {share:.0%} of the mean prompt: too little to matter"
                )
            ),
            ("09_prefix_caching/index",),
            "--enable-prefix-caching",
            "radix cache (on unless --disable-radix-cache) with --schedule-policy lpm (default fcfs)",
            {"share": share, "shared_tokens": shared},
        )
    )

    # 6. Paging and fragmentation.
    if w.paged:
        waste = in_flight * (w.block_size - 1) / 2  # half a block per running request on average
        frag = waste / max(resident, 1)
        applies = memory.fits and frag > FRAGMENTATION_SHARE and resident + waste > pool  # waste that binds
        why = (
            f"blocks of {w.block_size} tokens waste ~{frag:.0%} of {resident:,.0f} resident tokens on requests this "
            "short, and the pool is full; use smaller blocks"
            if applies
            else f"paged in blocks of {w.block_size}: ~{frag:.1%} lost to the last block of each request"
        )
    else:
        waste = in_flight * max(0.0, limit - w.mean_resident)
        frag = waste / max(in_flight * limit, 1)
        applies = memory.fits and frag > FRAGMENTATION_SHARE and in_flight * limit > pool
        why = (
            f"contiguous reservations of max_model_len leave {frag:.0%} of the reserved cache empty, and "
            f"{in_flight:,.0f} reservations ({in_flight * limit:,.0f} tokens) exceed the {pool:,}-token pool; page it"
            if applies
            else f"contiguous reservations: {frag:.1%} empty"
        )
    levers.append(
        Lever(
            6,
            "paging and fragmentation",
            applies,
            why,
            ("07_paging/index",),
            "paged by default; --block-size 16 (or smaller)",
            "paged by default; --page-size 1",
            {"fragmentation": frag},
        )
    )

    # 7. Batching of short requests.
    cap = w.max_num_seqs
    room = pool // max(1, math.ceil(w.mean_resident))
    applies = memory.fits and in_flight > cap and room > cap
    levers.append(
        Lever(
            7,
            "batching of short requests",
            applies,
            (
                f"max_num_seqs {cap} caps the batch below the {in_flight:,.0f} requests in flight while the pool "
                f"holds {room:,}: raise it (decode is memory-bound until the critical batch)"
                if applies
                else f"max_num_seqs {cap} against {in_flight:,.1f} in flight and room for {room:,}"
            ),
            ("08_continuous_batching/index", "04_bandwidth_bound/index"),
            f"--max-num-seqs {min(room, math.ceil(in_flight))} (and --max-num-batched-tokens)",
            f"--max-running-requests {min(room, math.ceil(in_flight))} (and --chunked-prefill-size)",
            {"room": room, "cap": cap},
        )
    )

    # 8. True long-context capacity.
    longest = w.longest_input + w.longest_output
    longest_share = longest / max(pool, 1)
    applies = memory.fits and longest_share >= LONG_REQUEST_SHARE
    levers.append(
        Lever(
            8,
            "true long-context capacity",
            applies,
            (
                f"one longest request ({longest:,} tokens, {format_bytes(longest * per_token)}) takes "
                f"{longest_share:.0%} of the pool: few fit at once whatever the scheduler does"
                if applies
                else f"the longest request takes {longest_share:.1%} of the pool"
            ),
            ("06_long_context/index", "12_beyond_hbm/index"),
            "--max-model-len to what you serve; KV offload beyond HBM (chapter 12)",
            "--context-length; --enable-hierarchical-cache beyond HBM",
            {"longest_share": longest_share, "longest": longest},
        )
    )

    # 9. Multi-GPU topology.
    tp_fit = None if memory.fits else _smallest_fitting_tp(w)
    applies = not memory.fits
    levers.append(
        Lever(
            9,
            "multi-GPU topology",
            applies,
            (
                f"the weights ({format_bytes(memory.weight_bytes)} per GPU) leave no KV pool on one "
                f"{hardware.get(w.gpu).name}; "
                + (
                    f"tensor parallelism {tp_fit} is the smallest that fits"
                    if tp_fit
                    else "no TP up to 64 fits"
                )
                if applies
                else f"fits at tp={w.tp}, pp={w.pp}"
            ),
            ("13_many_gpus/index",),
            f"--tensor-parallel-size {tp_fit or w.tp} (--pipeline-parallel-size across nodes)",
            f"--tp-size {tp_fit or w.tp} (--pp-size for stages, --dp-size for replicas)",
            {"tp_fit": float(tp_fit or 0)},
        )
    )
    if not memory.fits:  # nothing else can act before the model fits
        levers = [
            lever
            if lever.step == 9
            else dataclasses.replace(lever, applies=False, why="needs a KV pool first")
            for lever in levers
        ]
    return Diagnosis(w, memory, in_flight, tuple(levers))


FIELDS = {f.name for f in dataclasses.fields(Workload)}
TOKEN_FIELDS = {"max_input", "max_output", "max_model_len", "prefix_len", "max_num_batched_tokens"}


def workload_from_dict(data: dict[str, Any]) -> Workload:
    """A `Workload` from a mapping (keys may use dashes); unknown keys and bad values are `WorkloadError`s."""
    if not isinstance(data, dict) or not data:
        raise WorkloadError(
            "the workload is empty: give at least model, gpu, mean_input, mean_output and a load"
        )
    clean: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise WorkloadError(f"unknown field {key!r}; known fields: {', '.join(sorted(FIELDS))}")
        if name in TOKEN_FIELDS and isinstance(value, str):
            try:
                value = parse_tokens(value)
            except ValueError as err:
                raise WorkloadError(f"{key}: {err}") from None
        clean[name] = value
    missing = [name for name in ("model", "gpu", "mean_input", "mean_output") if name not in clean]
    if missing:
        raise WorkloadError(f"the workload is missing {', '.join(missing)}")
    try:
        return Workload(**clean)
    except TypeError as err:
        raise WorkloadError(str(err)) from None


def load_workload(path: str | Path) -> Workload:
    """Read a workload from a YAML, JSON or TOML file (by its suffix)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"no workload file {str(path)!r}")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise WorkloadError("reading TOML needs Python 3.11 or later; use YAML or JSON") from None
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml  # type: ignore[import-untyped]

            data = yaml.safe_load(text)
        else:
            raise WorkloadError(f"{path.name}: expected a .yaml, .yml, .json or .toml file")
    except WorkloadError:
        raise
    except Exception as err:  # each parser has its own error type
        raise WorkloadError(
            f"{path.name} is not valid {suffix[1:].upper()}: {str(err).splitlines()[0]}"
        ) from None
    return workload_from_dict(data if data is not None else {})


# Command line: `kvlab diagnose WORKLOAD [--field value ...]` (the flags override the file's fields).
_FLAG_TYPES: dict[str, Any] = {
    "model": str,
    "gpu": str,
    "mean_input": float,
    "mean_output": float,
    "max_input": parse_tokens,
    "max_output": parse_tokens,
    "rate": float,
    "concurrency": int,
    "prefix_fraction": float,
    "prefix_len": parse_tokens,
    "output_cv": float,
    "kv_dtype": str,
    "weight_dtype": str,
    "max_model_len": parse_tokens,
    "max_num_seqs": int,
    "max_num_batched_tokens": parse_tokens,
    "block_size": int,
    "gpu_memory_utilization": float,
    "tp": int,
    "pp": int,
}


def add_arguments(parser: Any) -> None:
    """The `kvlab diagnose` arguments on an argparse parser."""
    parser.add_argument(
        "workload", nargs="?", help="a workload file (.yaml, .json or .toml); or give the flags"
    )
    for name in _FLAG_TYPES:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, metavar="VALUE")
    parser.add_argument("--prefix-caching", dest="prefix_caching", action="store_true", default=None)
    parser.add_argument(
        "--contiguous",
        dest="paged",
        action="store_false",
        default=None,
        help="the engine reserves max_model_len per request (no paging)",
    )


def workload_from_args(args: Any) -> Workload:
    """The workload of a parsed `kvlab diagnose` command line: the file's fields, then the flags."""
    data: dict[str, Any] = {}
    if args.workload is not None:
        data = {
            key.replace("-", "_"): value
            for key, value in dataclasses.asdict(load_workload(args.workload)).items()
        }
    for name, kind in _FLAG_TYPES.items():
        text = getattr(args, name)
        if text is None:
            continue
        try:
            data[name] = kind(text)
        except ValueError:
            raise WorkloadError(f"--{name.replace('_', '-')}: cannot read {text!r}") from None
    if args.rate is not None:
        data.pop("concurrency", None)
    elif args.concurrency is not None:
        data.pop("rate", None)
    for name in ("prefix_caching", "paged"):
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    if not data:
        raise WorkloadError("give a workload file or --model, --gpu, --mean-input, --mean-output and a load")
    return workload_from_dict(data)
