"""Capacity planning against latency targets: `plan(...)` and `kvlab plan`.

Given a model, a GPU, a parallel layout, dtypes, engine settings, a workload and latency targets, `plan`

1. computes the memory budget line by line (`kvlab.costs.budget.memory_budget`, the one budget function) and the KV
   pool in blocks and tokens;
2. gives the maximum concurrency at the target context two ways: whole sequences in whole blocks (`MemoryBudget
   .max_sequences`), and vLLM's start-up figure ("Maximum concurrency for N tokens per request": pool tokens / N).
   Both are worst-case memory bounds (every request at the full context), not latency predictions;
3. predicts TTFT, ITL, TPOT and E2EL percentiles (vLLM's names) by simulating one data-parallel replica with
   `kvlab.planning.simulate` (kvlab's own scheduler and block manager) on a step cost from `kvlab.costs.roofline`'s realistic
   model: modelled, not measured;
4. goodput as DistServe defines it (Zhong et al., 2024, "DistServe", OSDI, arXiv:2401.09670): the highest request
   rate at which the share `attainment` of requests meets every target, found by bisection over the rate;
5. the smallest data-parallel GPU count meeting the targets at the offered rate, found by search;
6. which constraint binds: memory (the pool runs short: preemptions, a full pool), queueing (requests wait
   longer than they compute), compute or bandwidth (the step's roofline term at the batch it runs).

Data-parallel replicas split the arrival rate evenly (each sees a Poisson stream of rate / dp). Tensor
parallelism shrinks each GPU's weights, KV and FLOPs (`kvlab.specs.sizing` `tp`) and adds, per step, two ring
all-reduces per layer of the step's tokens over the GPU's link (`kvlab.costs.roofline.allreduce_buffer_bytes`, as
`kvlab.costs.roofline.tp_decode_step` counts them), plus an optional latency per all-reduce. Pipeline parallelism
(`pp` stages, `kvlab.specs.sizing` `pp`: each GPU holds its stage's layers, weights and KV) runs `pp` micro-batches in
flight, each with its own scheduler, 1/pp of the KV pool and 1/pp of the load; a step of one micro-batch passes
every stage (pp × the largest stage's time) plus pp - 1 hand-offs of its activations over the link. So PP adds
latency per step and, with pp batches in flight, keeps every stage busy. Chapter: *Capacity planning*
(book/14_capacity_planning).

Speculative decoding (`speculative=K` with a `draft` model or `draft_layers`, an EAGLE-style head; settings of
`kvlab.costs.budget.BudgetSettings`) enters the plan's memory only: the budget subtracts the drafter's weights, a
block holds the drafter's layers too (fewer blocks in the pool the simulator gets), and a sequence's worst case
holds 2K lookahead slots, capped at max_model_len = `context` as vLLM caps them (`kvlab.specs.sizing`'s
speculative section cites vLLM's source). The step cost and the simulator stay those of plain decoding: one token
per sequence per step, no draft forward and no verification of K + 1 tokens, no acceptance rate. The report says
so; latencies and goodput are not speculative ones.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvlab.costs import budget, roofline
from kvlab.costs.workloads import TraceRequest, Workload, WorkloadError
from kvlab.engine.config import EngineConfig
from kvlab.engine.metrics import SLO, RequestMetrics
from kvlab.offload.tiers import Link
from kvlab.offload.tiers import link as find_link
from kvlab.planning import cluster
from kvlab.planning.frontend import Frontend
from kvlab.planning.router import POLICIES, Router
from kvlab.planning.simulate import SimulationResult, simulate
from kvlab.specs import arch, hardware, sizing
from kvlab.specs.arch import describe, resolve


class PlanError(ValueError):
    """A plan that cannot be made: the message says why in one line."""


@dataclass(frozen=True)
class Targets:
    """Latency targets in milliseconds (None: no target) met by `percentile` % of requests."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # checked on each request's TPOT (mean ITL), as vLLM's goodput does
    e2el_ms: float | None = None
    percentile: float = 99.0

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms", "e2el_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise PlanError(f"target {name} must be a positive number of milliseconds, got {value!r}")
        if not 0 < self.percentile <= 100:
            raise PlanError(f"percentile must be in (0, 100], got {self.percentile!r}")

    @property
    def slo(self) -> SLO:
        return SLO(ttft_ms=self.ttft_ms, tpot_ms=self.itl_ms, e2el_ms=self.e2el_ms)

    def attainment(self, requests: Sequence[RequestMetrics]) -> float:
        """Share of requests meeting every target."""
        slo = self.slo
        return sum(slo.met_by(r) for r in requests) / len(requests)

    def met(self, requests: Sequence[RequestMetrics]) -> bool:
        return self.attainment(requests) >= self.percentile / 100 - 1e-12

    def refuted_by(self, num_requests: int) -> Callable[[RequestMetrics], bool]:
        """A `simulate(stop_when=...)` test for a run of `num_requests` requests: True once so many finished
        requests have missed a target that `met` is False whatever the others do."""
        slo, missed = self.slo, 0

        def refuted(request: RequestMetrics) -> bool:
            nonlocal missed
            missed += not slo.met_by(request)
            return (num_requests - missed) / num_requests < self.percentile / 100 - 1e-12

        return refuted


class RooflineStepCost:
    """A GPU step under `kvlab.costs.roofline`'s realistic model, for a batch of chunks and decodes on one TP group
    (times `pp` pipeline stages).

    Per stage: every weight byte of one GPU's share read once; each scheduled sequence's cache read up to its
    context (`kvlab.specs.sizing.kv_bytes_per_token` per GPU, growing linearly: sliding-window caps are ignored, an
    overestimate for hybrid models); 2 FLOP per active weight per new token (logits only for sampling rows) plus
    attention over the context, split `tp × pp` ways; max(compute, memory) over achievable ceilings. A step is
    `pp` stages (the largest, `kvlab.specs.sizing`'s per-GPU figures) plus the link time (`link_seconds`: TP
    all-reduces, PP hand-offs), plus the overhead.
    """

    def __init__(
        self,
        config: roofline.Config,
        gpu: str | hardware.Accelerator,
        dtype: str = "bf16",
        kv_dtype: str = "bf16",
        tp: int = 1,
        realism: roofline.Realism | None = None,
        pp: int = 1,
        allreduce_latency_s: float = 0.0,
    ) -> None:
        config = resolve(config)
        acc = hardware.get(gpu) if isinstance(gpu, str) else gpu
        sizing.check_parallel(describe(config), tp, pp)
        if allreduce_latency_s < 0:
            raise PlanError(f"allreduce_latency_s must be >= 0, got {allreduce_latency_s!r}")
        self.tp, self.pp = tp, pp
        self.realism = roofline.REALISM if realism is None else realism
        cost = roofline.model_cost(config)
        text = config.get_text_config(decoder=True)
        # An untied input-embedding table is gathered, not read whole (as kvlab.costs.roofline counts it); the rows a
        # step gathers are a few KiB per token and are left out (on the first stage, the one that holds it).
        gathered_only = cost.input_embedding_params * sizing.dtype_bytes(dtype) / tp if pp == 1 else 0.0
        self.weight_bytes = float(sizing.weight_bytes_per_gpu(text, dtype, tp=tp, pp=pp)) - gathered_only
        self.kv_per_token = float(sizing.kv_bytes_per_token(config, kv_dtype, tp=tp, pp=pp))
        self.body_flops = 2.0 * (cost.active_params - cost.lm_head_params) / (tp * pp)
        self.head_flops = 2.0 * cost.lm_head_params / tp  # on the last stage
        self.attn_flops_per_ctx = cost.attention_flops(1024) / 1024 / (tp * pp)
        self.bandwidth = acc.bandwidth_bytes_per_s * self.realism.bandwidth_efficiency
        self.flops = hardware.peak_flops(acc, dtype) * self.realism.flops_efficiency
        self.link_bytes_per_s = hardware.gpu_link_bytes_per_s(acc)
        # Per token: what each rank sends in the ring all-reduces of all layers, and one stage-to-stage hand-off.
        per_token_buffer = roofline.allreduce_buffer_bytes(config, 1, dtype)
        self.allreduce_bytes_per_token = (
            roofline.ring_allreduce_bytes_sent(per_token_buffer, tp) if tp > 1 else 0.0
        )
        self.handoff_bytes_per_token = float(text.hidden_size * sizing.dtype_bytes(dtype))
        self.allreduce_latency_s = allreduce_latency_s * 2 * describe(config).num_layers if tp > 1 else 0.0

    def parts(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> tuple[float, float]:
        """(compute seconds, memory seconds) of the step summed over its `pp` stages (each the largest), before
        the link time and the overhead."""
        tokens, context = sum(num_new_tokens), sum(context_lens)
        # Query-key pairs: n * (c - (n - 1) / 2) per sequence, summed in integers (n * (n - 1) is even), so the
        # common decode step (every n = 1) is one sum over the contexts.
        if tokens == len(num_new_tokens):
            attention = context
        else:
            # map() in C: a step with a prompt chunk sums over every running sequence.
            pairs = sum(map(operator.mul, num_new_tokens, context_lens))
            attention = pairs - (sum(map(operator.mul, num_new_tokens, num_new_tokens)) - tokens) // 2
        flops = (
            self.body_flops * tokens
            + self.head_flops * len(num_new_tokens) / self.pp
            + self.attn_flops_per_ctx * attention
        )
        moved = self.weight_bytes + self.kv_per_token * context
        return self.pp * flops / self.flops, self.pp * moved / self.bandwidth

    def link_seconds(self, num_new_tokens: Sequence[int]) -> float:
        """Link time of the step: TP's ring all-reduces of every token's activations (two per layer, plus their
        latency) and PP's pp - 1 hand-offs of them; not overlapped with compute (an upper bound)."""
        tokens = sum(num_new_tokens)
        allreduce = tokens * self.allreduce_bytes_per_token / self.link_bytes_per_s + self.allreduce_latency_s
        handoff = (self.pp - 1) * tokens * self.handoff_bytes_per_token / self.link_bytes_per_s
        return allreduce + handoff

    def __call__(self, num_new_tokens: Sequence[int], context_lens: Sequence[int]) -> float:
        return (
            max(self.parts(num_new_tokens, context_lens))
            + self.link_seconds(num_new_tokens)
            + self.realism.step_overhead_s
        )


@dataclass
class Plan:
    """What `plan` found; `report()` is the text `kvlab plan` prints."""

    model: str
    gpu: str
    tp: int
    dp: int
    context: int
    budget: budget.MemoryBudget
    max_sequences: int
    vllm_max_concurrency: float
    summary: dict[str, float]
    attainment: float
    targets: Targets
    meets_targets: bool
    goodput_rps: float
    binding: str
    offered: str
    searched: list[tuple[int, float, bool]] = field(default_factory=list)  # (dp, attainment, met)
    pp: int = 1
    link_ms: float = 0.0  # TP all-reduce + PP hand-off time of a decode step of the mean batch
    speculation: str = ""  # the speculative settings the memory was sized with ("" when off)
    # The search's top still met the targets: goodput_rps is a lower bound (a short trace cannot tell more).
    goodput_is_lower_bound: bool = False
    # The front end's fixed delay per request inside every TTFT and latency below (`kvlab.planning.frontend`)
    frontend_ms: float = 0.0

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def engines(self) -> int:
        """Schedulers serving the load: dp replicas × pp micro-batches in flight."""
        return self.dp * self.pp

    def report(self) -> str:
        s, t = self.summary, self.targets
        p = f"p{t.percentile:g}"
        lines = [
            f"plan         {self.model} on {self.num_gpus} × {self.gpu} (tp={self.tp}, pp={self.pp}, dp={self.dp}); "
            f"load {self.offered}",
            "memory budget, one GPU:",
            *self.budget.lines(self.context),
            f"KV pool      {self.budget.num_blocks:,} blocks × {self.budget.block_size} tokens = "
            f"{self.budget.max_tokens():,} tokens per replica"
            + (f", split over {self.pp} micro-batches in flight" if self.pp > 1 else ""),
            f"concurrency  {self.max_sequences:,} sequences of {self.context:,} tokens in whole blocks; vLLM's "
            f"start-up line would say {self.vllm_max_concurrency:.2f}x (a worst-case memory bound, not a latency "
            "prediction)",
            "modelled latencies (kvlab.planning.simulate on the realistic roofline cost; not measured):",
        ]
        if self.frontend_ms:
            lines[-1] = (
                "modelled latencies (kvlab.planning.simulate on the realistic roofline cost, plus a front-end delay "
                f"of {self.frontend_ms:g} ms per request; not measured):"
            )
        if self.speculation:
            lines[-1:-1] = [
                f"speculation  {self.speculation}: in the memory budget and the pool only; throughput and latencies "
                "below are modelled WITHOUT speculation (one token per sequence per step, no draft forward, no "
                "acceptance rate)",
            ]
        for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2EL", "e2el")):
            lines.append(
                f"  {name:<5} p50 {s[f'p50_{key}_ms']:9.1f} ms   p95 {s[f'p95_{key}_ms']:9.1f} ms   "
                f"p99 {s[f'p99_{key}_ms']:9.1f} ms"
            )
        targets = ", ".join(
            f"{n} <= {v:g} ms" for n, v in (("TTFT", t.ttft_ms), ("TPOT", t.itl_ms), ("E2EL", t.e2el_ms)) if v
        )
        verdict = "met" if self.meets_targets else "NOT met"
        lines += [
            f"throughput   {s['request_throughput'] * self.engines:.2f} req/s, "
            f"{s['output_throughput'] * self.engines:,.0f} output tok/s over {self.dp} replica(s); preemptions "
            f"{int(s['num_preemptions'])} per scheduler",
            f"targets      {targets or 'none'} for {t.percentile:g}% of requests: {verdict} "
            f"({self.attainment:.1%} attain, {p})",
            f"goodput      {'>= ' if self.goodput_is_lower_bound else ''}{self.goodput_rps:.2f} req/s "
            f"(DistServe, arXiv:2401.09670: highest rate with {t.percentile:g}% attaining), over {self.dp} "
            "replica(s)"
            + (
                "; the search's top still met the targets: a lower bound (more --requests search further)"
                if self.goodput_is_lower_bound
                else ""
            ),
            f"binds        {self.binding}",
        ]
        if self.tp > 1 or self.pp > 1:
            lines.insert(
                -1,
                f"links        {self.link_ms:.3f} ms per decode step of the mean batch (TP all-reduces, "
                "PP hand-offs; modelled, not overlapped)",
            )
        if self.searched:
            tried = ", ".join(f"{d * self.tp * self.pp} GPUs {a:.0%}" for d, a, _ in self.searched)
            lines.append(f"GPU search   {tried}")
        return "\n".join(lines)


def _binding(result: SimulationResult, s: dict[str, float], cost: RooflineStepCost) -> str:
    """Which constraint binds the run `result`, whose summary is `s`."""
    if result.num_preemptions or s["peak_kv_utilisation"] >= 0.98:
        return f"memory: the KV pool ran full (peak {s['peak_kv_utilisation']:.0%}, {result.num_preemptions} preemptions)"
    queue = sorted(r.queue_time for r in result.requests)
    ttft = sorted(r.ttft for r in result.requests)
    if queue[len(queue) // 2] > 0.5 * ttft[len(ttft) // 2]:
        return (
            "queueing: requests wait longer than their prefill takes (the load is past what the GPU serves)"
        )
    batch = max(1, round(s["mean_running"]))
    context = round(
        sum(r.num_prompt_tokens + r.num_output_tokens / 2 for r in result.requests) / len(result.requests)
    )
    compute, memory = cost.parts([1] * batch, [context] * batch)
    link = cost.link_seconds([1] * batch)
    if link > max(compute, memory):
        return (
            f"links: a decode step of the mean batch ({batch}) spends longer on GPU links ({link * 1e3:.2f} ms) "
            f"than on compute ({compute * 1e3:.2f} ms) or memory ({memory * 1e3:.2f} ms)"
        )
    regime = "compute" if compute > memory else "bandwidth"
    return f"{regime}: a decode step of the mean batch ({batch}) is {regime}-bound (compute {compute * 1e3:.2f} ms, memory {memory * 1e3:.2f} ms)"


def plan(
    model: str,
    gpu: str,
    *,
    context: int = 8192,
    workload: Workload,
    targets: Targets,
    settings: budget.BudgetSettings | None = None,
    enable_prefix_caching: bool = True,
    dp: int | None = None,
    max_gpus: int = 64,
    realism: roofline.Realism | None = None,
    allreduce_latency_s: float = 0.0,
    speculative: int | None = None,
    draft: str | None = None,
    draft_layers: int | None = None,
    frontend: Frontend | None = None,
) -> Plan:
    """Plan `model` on `gpu` (see the module docstring) at `settings` (vLLM's defaults when None: their tp and
    pp, dtypes and engine limits). `dp=None` searches the smallest data-parallel count (up to `max_gpus` GPUs in
    all, tp × pp per replica) meeting `targets` at the workload's rate; a given `dp` is evaluated as is.
    `speculative`, `draft` and `draft_layers`, when given, replace the settings' (memory only: see the module
    docstring). `frontend` adds the serving front end's fixed delay per request to each TTFT and latency
    (`kvlab.planning.frontend`; none by default)."""
    settings = settings or budget.BudgetSettings()
    frontend = frontend or Frontend()
    try:
        settings = dataclasses.replace(
            settings,
            speculative=settings.speculative if speculative is None else speculative,
            draft=settings.draft if draft is None else draft,
            draft_layers=settings.draft_layers if draft_layers is None else draft_layers,
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    tp, pp, weight_dtype, kv_dtype = settings.tp, settings.pp, settings.weight_dtype, settings.kv_dtype
    if not isinstance(weight_dtype, str):
        raise PlanError(
            f"the step-cost model needs a weight dtype ({', '.join(budget.DTYPES)}), got {weight_dtype!r}"
        )
    acc = hardware.get(gpu) if isinstance(gpu, str) else gpu
    config = resolve(model)
    if context < 2:
        raise PlanError(f"context must be >= 2 tokens, got {context}")
    if tp < 1 or pp < 1 or (dp is not None and dp < 1) or max_gpus < tp * pp:
        raise PlanError(
            f"need tp >= 1, pp >= 1, dp >= 1 and max_gpus >= tp × pp, got tp={tp}, pp={pp}, dp={dp}, "
            f"max_gpus={max_gpus}"
        )
    try:
        sizing.check_parallel(describe(config), tp, pp)
    except ValueError as err:
        raise PlanError(str(err)) from None
    try:
        mb = settings.memory_budget(config, acc)
    except (
        arch.UnknownModelError,
        ValueError,
    ) as err:  # e.g. a draft kvlab cannot size, or K without a drafter
        if not settings.speculative and settings.draft is None and not settings.draft_layers:
            raise
        raise PlanError(str(err)) from None
    if mb.lookahead_slots:
        # The planned engine's max_model_len is `context`: no sequence holds slots past it.
        mb = dataclasses.replace(mb, max_model_len=context)
    # The simulated engine runs at the limits the budget was sized at: vLLM's choice for this GPU when unset.
    max_num_batched_tokens, max_num_seqs = settings.batch_limits(acc, config)
    layout = f"tp={tp}" + (f", pp={pp}" if pp > 1 else "")
    if not mb.fits:
        short = sizing.weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp)
        raise PlanError(
            f"{model} does not fit one {acc.name} at {layout}: weights alone take {short / 2**30:.1f} GiB of "
            f"{acc.memory_bytes / 2**30:.1f} GiB and no KV block is left; raise --tp/--pp or use a larger GPU"
        )
    # With pp micro-batches in flight, each scheduler gets 1/pp of the pool.
    blocks_per_scheduler = mb.num_blocks // pp
    if blocks_per_scheduler * mb.block_size < context + mb.block_size:
        raise PlanError(
            f"not one sequence of {context:,} tokens fits the KV pool of {mb.max_tokens():,} tokens on {acc.name} "
            f"at {layout}"
            + (f" (1/{pp} of it per micro-batch)" if pp > 1 else "")
            + "; raise --tp, shorten --context or lower the KV precision"
        )
    cost = RooflineStepCost(config, acc, weight_dtype, kv_dtype, tp, realism, pp, allreduce_latency_s)
    vocab = config.get_text_config(decoder=True).vocab_size
    # Random prompts share nothing beyond the workload's prefix: hashing their blocks would only cost time.
    caching = enable_prefix_caching and workload.prefix_fraction > 0 and workload.prefix_len > 0

    # Each search step rescales one draw of the trace's arrivals instead of drawing every prompt again.
    trace_at = workload.traces(vocab, max_model_len=context)

    def capped_trace(rate: float | None) -> list[TraceRequest]:
        """The workload's trace at `rate`, lengths capped to fit `context` (the engine's max_model_len)."""
        try:
            return trace_at(rate)
        except WorkloadError as err:
            raise PlanError(str(err)) from None

    def run(
        replicas: int, rate: float | None = None, verdict: bool = False, first: int | None = None
    ) -> SimulationResult:
        """One scheduler's share of the load (replicas × pp schedulers): the workload's own, or an open-loop
        `rate` over all replicas. With `verdict`, the run stops once the targets are missed for good; with
        `first`, only the trace's first requests run."""
        schedulers = replicas * pp
        if rate is not None:
            per_replica: float | None = rate / schedulers
            conc = None
        elif workload.concurrency is not None:
            per_replica, conc = None, max(1, workload.concurrency // schedulers)
        else:
            per_replica, conc = (workload.rate or 0.0) / schedulers, None
        return serve(capped_trace(per_replica)[:first], conc, verdict)

    def serve(trace: list[TraceRequest], concurrency: int | None, verdict: bool = False) -> SimulationResult:
        """One replica of the planned engine serving `trace`."""
        return frontend.served(
            simulate(
                frontend.arrivals(trace),
                cost,
                num_blocks=blocks_per_scheduler,
                block_size=mb.block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=context,
                enable_prefix_caching=caching,
                concurrency=concurrency,
                record_steps=False,
                progress=f"simulating {layout}",
                stop_when=targets.refuted_by(len(trace)) if verdict else None,
            )
        )

    # Targets no GPU count meets: even a request alone on an idle replica misses them.
    alone = serve(capped_trace(None)[:20], 1)
    if not targets.met(alone.requests):
        s = alone.summary(qs=(targets.percentile,))
        q = f"p{targets.percentile:g}"
        missed = (
            "; ".join(
                f"{name} {q} {s[f'{q}_{key}_ms']:.1f} ms > {target:g} ms"
                for name, key, target in (
                    ("TTFT", "ttft", targets.ttft_ms),
                    ("TPOT", "tpot", targets.itl_ms),
                    ("E2EL", "e2el", targets.e2el_ms),
                )
                if target is not None and s[f"{q}_{key}_ms"] > target
            )
            or f"only {targets.attainment(alone.requests):.0%} of requests attain them"
        )
        raise PlanError(
            f"no GPU count meets the targets: one request alone on an idle {acc.name} ({layout}) already misses "
            f"them ({missed})"
        )
    searched: list[tuple[int, float, bool]] = []
    # The search's run at the chosen count is the plan's result: it is not simulated twice.
    chosen_run: SimulationResult | None = None
    if dp is None:
        chosen = None
        for replicas in range(1, max_gpus // (tp * pp) + 1):
            candidate = run(replicas)
            attained = targets.attainment(candidate.requests)
            searched.append((replicas, attained, targets.met(candidate.requests)))
            if searched[-1][2]:
                chosen, chosen_run = replicas, candidate
                break
        if chosen is None:
            raise PlanError(
                f"no GPU count up to {max_gpus} meets the targets at this load "
                f"(best attainment {max(a for _, a, _ in searched):.0%} of the {targets.percentile:g}% needed)"
            )
        dp = chosen
    result = chosen_run if chosen_run is not None else run(dp)
    met = targets.met(result.requests)
    goodput, lower_bound = _goodput(
        run, dp, targets, workload, workload.rate if met and workload.rate is not None else None, pp
    )
    summary = result.summary(targets.slo)
    offered = (
        f"{workload.rate:g} req/s" if workload.rate is not None else f"concurrency {workload.concurrency}"
    ) + f", mean {workload.mean_input:g} in / {workload.mean_output:g} out tokens"
    return Plan(
        model=model,
        gpu=acc.name,
        tp=tp,
        dp=dp,
        context=context,
        budget=mb,
        max_sequences=mb.max_sequences(context),
        vllm_max_concurrency=mb.max_tokens() / context,
        summary=summary,
        attainment=targets.attainment(result.requests),
        targets=targets,
        meets_targets=met,
        goodput_rps=goodput,
        goodput_is_lower_bound=lower_bound,
        binding=_binding(result, summary, cost),
        offered=offered,
        searched=searched,
        pp=pp,
        link_ms=cost.link_seconds([1] * max(1, round(summary["mean_running"]))) * 1e3,
        speculation=_speculation(settings, mb),
        frontend_ms=frontend.request_overhead_s * 1e3,
    )


def _speculation(settings: budget.BudgetSettings, mb: budget.MemoryBudget) -> str:
    if not mb.speculative_tokens:
        return ""
    drafter = settings.draft or f"an EAGLE-style head of {settings.draft_layers} layer(s)"
    return (
        f"K={mb.speculative_tokens} with {drafter} (draft weights {mb.draft_weight_bytes / 2**30:.2f} GiB, "
        f"+{mb.draft_kv_bytes_per_token:,} B of KV per token, {mb.lookahead_slots} lookahead slots a sequence)"
    )


# Requests of the burst run that brackets the goodput search: enough to keep the largest batch full for a while;
# a longer trace's bracket is doubled, at most MAX_WIDENINGS times, while its top still passes.
BURST_REQUESTS = 2000
MAX_WIDENINGS = 4


def _goodput(
    run: Callable[[int, float | None, bool, int | None], SimulationResult],
    dp: int,
    targets: Targets,
    workload: Workload,
    met_at: float | None,
    pp: int = 1,
) -> tuple[float, bool]:
    """DistServe's goodput over `dp` replicas: the highest request rate at which the targets hold, by bisection
    over open-loop Poisson arrivals of the workload's finite trace. The search runs from the offered rate (when
    the plan meets it; else 0) up to twice the larger of it and the burst throughput (the first
    `BURST_REQUESTS` requests at t=0). On a finite trace a rate above what the GPUs sustain can still pass while
    the queue has not yet grown: more `num_requests` make the figure stricter. Where the burst ran only a
    prefix of the trace and the top of the bracket still passes, the bracket doubles until it fails, at most
    `MAX_WIDENINGS` times; a top that still passes then is returned, a lower bound. Returns the rate and whether
    it is that lower bound."""
    burst = run(dp, math.inf, False, BURST_REQUESTS).summary()
    hi = 2 * max(burst["request_throughput"] * dp * pp, met_at or 0.0)

    def ok(rate: float) -> bool:
        # A run that missed for good stops early: its verdict is the full run's, at a fraction of the steps.
        result = run(dp, rate, True, None)
        return not result.stopped and targets.met(result.requests)

    return _highest_passing(ok, met_at or 0.0, hi, workload.num_requests > BURST_REQUESTS)


def _highest_passing(
    ok: Callable[[float], bool], lo: float, hi: float, may_widen: bool = True, steps: int = 6
) -> tuple[float, bool]:
    """The highest rate `ok` passes, searched in [lo, hi]: while `hi` passes it doubles, at most `MAX_WIDENINGS`
    times (never unless `may_widen`), and a top that still passes is returned with True (a lower bound); then
    `steps` bisections, returned with False."""
    widened = 0
    while ok(hi):
        if not may_widen or widened == MAX_WIDENINGS:
            return hi, True
        lo, hi, widened = hi, 2 * hi, widened + 1
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


# --- several GPUs as a cluster: P/D splits and routing policies (kvlab.planning.cluster) -----------------------

DEFAULT_KV_LINK = "400 Gb InfiniBand NDR"


@dataclass(frozen=True)
class ClusterRow:
    """One layout's modelled run: its name, GPUs, the run's summary and the share of requests meeting the targets."""

    layout: str
    num_gpus: int
    summary: dict[str, float]
    attainment: float
    # DistServe's goodput: the highest rate at which the targets hold (None: not searched)
    goodput_rps: float | None = None


@dataclass(frozen=True)
class ClusterPlan:
    """Layouts of the same GPUs compared on one trace (`plan_cluster`); `report()` is what `kvlab plan` adds."""

    rows: list[ClusterRow]
    targets: Targets
    offered: str
    link: str

    def report(self) -> str:
        p = f"p{self.targets.percentile:g}"
        lines = [
            f"cluster      layouts compared at {self.offered} (kvlab.planning.cluster; modelled, not measured); "
            f"P/D K/V over {self.link}",
            f"  {'layout':<28} GPUs  TTFT p50/p99 ms     ITL p50/p99 ms   prefix hits  attain {p}"
            "  goodput/GPU",
        ]
        for row in self.rows:
            s = row.summary
            goodput = "" if row.goodput_rps is None else f"{row.goodput_rps / row.num_gpus:8.2f} req/s"
            lines.append(
                f"  {row.layout:<28} {row.num_gpus:>4}  {s['p50_ttft_ms']:7.1f} / {s['p99_ttft_ms']:<8.1f}"
                f" {s['p50_itl_ms']:6.1f} / {s['p99_itl_ms']:<7.1f}  {s['prefix_hit_rate']:10.1%}  "
                f"{row.attainment:9.1%}  {goodput}"
            )
        if any(row.goodput_rps is not None for row in self.rows):
            lines.append(
                "  goodput: DistServe's (arXiv:2401.09670), the highest rate at which the targets hold, per GPU"
            )
        return "\n".join(lines)


def parse_split(text: str) -> tuple[int, int]:
    """'1:3' as (1, 3): prefill and decode GPUs, each at least 1."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or min(int(p) for p in parts) < 1:
        raise PlanError(
            f"--disagg takes P:D, prefill and decode GPUs of at least 1 each (e.g. 1:3), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def plan_cluster(
    model: str,
    gpu: str,
    *,
    context: int,
    workload: Workload,
    targets: Targets,
    settings: budget.BudgetSettings | None = None,
    enable_prefix_caching: bool = True,
    disagg: tuple[int, int] | None = None,
    router: str | None = None,
    dp: int | None = None,
    max_gpus: int = 64,
    kv_link: str = DEFAULT_KV_LINK,
    prefix_blocks: int = 4,
    goodput: bool = False,
) -> ClusterPlan:
    """Compare layouts of single-GPU engines on the workload's trace at its rate over the whole cluster.

    `disagg=(P, D)`: P prefill and D decode engines with K/V sent over `kv_link`, beside P + D colocated replicas
    (least-loaded). `router` with `dp`: `dp` colocated replicas under that policy of `kvlab.planning.router`,
    beside round-robin. Each engine has one GPU's pool and vLLM's batch limits for the GPU. With `goodput`,
    each layout's DistServe goodput is searched too (`cluster_goodput`): about ten more runs a layout."""
    settings = settings or budget.BudgetSettings()
    chosen = check_layouts(settings, workload, disagg, router, dp, max_gpus, kv_link)
    acc = hardware.get(gpu) if isinstance(gpu, str) else gpu
    config = resolve(model)
    mb = settings.memory_budget(config, acc)
    if not mb.fits or mb.num_blocks * mb.block_size < context + mb.block_size:
        raise PlanError(f"not one sequence of {context:,} tokens fits one {acc.name}'s KV pool")
    batched, seqs = settings.batch_limits(acc, config)
    engine = EngineConfig(
        block_size=mb.block_size,
        num_blocks=mb.num_blocks,
        max_num_batched_tokens=batched,
        max_num_seqs=seqs,
        max_model_len=context,
        enable_prefix_caching=enable_prefix_caching,
    )
    if not isinstance(settings.weight_dtype, str):
        raise PlanError(f"the step-cost model needs a weight dtype ({', '.join(budget.DTYPES)})")
    cost = RooflineStepCost(config, acc, settings.weight_dtype, settings.kv_dtype)
    vocab = config.get_text_config(decoder=True).vocab_size
    assert workload.rate is not None
    offered_rate = workload.rate
    try:
        trace_at = workload.traces(vocab, max_model_len=context)
        trace = trace_at(offered_rate)
    except WorkloadError as err:
        raise PlanError(str(err)) from None
    rows = []

    def add(layout: str, gpus: int, run: Callable[[list[TraceRequest]], cluster.ClusterResult]) -> None:
        result = run(trace)
        best = cluster_goodput(lambda rate: run(trace_at(rate)), targets, offered_rate) if goodput else None
        summary = result.summary(targets.slo)
        rows.append(ClusterRow(layout, gpus, summary, targets.attainment(result.requests), best))

    if disagg is not None:
        p, d = disagg
        add(f"colocated × {p + d}", p + d, lambda t: cluster.simulate_colocated(t, cost, engine, p + d))
        transfer = cluster.Transfer.over(chosen, sizing.kv_bytes_per_token(config, settings.kv_dtype))
        add(
            f"{p} prefill : {d} decode",
            p + d,
            lambda t: cluster.simulate_disaggregated(t, cost, cost, engine, engine, p, d, transfer),
        )
    if router is not None and dp is not None:
        for policy in dict.fromkeys(["round_robin", router]):
            add(
                f"{dp} replicas, {policy}",
                dp,
                lambda t, policy=policy: cluster.simulate_colocated(  # type: ignore[misc]
                    t, cost, engine, dp, Router(policy, prefix_blocks)
                ),
            )
    offered = (
        f"{workload.rate:g} req/s, mean {workload.mean_input:g} in / {workload.mean_output:g} out tokens"
    )
    return ClusterPlan(rows, targets, offered, chosen.name)


def check_layouts(
    settings: budget.BudgetSettings,
    workload: Workload,
    disagg: tuple[int, int] | None,
    router: str | None,
    dp: int | None,
    max_gpus: int,
    kv_link: str,
) -> Link:
    """`plan_cluster`'s arguments checked before anything runs (a one-line `PlanError`); the K/V link."""
    if disagg is None and router is None:
        raise PlanError("plan_cluster needs disagg=(P, D) or a router policy")
    if settings.tp != 1 or settings.pp != 1:
        raise PlanError("--disagg and --router model single-GPU engines: leave --tp and --pp at 1")
    if workload.rate is None:
        raise PlanError("--disagg and --router need an open-loop load: give --rate, not --concurrency")
    if router is not None and router not in POLICIES:
        raise PlanError(f"unknown --router {router!r}; known: {', '.join(POLICIES)}")
    if router is not None and dp is None:
        raise PlanError("--router needs --dp N, the replicas it routes over")
    counts = [sum(disagg)] if disagg is not None else []
    counts += [dp] if router is not None and dp is not None else []
    if max(counts) > max_gpus:
        raise PlanError(f"the layouts need {max(counts)} GPUs, more than --max-gpus {max_gpus}")
    try:
        return find_link(kv_link)
    except ValueError as err:
        raise PlanError(str(err)) from None


def cluster_goodput(
    run: Callable[[float], cluster.ClusterResult], targets: Targets, offered: float, steps: int = 6
) -> float:
    """DistServe's goodput of one layout: the highest request rate at which `targets` hold, by bisection over
    `run(rate)` (the same trace draw at each rate). The bracket starts at twice `offered` and doubles, at most
    `MAX_WIDENINGS` times, while its top still passes; a top that still passes then is returned, a lower bound.
    0.0 when not even a tenth of the offered rate passes."""

    def ok(rate: float) -> bool:
        return targets.met(run(rate).requests)

    if not ok(offered / 10):
        return 0.0
    rate, _ = _highest_passing(ok, offered / 10, 2 * offered, steps=steps)
    return rate
