"""Where to start: from a workload description to the first KV-cache lever that applies, with the numbers.

`diagnose(deployment)` walks the optimisation order of the book's chapter *Where to start* (claim 18) and
reports, for every lever, whether it applies to this deployment, why, and with which figures; each lever is one
function of a `Situation` (the deployment, its budget and the load it keeps in flight), in `LEVERS`:

1. context and output statistics (does `max_model_len` stop the engine, or reserve per request?) -- 5, 6
2. active sequences and tokens (does the pool hold the tokens the load keeps resident?) -- chapter 5
3. MHA/GQA/MQA (is the model's attention the reason a token costs so much?)             -- chapter 2
4. KV precision (would fp8 make the resident tokens fit?)                                -- chapter 11
5. prefix reuse (is a shared prefix recomputed and stored once per request?)             -- chapter 9
6. paging and fragmentation (contiguous reservations, or big blocks on short requests)  -- chapter 7
7. batching of short requests (does `max_num_seqs` cap the batch below the load?)       -- chapters 4, 8
8. true long-context capacity (does one long request take a large share of the pool?)   -- chapters 6, 12
9. multi-GPU topology (do the weights fit one GPU at all? what TP would?)               -- chapter 13
10. token eviction (would keeping a share of each request's tokens make the load fit?)  -- chapter 16

The first lever that applies is the one to use first. Every memory figure comes from `kvlab.costs.budget.memory_budget`
(the one KV budget) and `kvlab.specs.sizing`; the concurrency an arrival rate keeps in flight comes from Little's law
with the realistic step-cost model of `kvlab.costs.roofline` (*modelled*, not measured).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.checks import check_count
from kvlab.costs.budget import DTYPES, BudgetSettings, MemoryBudget
from kvlab.costs.workloads import Workload, WorkloadError
from kvlab.specs import arch, hardware, sizing
from kvlab.specs.shape import shape
from kvlab.units import format_bytes, parse_tokens

VLLM_DOCS = "https://docs.vllm.ai/en/latest/configuration/engine_args.html"
SGLANG_DOCS = "https://docs.sglang.io/advanced_features/server_arguments.html"

# Thresholds of the rules below: each one a stated choice, not a measured constant.
OVERSIZED_CONTEXT = 4.0  # max_model_len at least this many times the mean request length
PREFIX_SHARE = 0.25  # a shared prefix at least this share of the mean prompt is worth caching
FRAGMENTATION_SHARE = 0.10  # block rounding above this share of the resident tokens
LONG_REQUEST_SHARE = 0.25  # one longest request taking at least this share of the pool
GQA_HEADS = 8  # the KV heads of the GQA alternative an MHA model is compared with (Llama-3's choice)
# The keep ratio lever 10 prices: half of each request's tokens, the larger ratio chapter 16 measures
EVICTION_KEEP_RATIO = 0.5
# Neither engine ships token eviction; the open proposals a reader can follow
EVICTION_VLLM = (
    "no flag: vLLM 0.33 does not evict tokens (proposal: github.com/vllm-project/vllm/issues/5751)"
)
EVICTION_SGLANG = (
    "no flag: SGLang does not evict tokens (proposal: github.com/sgl-project/sglang/issues/12607)"
)


@dataclass(frozen=True)
class Deployment:
    """A model on a GPU, the engine's settings (vLLM's names) and the workload it serves."""

    model: str
    gpu: str
    workload: Workload
    settings: BudgetSettings = BudgetSettings()
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    prefix_caching: bool = False
    paged: bool = True  # False: every request reserves max_model_len contiguously

    def __post_init__(self) -> None:
        try:
            spec = shape(self.model).spec
        except (arch.UnknownModelError, arch.UnsupportedConfigError) as err:
            message = str(err.args[0]) if err.args else str(err)
            raise WorkloadError(
                message if "unknown model" in message else f"model {self.model!r}: {message}"
            ) from None
        try:
            hardware.get(self.gpu)
        except hardware.UnknownAcceleratorError as err:
            raise WorkloadError(str(err.args[0]) if err.args else str(err)) from None
        if self.max_model_len is not None:
            check_count("max_model_len", self.max_model_len, 1, WorkloadError)
        if not isinstance(self.settings.weight_dtype, str):
            # The step-cost model that turns a rate into requests in flight reads a dtype, not a bit count.
            raise WorkloadError(
                f"weight_dtype must be one of {', '.join(DTYPES)}, got {self.settings.weight_dtype!r}"
            )
        try:
            sizing.check_parallel(spec, self.settings.tp, self.settings.pp)
        except ValueError as err:
            raise WorkloadError(str(err)) from None

    @property
    def model_max_len(self) -> int:
        limit = shape(self.model).max_context
        return int(limit) if limit else 2048

    @property
    def context_limit(self) -> int:
        """max_model_len as the engine would run it."""
        return self.max_model_len or self.model_max_len


@dataclass(frozen=True)
class Lever:
    """One step of the optimisation order, as it applies to one deployment."""

    step: int
    name: str
    applies: bool
    why: str
    chapters: tuple[str, ...]  # book pages that measure it, relative to book/
    vllm: str
    sglang: str
    numbers: dict[str, float] = field(default_factory=dict)

    def line(self, width: int = 1) -> str:
        """The report's line for this lever, its step number right-aligned to `width` digits."""
        mark = "APPLIES" if self.applies else "ok     "
        return f"{self.step:>{width}}. {mark} {self.name}: {self.why}"


@dataclass(frozen=True)
class Step:
    """What a lever keeps whatever the deployment: its place in the order, its name, the pages that measure it,
    and the engine settings it maps to where they do not depend on the figures."""

    number: int
    name: str
    chapters: tuple[str, ...]
    vllm: str = ""
    sglang: str = ""

    def lever(
        self, applies: bool, why: str, numbers: dict[str, float], vllm: str = "", sglang: str = ""
    ) -> Lever:
        """This step on one deployment; `vllm` and `sglang`, where given, are settings computed from its figures."""
        vllm, sglang = vllm or self.vllm, sglang or self.sglang
        return Lever(self.number, self.name, applies, why, self.chapters, vllm, sglang, numbers)


# The ten steps of the book's order; levers 1, 2, 7 and 9 name settings computed from the deployment.
STEPS = {
    step.number: step
    for step in (
        Step(1, "context and output statistics", ("05_active_tokens/index", "06_long_context/index")),
        Step(2, "active sequences and tokens", ("05_active_tokens/index", "08_continuous_batching/index")),
        Step(
            3,
            "MHA/GQA/MQA",
            ("02_sizing/index",),
            "a model with grouped-query (GQA), multi-query (MQA) or latent (MLA) attention; no engine flag",
            "the same: a model choice, no server flag",
        ),
        Step(
            4,
            "KV precision",
            ("11_kv_quantization/index",),
            "--kv-cache-dtype fp8",
            "--kv-cache-dtype fp8_e5m2 (or fp8_e4m3)",
        ),
        Step(
            5,
            "prefix reuse",
            ("09_prefix_caching/index",),
            "--enable-prefix-caching",
            "radix cache (on unless --disable-radix-cache) with --schedule-policy lpm (default fcfs)",
        ),
        Step(
            6,
            "paging and fragmentation",
            ("07_paging/index",),
            "paged by default; --block-size 16 (or smaller)",
            "paged by default; --page-size 1",
        ),
        Step(7, "batching of short requests", ("08_continuous_batching/index", "04_bandwidth_bound/index")),
        Step(
            8,
            "true long-context capacity",
            ("06_long_context/index", "12_beyond_hbm/index"),
            "--max-model-len to what you serve; KV offload beyond HBM (chapter 12)",
            "--context-length; --enable-hierarchical-cache beyond HBM",
        ),
        Step(9, "multi-GPU topology", ("13_many_gpus/index",)),
        Step(10, "token eviction", ("16_fewer_tokens/index",), EVICTION_VLLM, EVICTION_SGLANG),
    )
}


@dataclass(frozen=True)
class Diagnosis:
    deployment: Deployment
    memory: MemoryBudget
    concurrency: float  # requests in flight the load keeps (given, or from the rate by Little's law)
    levers: tuple[Lever, ...]

    @property
    def workload(self) -> Workload:
        return self.deployment.workload

    @property
    def first(self) -> Lever | None:
        """The first lever, in the book's order, that applies; None when none does."""
        return next((lever for lever in self.levers if lever.applies), None)

    def report(self) -> str:
        d, w, m, s = self.deployment, self.workload, self.memory, self.deployment.settings
        load = f"{w.rate:g} requests/s" if w.rate is not None else f"{w.concurrency} requests in flight"
        lines = [
            f"workload  {d.model} on {hardware.get(d.gpu).name} (tp={s.tp}, pp={s.pp}), {load}; "
            f"{w.mean_input:g} prompt + {w.mean_output:g} output tokens on average, max_model_len {d.context_limit:,}",
            f"KV pool   {m.max_tokens():,} tokens ({format_bytes(m.kv_pool_bytes)}, "
            f"{format_bytes(m.kv_bytes_per_token)} per token, {s.kv_dtype})"
            if m.fits
            else "KV pool   none: the weights and runtime leave no room for a single block",
            f"in flight {self.concurrency:,.1f} requests, {self.concurrency * w.mean_resident:,.0f} resident tokens "
            "on average" + (" (Little's law with the realistic step-cost model, modelled)" if w.rate else ""),
            "",
        ]
        # Step numbers right-aligned, so the marks of levers 1-9 and 10 share a column
        width = len(str(max((lever.step for lever in self.levers), default=1)))
        lines += [lever.line(width) for lever in self.levers]
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


def _memory(d: Deployment, **changes: Any) -> MemoryBudget:
    return dataclasses.replace(d.settings, **changes).memory_budget(d.model, d.gpu)


def concurrency(d: Deployment) -> float:
    """Requests in flight: given, or `rate × latency` (Little's law), the latency being a prefill of the mean
    prompt plus `mean_output` decode steps at that same batch, from the realistic cost model (a fixed point)."""
    from kvlab.costs import roofline

    w, s = d.workload, d.settings
    if w.concurrency is not None:
        return float(w.concurrency)
    assert w.rate is not None and isinstance(s.weight_dtype, str)
    hw = hardware.get(d.gpu)
    prompt = max(1, round(w.mean_input))
    context = max(1, round(w.mean_resident))
    prefill = roofline.prefill_time(d.model, hw, 1, prompt, s.weight_dtype, s.kv_dtype, realistic=True) / (
        s.tp * s.pp
    )
    in_flight = 1.0
    for _ in range(50):
        batch = max(1, math.ceil(in_flight))
        step = (
            roofline.decode_step_time(d.model, hw, batch, context, s.weight_dtype, s.kv_dtype, realistic=True)
            / s.tp
        )
        new = w.rate * (prefill + w.mean_output * step)
        if abs(new - in_flight) < 1e-3:
            break
        in_flight = new
    return in_flight


@dataclass(frozen=True)
class Situation:
    """What every lever reads: the deployment, its memory budget and the load it keeps in the cache."""

    deployment: Deployment
    memory: MemoryBudget
    spec: arch.ArchSpec
    in_flight: float  # requests in flight (`concurrency`)

    @property
    def workload(self) -> Workload:
        return self.deployment.workload

    @property
    def resident(self) -> float:
        """Tokens the load keeps in the cache on average."""
        return self.in_flight * self.workload.mean_resident

    @property
    def pool(self) -> int:
        return self.memory.max_tokens() if self.memory.fits else 0

    @property
    def limit(self) -> int:
        return self.deployment.context_limit


def context_statistics(s: Situation) -> Lever:
    """1. Does `max_model_len` cost capacity? On a paged engine only when one request of that length does not fit
    the pool, so the engine refuses to start; with contiguous reservations, when the worst case admits too few."""
    w, limit, pool = s.workload, s.limit, s.pool
    # What vLLM logs at start-up: "Maximum concurrency for N tokens per request".
    worst_case = pool // limit if limit else 0
    typical = pool // max(1, math.ceil(w.mean_length))
    needed = w.longest_input + w.longest_output
    oversized = limit >= OVERSIZED_CONTEXT * w.mean_length
    if s.deployment.paged:
        # A paged engine allocates blocks as tokens arrive: max_model_len only sets the start-up check (one request
        # of that length must fit the pool), the "Maximum concurrency" line and the longest prompt accepted.
        applies = s.memory.fits and worst_case < 1 and needed <= pool
        if applies:
            why = (
                f"one request of max_model_len {limit:,} needs more than the {pool:,}-token pool, so the engine "
                f"refuses to start; the longest request you serve ({needed:,}) fits: set max_model_len to it"
            )
        elif worst_case < 1:
            why = (
                f"max_model_len {limit:,} exceeds the {pool:,}-token pool, and so does the longest request "
                f"({needed:,}): see lever 8"
            )
        else:
            why = (
                f"paged: max_model_len {limit:,} reserves nothing per request (blocks are allocated as tokens "
                f"arrive); it sets the start-up check (passes), the 'Maximum concurrency' line ({worst_case:,}) "
                "and the longest prompt accepted, not how many requests run"
            )
    else:
        applies = s.memory.fits and oversized and needed < limit and worst_case < s.in_flight <= typical
        if applies:
            why = (
                f"max_model_len {limit:,} is {limit / w.mean_length:.0f}x the mean request ({w.mean_length:,.0f} "
                f"tokens): reserving it per request admits {worst_case:,} requests, the measured lengths "
                f"{typical:,}; set max_model_len to the longest request you serve ({needed:,})"
            )
        else:
            covered = (
                "the worst-case bound already covers the load"
                if worst_case >= s.in_flight
                else "not the limit"
            )
            why = f"max_model_len {limit:,} against a mean request of {w.mean_length:,.0f} tokens: {covered}"
    return STEPS[1].lever(
        applies,
        why,
        vllm=f"--max-model-len {needed}",
        sglang=f"--context-length {needed}",
        numbers={
            "worst_case": worst_case,
            "typical": typical,
            "ratio": limit / w.mean_length,
            "needed": needed,
            "pool": pool,
        },
    )


def active_tokens(s: Situation) -> Lever:
    """2. Does the pool hold the tokens the load keeps resident?"""
    resident, pool = s.resident, s.pool
    fits_seqs = pool // max(1, math.ceil(s.workload.mean_resident))
    applies = s.memory.fits and resident > pool
    if applies:
        why = (
            f"{s.in_flight:,.1f} requests in flight hold {resident:,.0f} tokens on average; the pool holds "
            f"{pool:,} ({fits_seqs:,} such requests): cap the running requests there or requests are preempted"
        )
    else:
        why = f"{resident:,.0f} resident tokens of a {pool:,}-token pool ({resident / max(pool, 1):.0%})"
    return STEPS[2].lever(
        applies,
        why,
        vllm=f"--max-num-seqs {max(1, fits_seqs)}"
        + ("" if s.memory.gpu_memory_utilization >= 1 else " (or a higher --gpu-memory-utilization)"),
        sglang=f"--max-running-requests {max(1, fits_seqs)} (or a higher --mem-fraction-static)",
        numbers={"resident": resident, "pool": pool, "fits_seqs": fits_seqs},
    )


def attention_type(s: Situation) -> Lever:
    """3. Is the model's attention (MHA) the reason a token costs so much?"""
    spec, per_token = s.spec, s.memory.kv_bytes_per_token
    attention = spec.attention_type
    mha = attention == "MHA"
    gqa_per_token = per_token * min(GQA_HEADS, spec.kv_heads) // spec.kv_heads if mha else per_token
    applies = s.memory.fits and mha and s.resident > s.pool
    if applies:
        why = (
            f"{attention}: {spec.kv_heads} KV heads cost {format_bytes(per_token)} per token; a GQA model "
            f"with {GQA_HEADS} KV heads and the same layers would store {format_bytes(gqa_per_token)}"
        )
    else:
        why = f"{attention} with {spec.kv_heads} KV head(s): {format_bytes(per_token)} per token"
    return STEPS[3].lever(applies, why, {"per_token": per_token, "gqa_per_token": gqa_per_token})


def kv_precision(s: Situation) -> Lever:
    """4. Would an fp8 cache make the resident tokens fit?"""
    kv_dtype, pool = s.deployment.settings.kv_dtype, s.pool
    wide = kv_dtype in ("fp32", "fp16", "bf16")
    fp8_pool = _memory(s.deployment, kv_dtype="fp8").max_tokens() if s.memory.fits and wide else pool
    applies = s.memory.fits and wide and s.resident > pool
    if applies:
        enough = ", enough for the load" if fp8_pool >= s.resident else ""
        why = (
            f"{kv_dtype} cache: fp8 would hold {fp8_pool:,} tokens instead of {pool:,} "
            f"({fp8_pool / max(pool, 1):.2f}x){enough}"
        )
    else:
        why = f"{kv_dtype} cache" + (": the load fits without narrowing it" if wide else "")
    return STEPS[4].lever(applies, why, {"fp8_pool": fp8_pool})


def prefix_reuse(s: Situation) -> Lever:
    """5. Is a shared prefix recomputed and stored once per request?"""
    w, caching = s.workload, s.deployment.prefix_caching
    shared = w.prefix_fraction * w.prefix_len  # prompt tokens per request a prefix cache could serve
    share = shared / w.mean_input
    applies = not caching and share >= PREFIX_SHARE
    if applies:
        why = (
            f"{w.prefix_fraction:.0%} of requests start with the same {w.prefix_len:,} tokens: {share:.0%} of "
            "the mean prompt is recomputed and stored once per request; cache it once"
        )
    elif caching:
        why = "prefix caching is on"
    else:
        why = f"shared prefix {share:.0%} of the mean prompt: too little to matter"
    return STEPS[5].lever(applies, why, {"share": share, "shared_tokens": shared})


def paging(s: Situation) -> Lever:
    """6. Do contiguous reservations, or big blocks on short requests, waste the pool?"""
    frag, applies, why = _block_waste(s) if s.deployment.paged else _reservation_waste(s)
    return STEPS[6].lever(applies, why, {"fragmentation": frag})


def _block_waste(s: Situation) -> tuple[float, bool, str]:
    """(share lost, whether it binds, why) of a paged pool: the last block of each running request."""
    block_size, resident = s.deployment.settings.block_size, s.resident
    waste = s.in_flight * (block_size - 1) / 2  # half a block per running request on average
    frag = waste / max(resident, 1)
    applies = s.memory.fits and frag > FRAGMENTATION_SHARE and resident + waste > s.pool  # waste that binds
    if applies:
        why = (
            f"blocks of {block_size} tokens waste ~{frag:.0%} of {resident:,.0f} resident tokens on requests this "
            "short, and the pool is full; use smaller blocks"
        )
    else:
        why = f"paged in blocks of {block_size}: ~{frag:.1%} lost to the last block of each request"
    return frag, applies, why


def _reservation_waste(s: Situation) -> tuple[float, bool, str]:
    """(share empty, whether it binds, why) of contiguous reservations of max_model_len per request."""
    in_flight, limit = s.in_flight, s.limit
    frag = in_flight * max(0.0, limit - s.workload.mean_resident) / max(in_flight * limit, 1)
    applies = s.memory.fits and frag > FRAGMENTATION_SHARE and in_flight * limit > s.pool
    if applies:
        why = (
            f"contiguous reservations of max_model_len leave {frag:.0%} of the reserved cache empty, and "
            f"{in_flight:,.0f} reservations ({in_flight * limit:,.0f} tokens) exceed the {s.pool:,}-token pool; page it"
        )
    else:
        why = f"contiguous reservations: {frag:.1%} empty"
    return frag, applies, why


def batching(s: Situation) -> Lever:
    """7. Does `max_num_seqs` cap the batch below the load while the pool has room?"""
    d = s.deployment
    cap, in_flight = d.settings.batch_limits(d.gpu, d.model)[1], s.in_flight
    room = s.pool // max(1, math.ceil(s.workload.mean_resident))
    applies = s.memory.fits and in_flight > cap and room > cap
    if applies:
        why = (
            f"max_num_seqs {cap} caps the batch below the {in_flight:,.0f} requests in flight while the pool "
            f"holds {room:,}: raise it (decode is memory-bound until the critical batch)"
        )
    else:
        why = f"max_num_seqs {cap} against {in_flight:,.1f} in flight and room for {room:,}"
    return STEPS[7].lever(
        applies,
        why,
        vllm=f"--max-num-seqs {min(room, math.ceil(in_flight))} (and --max-num-batched-tokens)",
        sglang=f"--max-running-requests {min(room, math.ceil(in_flight))} (and --chunked-prefill-size)",
        numbers={"room": room, "cap": cap},
    )


def long_context(s: Situation) -> Lever:
    """8. Does one long request take a large share of the pool, whatever the scheduler does?"""
    longest = s.workload.longest_input + s.workload.longest_output
    longest_share = longest / max(s.pool, 1)
    applies = s.memory.fits and longest_share >= LONG_REQUEST_SHARE
    if applies:
        why = (
            f"one longest request ({longest:,} tokens, {format_bytes(longest * s.memory.kv_bytes_per_token)}) "
            f"takes {longest_share:.0%} of the pool: few fit at once whatever the scheduler does"
        )
    else:
        why = f"the longest request takes {longest_share:.1%} of the pool"
    return STEPS[8].lever(applies, why, {"longest_share": longest_share, "longest": longest})


def topology(s: Situation) -> Lever:
    """9. Do the weights fit one GPU at all, and what tensor parallelism would?"""
    d, fits = s.deployment, s.memory.fits
    tp_fit = None if fits else _smallest_fitting_tp(d)
    if not fits:
        fitting = (
            f"tensor parallelism {tp_fit} is the smallest that fits" if tp_fit else "no TP up to 64 fits"
        )
        why = (
            f"the weights ({format_bytes(s.memory.weight_bytes)} per GPU) leave no KV pool on one "
            f"{hardware.get(d.gpu).name}; {fitting}"
        )
    else:
        why = f"fits at tp={d.settings.tp}, pp={d.settings.pp}"
    return STEPS[9].lever(
        not fits,
        why,
        vllm=f"--tensor-parallel-size {tp_fit or d.settings.tp} (--pipeline-parallel-size across nodes)",
        sglang=f"--tp-size {tp_fit or d.settings.tp} (--pp-size for stages, --dp-size for replicas)",
        numbers={"tp_fit": float(tp_fit or 0)},
    )


def token_eviction(s: Situation) -> Lever:
    """10. Would keeping a share of each request's tokens (H2O, SnapKV) fit the load? It costs accuracy, so it
    comes after every lever that keeps it, and it applies only where the cache binds: the resident tokens exceed
    the pool, or one longest request takes a large share of it."""
    w, pool = s.workload, s.pool
    mean = max(1, math.ceil(w.mean_resident))
    kept = sizing.evicted_context(mean, EVICTION_KEEP_RATIO)
    fits, fits_kept = pool // mean, pool // kept
    longest = w.longest_input + w.longest_output
    binds = s.resident > pool or longest >= LONG_REQUEST_SHARE * pool
    bounded = sizing.unevictable_kinds(s.spec)
    applies = s.memory.fits and binds and not bounded
    if bounded:
        why = f"does not apply: the model has {', '.join(bounded)} layers, whose cache is already bounded"
    elif applies:
        why = (
            f"keeping {EVICTION_KEEP_RATIO:g} of each request's tokens would hold {fits_kept:,} mean requests "
            f"instead of {fits:,}, at an accuracy cost to measure on your task (chapter 16)"
        )
    else:
        why = "the cache does not bind: nothing to trade accuracy for"
    return STEPS[10].lever(
        applies, why, {"fits": fits, "fits_kept": fits_kept, "keep_ratio": EVICTION_KEEP_RATIO}
    )


def _smallest_fitting_tp(d: Deployment) -> int | None:
    spec = shape(d.model).spec
    for tp in (2**k for k in range(7)):
        try:
            sizing.check_parallel(spec, tp, d.settings.pp)
        except ValueError:
            continue
        if _memory(d, tp=tp).fits:
            return tp
    return None


# The book's order (claim 18): the first lever that applies is the one to use first.
LEVERS: tuple[Callable[[Situation], Lever], ...] = (
    context_statistics,
    active_tokens,
    attention_type,
    kv_precision,
    prefix_reuse,
    paging,
    batching,
    long_context,
    topology,
    token_eviction,
)


def situation(d: Deployment) -> Situation:
    """The budget and the load every lever of `d` reads."""
    return Situation(d, _memory(d), shape(d.model).spec, concurrency(d))


def diagnose(d: Deployment) -> Diagnosis:
    """Every lever of the book's order, evaluated on `d`; `Diagnosis.first` is where to start."""
    s = situation(d)
    levers = [lever(s) for lever in LEVERS]
    if not s.memory.fits:
        # Nothing else can act before the model fits.
        levers = [
            lever
            if lever.step == 9
            else dataclasses.replace(lever, applies=False, why="needs a KV pool first")
            for lever in levers
        ]
    return Diagnosis(d, s.memory, s.in_flight, tuple(levers))


# A workload file (and `kvlab diagnose`'s flags): one flat mapping, each key a field of the deployment, of its
# workload or of its budget settings.
DEPLOYMENT_FIELDS = ("model", "gpu", "max_model_len", "prefix_caching", "paged")
WORKLOAD_FIELDS = (
    "mean_input",
    "mean_output",
    "max_input",
    "max_output",
    "rate",
    "concurrency",
    "prefix_fraction",
    "prefix_len",
    "output_cv",
)
SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(BudgetSettings))
FIELDS = {*DEPLOYMENT_FIELDS, *WORKLOAD_FIELDS, *SETTINGS_FIELDS}
TOKEN_FIELDS = {"max_input", "max_output", "max_model_len", "prefix_len", "max_num_batched_tokens"}


def deployment_from_dict(data: dict[str, Any]) -> Deployment:
    """A `Deployment` from a flat mapping (keys may use dashes); unknown keys and bad values are `WorkloadError`s."""
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
        settings = BudgetSettings(**{k: v for k, v in clean.items() if k in SETTINGS_FIELDS})
        workload = Workload(**{k: v for k, v in clean.items() if k in WORKLOAD_FIELDS})
        return Deployment(
            workload=workload, settings=settings, **{k: v for k, v in clean.items() if k in DEPLOYMENT_FIELDS}
        )
    except (TypeError, ValueError) as err:
        raise WorkloadError(str(err)) from None


def as_dict(d: Deployment) -> dict[str, Any]:
    """The flat mapping `deployment_from_dict` reads back."""
    flat = dataclasses.asdict(d)
    return (
        {name: flat[name] for name in DEPLOYMENT_FIELDS}
        | {name: flat["workload"][name] for name in WORKLOAD_FIELDS}
        | flat["settings"]
    )


def load_deployment(path: str | Path) -> Deployment:
    """Read a workload file: YAML, JSON or TOML (by its suffix)."""
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
    return deployment_from_dict(data if data is not None else {})


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
    "vllm_version": str,
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


def deployment_from_args(args: Any) -> Deployment:
    """The workload of a parsed `kvlab diagnose` command line: the file's fields, then the flags."""
    data: dict[str, Any] = {}
    if args.workload is not None:
        data = as_dict(load_deployment(args.workload))
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
    return deployment_from_dict(data)
