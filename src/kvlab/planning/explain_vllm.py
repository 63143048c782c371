"""`kvlab explain-vllm LOGFILE`: a vLLM server's start-up budget, term by term, beside kvlab's figures.

The log (read by `kvlab.planning.vllm_log`) gives what vLLM measured: weights, memory outside PyTorch, the activation
peak, CUDA graphs, the KV memory left and the tokens it holds. kvlab prints its own figure for each term by the
arithmetic of `kvlab size --gpu` (`kvlab.costs.budget.memory_budget`, at the settings the log prints and vLLM's
defaults for the rest: `estimate`), each estimated term labelled so, recomputes the token count from the printed
KV memory with its exact per-token bytes, explains the concurrency figure, and names the lever for the largest
term. Chapter: *Active tokens, not
batch size* (book/05_active_tokens).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from kvlab.costs import budget
from kvlab.planning.vllm_log import DEFAULT_BLOCK_SIZE, Printed, StartupLog
from kvlab.specs import arch, hardware, vllm_defaults
from kvlab.specs.shape import shape
from kvlab.units import cdiv, dtype_bytes, format_bytes

# Fine-tuned checkpoints whose config.json has the same layers, heads and widths as a registry entry, so the
# registry entry sizes them. Checked against the published files:
# https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json and .../Llama-3.1-8B/...,
# https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json and .../Llama-3.1-70B/...
SAME_SHAPE = {
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
    # The Instruct and Thinking releases share one architecture (their model cards' tables)
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "Qwen/Qwen3-Next-80B-A3B-Thinking",
}

# vLLM's kv_cache_dtype names and the element kvlab sizes them with ("auto": the model's own dtype)
_KV_DTYPES = {
    "auto": None,
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "bfloat16": "bf16",
    "float16": "fp16",
}


def registry_name(model: str | None) -> str | None:
    """The registry entry that sizes `model`, or None when kvlab cannot size it offline."""
    if model is None:
        return None
    name = SAME_SHAPE.get(model, model)
    return name if name in arch.registry() else None


def kv_dtype(log: StartupLog) -> str | None:
    """The KV element kvlab sizes the log's cache with; None means the model's declared dtype."""
    name = log.kv_cache_dtype or "auto"
    if name not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not one kvlab sizes ({', '.join(_KV_DTYPES)})")
    return _KV_DTYPES[name]


def tokens_from_memory(kv_bytes: int, bytes_per_token: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Token slots vLLM makes of `kv_bytes`: whole blocks of `block_size` tokens (one GPU's bytes per token)."""
    return max(kv_bytes, 0) // (bytes_per_token * block_size) * block_size


def per_request_bytes(
    model: str, max_seq_len: int, max_num_batched_tokens: int, dtype: str | None, tp: int
) -> int:
    """The KV bytes vLLM charges one request of `max_seq_len` tokens on one GPU, as its concurrency figure does.

    Full-attention layers hold every token; a sliding-window layer at most the window's tokens plus one step's
    batch (vLLM v1 `SlidingWindowSpec.max_memory_usage_bytes`, vllm/v1/kv_cache_interface.py: the credit that
    lets Gemma 2 and Mistral report more concurrency than tokens ÷ max_seq_len).
    """
    from kvlab.specs.shape import shape

    model_shape = shape(model)
    nbytes = dtype_bytes(model_shape.dtype if dtype is None else dtype)
    total = 0
    for layer in model_shape.spec.layers:
        window = layer.max_cached_tokens
        held = max_seq_len if window is None else min(window + max_num_batched_tokens, max_seq_len)
        total += held * layer.elements_per_token_per_rank(tp) * nbytes
    return total


@dataclass(frozen=True)
class Term:
    """One line of the budget: vLLM's printed figure and kvlab's, in bytes (None where there is none)."""

    name: str
    vllm: int | None
    kvlab: int | None
    note: str


def _cell(value: int | None) -> str:
    return "—" if value is None else format_bytes(value)


# vLLM's --dtype names and the element kvlab sizes the weights (and an "auto" KV cache) with
_RUN_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def _version(text: str | None) -> tuple[int, int] | None:
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return None if found is None else (int(found.group(1)), int(found.group(2)))


def _run_dtype(log: StartupLog, sized: str) -> str:
    """The element the model runs in: the log's --dtype, else the config's declared dtype."""
    from kvlab.specs.shape import shape

    name = log.dtype or str(shape(sized).dtype).removeprefix("torch.")
    if name not in _RUN_DTYPES:
        raise ValueError(f"dtype {name!r} is not one kvlab sizes ({', '.join(_RUN_DTYPES)})")
    return _RUN_DTYPES[name]


def log_version(log: StartupLog, asked: str | None = None) -> str:
    """The vLLM version the log is sized by: `asked`, else the release it prints (v0 format: the v0 engine
    unless the release is older than the V1 engine), else its engine family."""
    if asked is not None:
        return asked
    if log.format == "v0":
        return "v0"
    if log.vllm_version and _version(log.vllm_version) is not None:
        return log.vllm_version
    return "v1"


def settings(log: StartupLog, sized: str, version: str | None = None) -> budget.BudgetSettings:
    """The `kvlab size --gpu` settings of the server that wrote `log`: what it printed, else the defaults of
    its release (`log_version`; `kvlab.specs.vllm_defaults.resolve`)."""
    v0 = log.format == "v0"
    run = _run_dtype(log, sized)
    utilization = log.gpu_memory_utilization
    # vLLM prints max_model_len in the concurrency line too ("Maximum concurrency for N tokens per request")
    longest = log.max_seq_len or log.max_concurrency_tokens
    chunked = True
    if v0 and longest is not None:
        # v0 chunks prefill only past 32k tokens of max_model_len, or when the budget is below one prompt.
        chunked = (
            longest > vllm_defaults.V0_CHUNKED_PREFILL_ABOVE
            or (log.max_num_batched_tokens or longest) < longest
        )
    return budget.BudgetSettings(
        kv_dtype=kv_dtype(log) or run,
        weight_dtype=run,
        gpu_memory_utilization=utilization,  # type: ignore[arg-type]  # None: the release's default
        max_num_batched_tokens=log.max_num_batched_tokens,
        block_size=log.block_size,  # type: ignore[arg-type]
        tp=log.tensor_parallel_size or 1,
        enable_chunked_prefill=chunked,
        max_model_len=longest,
        enforce_eager=bool(log.enforce_eager),
        vllm_version=log_version(log, version),
        extensible_kv_cache=False if log.extensible_disabled else None,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Estimate:
    """kvlab's budget for a logged server, the settings it was sized at and the step it profiles."""

    memory: budget.MemoryBudget
    settings: budget.BudgetSettings
    max_num_batched_tokens: int
    max_num_seqs: int


def estimate(
    log: StartupLog, sized: str, total_bytes: int | None = None, version: str | None = None
) -> Estimate:
    """kvlab's budget for the server that wrote `log`, by `kvlab size --gpu`'s arithmetic (`memory_budget`).

    The capacity is the log's printed total (CUDA's, so no driver reserve is estimated), else `total_bytes`
    (NVML's, as nvidia-smi prints it). With neither, the capacity is unknown: the budget is that of a nominal
    one-byte GPU, whose terms other than the capacity and the KV memory are still the estimates (at vLLM's
    batch defaults for a GPU below 70 GiB unless the log prints its token budget)."""
    s = settings(log, sized, version)
    printed = log.total_gpu_memory.bytes if log.total_gpu_memory else None
    capacity = printed or total_bytes or 1
    gpu = hardware.Accelerator(
        "GPU of the log", capacity, capacity, 1.0, 1.0, 1.0, None, "the log or the user"
    )
    reserve = 0 if printed is not None or total_bytes is None else None
    mb = budget.memory_budget(sized, gpu, **dataclasses.asdict(s), driver_reserved_bytes=reserve)
    return Estimate(mb, s, *s.batch_limits(gpu, sized))


def explain(
    log: StartupLog, model: str | None = None, total_bytes: int | None = None, version: str | None = None
) -> str:
    """The report `kvlab explain-vllm` prints. `model`, `total_bytes` (NVML's total, as nvidia-smi prints it)
    and `version` (the vLLM release) fill what the log does not say."""
    name = model or log.model
    sized = registry_name(name)
    tp = log.tensor_parallel_size or 1
    block = log.block_size or DEFAULT_BLOCK_SIZE
    printed_total = log.total_gpu_memory.bytes if log.total_gpu_memory else None
    total = printed_total or total_bytes
    utilization = log.gpu_memory_utilization
    out = [
        f"vLLM start-up log ({log.format}, vLLM {log.vllm_version or 'version not printed'}): "
        f"model {name or 'not printed (pass --model)'}, "
        f"TP={tp}{'' if log.tensor_parallel_size else ' (not printed: 1 assumed)'}, "
        f"max_seq_len={log.max_seq_len or 'not printed'}"
    ]
    if sized is None:
        out.append(
            f"  kvlab cannot size {name or 'an unnamed model'} offline (not in `kvlab models`): vLLM's figures only"
        )
    dtype = kv_dtype(log)
    per_token = mb = s = None
    # the profiled step; only read once kvlab can size the model
    batched = seqs = 0
    # vLLM pages a hybrid's state beside its blocks: its tokens and concurrency count pages, not bytes
    hybrid = sized is not None and shape(sized).spec.has_state
    if hybrid:
        out.append(
            f"  {sized} keeps state per sequence: kvlab's budget does not model it, vLLM's figures only"
        )
    if sized is not None and not hybrid:
        from kvlab.specs.sizing import kv_bytes_per_token

        per_token = kv_bytes_per_token(sized, dtype, tp=tp)
        found = estimate(log, sized, total_bytes, version)
        mb, s, batched, seqs = found.memory, found.settings, found.max_num_batched_tokens, found.max_num_seqs

    def printed(value: object) -> int | None:
        return None if value is None else value.bytes  # type: ignore[attr-defined]

    known = total is not None and mb is not None
    util = utilization or (s.gpu_memory_utilization if s else budget.GPU_MEMORY_UTILIZATION)
    terms = [
        Term(
            "GPU memory",
            printed_total,
            total,
            "printed total_gpu_memory (CUDA's)"
            if printed_total
            else ("--gpu-memory-gib (NVML's, as nvidia-smi prints it)" if total else "not printed"),
        ),
        Term(
            "driver reserve",
            None,
            mb.driver_reserved_bytes if known and mb else None,
            "none: vLLM printed CUDA's own total"
            if printed_total
            else f"estimate: NVML's total less CUDA's ({budget.CENTRAL.driver_reserved_bytes // 2**20} MiB)",
        ),
        Term(
            "engine reserve",
            printed_total - math.ceil(printed_total * utilization)
            if printed_total is not None and utilization is not None
            else None,
            mb.engine_cap_bytes if known and mb else None,
            f"1 - gpu_memory_utilization ({util:g}"
            + ("" if utilization is not None else ", not printed: the era's default")
            + ")",
        ),
        Term(
            "weights",
            printed(log.weights),
            mb.weight_bytes if mb else None,
            f"kvlab: parameters × bytes ({s.weight_dtype if s else 'bf16'}), one GPU's share",
        ),
        Term(
            "non-torch memory",
            printed(log.non_torch_memory),
            mb.runtime_bytes if mb else None,
            f"kvlab: estimate at TP={tp} (kvlab.costs.budget.non_torch_bytes)"
            + (
                "; vLLM's: its weights + non-torch less its weights"
                if log.non_torch is None and log.non_torch_memory
                else ""
            ),
        ),
        *(
            [
                Term(
                    "weights + non-torch",
                    printed(log.weights_and_non_torch),
                    mb.weight_bytes + mb.runtime_bytes if mb else None,
                    "printed as one figure (vLLM's one-line ledger)",
                )
            ]
            if log.weights_and_non_torch is not None and log.non_torch_memory is None
            else []
        ),
        Term(
            "activation peak",
            printed(log.activation_peak),
            mb.peak_bytes if mb else None,
            "kvlab: estimate, the larger of "
            + (
                f"the forward's {format_bytes(mb.activation_bytes)} at {batched:,} batched tokens and the "
                f"sampler's {format_bytes(mb.sampler_bytes)} at {min(seqs, batched):,} rows of logits"
                if mb
                else "the forward's and the sampler's"
            ),
        ),
        Term(
            "CUDA graphs",
            printed(log.cuda_graph),
            mb.cuda_graph_bytes if mb else None,
            _graph_note(s),
        ),
        Term(
            "available KV memory",
            printed(log.available_kv),
            (mb.reservation_bytes if mb.sizing == "measured" else mb.kv_headroom_bytes)
            if known and mb
            else None,
            (
                "0.34: only the address space reserved; the pool is measured after warmup (below)"
                if mb is not None and mb.sizing == "measured"
                else "kvlab: GPU memory less the terms above (kvlab size --gpu's arithmetic)"
            )
            if known
            else "kvlab: needs the GPU's total (pass --gpu-memory-gib)",
        ),
    ]
    if log.measured or (mb is not None and mb.sizing == "measured"):
        terms.append(
            Term(
                "measured KV pool",
                printed(log.extended_kv or log.measured_kv),
                mb.kv_pool_bytes if known and mb else None,
                "'Extended KV cache to N blocks'; kvlab: the measured rule (kvlab.costs.budget)",
            )
        )
    if mb is None:
        # with no model to size, kvlab has no figure of its own beyond the GPU's terms
        terms = [
            t
            if t.name in ("GPU memory", "engine reserve")
            else dataclasses.replace(t, note="vLLM's figure only")
            for t in terms
        ]
    out.append(f"  {'term':<21}{'vLLM printed':>14}{'kvlab':>14}   note")
    out += [f"  {t.name:<21}{_cell(t.vllm):>14}{_cell(t.kvlab):>14}   {t.note}" for t in terms]
    if mb is not None:
        unknown = "" if known else "; the GPU's memory unknown, so vLLM's batch defaults below 70 GiB"
        out.append(f"  kvlab's estimates assume {mb.settings_note}{unknown}")
    if mb is not None:
        block = log.block_size or mb.block_size
    out += measured_lines(log, mb, s.vllm_version if s else log_version(log, version))
    printed_tokens = log.tokens
    if per_token is not None and log.available_kv is not None and not log.measured:
        recomputed = tokens_from_memory(log.available_kv.bytes, per_token, block)
        out.append(
            f"  KV tokens: vLLM {printed_tokens if printed_tokens is None else f'{printed_tokens:,}'}; kvlab "
            f"{recomputed:,} from the printed {format_bytes(log.available_kv.bytes)} at {per_token:,} B/token "
            f"per GPU, blocks of {block} (the printed memory is rounded to ±{format_bytes(log.available_kv.half_ulp_bytes)})"
        )
    if hybrid:
        assert sized is not None
        out += _hybrid(log, sized, dtype, tp)
    else:
        out += _concurrency(log, sized, dtype, tp, batched)
    out.append(_lever(terms, log))
    return "\n".join(out)


def _gib(value: Printed | None) -> str:
    return "—" if value is None else f"{value.bytes / 2**30:.2f} GiB"


def measured_lines(log: StartupLog, mb: budget.MemoryBudget | None, version: str) -> list[str]:
    """vLLM 0.34's measured pool term by term, from the "Memory after warmup" line; or one line naming what a
    0.34 log lacks, or what a log mixes."""
    rule = vllm_defaults.resolve(version).release
    newer = rule.sizing == "measured"
    old_lines = list(log.v0_lines)
    new_lines = [
        name
        for name, value in (
            ("Memory after warmup", log.warmup_free),
            ("Extended KV cache", log.extended_blocks),
        )
        if value is not None
    ]
    if old_lines and new_lines:
        return [
            f"  mixed versions: v0 lines ({', '.join(old_lines)}) beside vLLM 0.34's ({', '.join(new_lines)}); "
            "explain one server's log at a time"
        ]
    if new_lines and not newer:
        return [
            f"  mixed versions: vLLM 0.34's lines ({', '.join(new_lines)}) in a log of vLLM {version}; pass "
            "--vllm-version 0.34 or split the log"
        ]
    if log.extensible_disabled:
        return [
            f"  vLLM disabled its extensible KV cache ({log.extensible_disabled}): the estimate rule sized this "
            "pool at gpu_memory_utilization 0.92 unless set"
        ]
    if not newer:
        return []
    missing = [
        line
        for line, value in (
            ("'Memory after warmup: ...'", log.warmup_free),
            ("'Extended KV cache to N blocks'", log.extended_blocks),
        )
        if value is None
    ]
    if log.warmup_free is None:
        return [
            f"  vLLM 0.34 sizes the cache after warmup, but the log lacks {' and '.join(missing)}: "
            "'Available KV cache memory' is only the reservation, not the pool"
        ]
    free, committed = log.warmup_free, log.warmup_committed
    peak, growth, kept = log.transient_peak, log.torch_growth, log.transient_kept
    assert committed is not None and peak is not None and growth is not None and kept is not None
    headroom = free.bytes + committed.bytes
    margin = max(budget.KV_CACHE_MARGIN_FLOOR_BYTES, int(peak.bytes * budget.KV_CACHE_MARGIN_FRACTION))
    out = [
        "  vLLM 0.34's measured pool (vllm/v1/worker/extensible_kv_cache.py, measure_kv_cache_bytes):",
        f"    requested budget     {_gib(log.requested)}   total × gpu_memory_utilization "
        f"({log.gpu_memory_utilization or 'unset: 1.0'})",
        f"    headroom             {headroom / 2**30:.2f} GiB   free after warmup {_gib(free)} + committed "
        f"{_gib(committed)}",
        f"    - margin             {margin / 2**30:.2f} GiB   max(1 GiB, 0.75 × the peak {_gib(peak)})",
        f"    - transient kept     {_gib(kept)}   max(allocated peak {_gib(peak)}, torch growth {_gib(growth)})",
    ]
    device = headroom - margin - kept.bytes
    if log.withheld is not None:
        device -= log.withheld.bytes
        out.append(
            f"    - utilisation cap    {_gib(log.withheld)}   gpu_memory_utilization {log.gpu_memory_utilization} "
            "withholds it (vLLM's warning)"
        )
    elif log.startup_free is not None and log.requested is not None:
        used = log.startup_free.bytes - free.bytes - committed.bytes
        budget_side = log.requested.bytes - used - kept.bytes
        out.append(
            f"    used outside cache   {used / 2**30:.2f} GiB   free at start-up {_gib(log.startup_free)} less free "
            f"and committed after warmup; the budget leaves {budget_side / 2**30:.2f} GiB"
        )
        device = min(device, budget_side)
    out.append(
        f"    = KV                 {device / 2**30:.2f} GiB   vLLM: {log.measured_blocks:,} blocks "
        f"({_gib(log.measured_kv)}), extended to "
        + (f"{log.extended_blocks:,}" if log.extended_blocks is not None else "not printed")
        + (f" after remapping from {log.remapped_from_blocks:,}" if log.remapped_from_blocks else "")
    )
    if mb is not None and mb.sizing == "measured":
        out.append(
            f"    kvlab's transient {format_bytes(mb.transient_bytes)} (activations + graph estimate) and margin "
            f"{format_bytes(mb.margin_bytes)}"
        )
    return out


def _graph_note(s: budget.BudgetSettings | None) -> str:
    if s is None:
        return "kvlab: estimate (kvlab.costs.budget.cuda_graph_bytes)"
    if s.enforce_eager:
        return "kvlab: none, enforce_eager captures no graphs"
    if not s.estimate_cuda_graphs:
        return "kvlab: none charged, this vLLM (v0, or before 0.21) does not subtract graph memory"
    return "kvlab: estimate (kvlab.costs.budget.cuda_graph_bytes)"


def _hybrid(log: StartupLog, sized: str, dtype: str | None, tp: int) -> list[str]:
    """A hybrid model's pages (`kvlab.costs.hybrid_pages`) beside the log's block size, padding, token count and
    concurrency."""
    from kvlab.costs.hybrid_pages import hybrid_pages

    pages = hybrid_pages(sized, _run_dtype(log, sized) if dtype is None else dtype, tp=tp)
    attention_groups, state_groups = pages.groups
    printed_block = "not printed" if log.hybrid_block_size is None else f"{log.hybrid_block_size:,} tokens"
    printed_padding = (
        "not printed" if log.state_padding_percent is None else f"{log.state_padding_percent:.2f}%"
    )
    lines = [
        f"  hybrid pages: attention block vLLM {printed_block}, kvlab {pages.block_size:,}; state page padded by "
        f"vLLM {printed_padding}, kvlab {pages.padding_percent:.2f}% (kvlab.costs.hybrid_pages, TP={tp})",
    ]
    if log.available_kv is None:
        return [*lines, "  KV tokens: the log prints no available KV memory to convert"]
    available = log.available_kv.bytes
    blocks = pages.num_blocks(available)
    lines.append(
        f"  KV tokens: vLLM {log.tokens if log.tokens is None else f'{log.tokens:,}'}; kvlab "
        f"{pages.pool_tokens(available):,} from the printed {format_bytes(available)}: {blocks:,} blocks of "
        f"{pages.group_size} layer pages of {format_bytes(pages.page_bytes)}, over {sum(pages.groups)} KV-cache "
        f"groups ({attention_groups} attention, {state_groups} state) × {pages.block_size:,} tokens"
    )
    seq = log.max_concurrency_tokens or log.max_seq_len
    if seq is not None:
        per_request = attention_groups * cdiv(seq, pages.block_size) + state_groups
        lines.append(
            f"  concurrency: {blocks:,} blocks / {per_request:,} per request of {seq:,} tokens "
            f"({per_request - state_groups:,} attention blocks + {state_groups} state pages) = "
            f"{pages.max_concurrency(available, seq):.2f}x"
            + (f" (vLLM printed {log.max_concurrency:.2f}x)" if log.max_concurrency is not None else "")
        )
    return lines


def _concurrency(log: StartupLog, sized: str | None, dtype: str | None, tp: int, batched: int) -> list[str]:
    tokens, seq = log.tokens, log.max_concurrency_tokens or log.max_seq_len
    if tokens is None:
        return ["  concurrency: the log prints no token count to explain"]
    if seq is None:
        return [f"  concurrency: {tokens:,} tokens; the log prints no max_seq_len to divide them by"]
    if log.hybrid_block_size is not None:
        return [
            f"  concurrency: a hybrid model (vLLM set its attention block to {log.hybrid_block_size:,} tokens): "
            "its token count and concurrency count pages across KV-cache groups; pass --model to explain them"
            + (f" (vLLM printed {log.max_concurrency:.2f}x)" if log.max_concurrency is not None else "")
        ]
    lines = [
        f"  concurrency: {tokens:,} tokens / {seq:,} per request = {tokens / seq:.2f}x"
        + (f" (vLLM printed {log.max_concurrency:.2f}x)" if log.max_concurrency is not None else "")
    ]
    if sized is not None and log.available_kv is not None:
        full = per_request_bytes(sized, seq, batched, dtype, tp)
        every = seq * _bytes_per_token(sized, dtype, tp)
        if full < every:
            lines.append(
                f"  sliding-window credit: a request is charged {format_bytes(full)}, not {format_bytes(every)}, "
                f"so {log.available_kv.bytes / full:.2f}x requests of {seq:,} tokens fit"
            )
    return lines


def _bytes_per_token(sized: str, dtype: str | None, tp: int) -> int:
    from kvlab.specs.sizing import kv_bytes_per_token

    return kv_bytes_per_token(sized, dtype, tp=tp)


_LEVERS = {
    "engine reserve": "raise --gpu-memory-utilization (the reserve is the largest term)",
    "weights": "shard the weights: a larger --tensor-parallel-size (the weights are the largest term)",
    "weights + non-torch": "shard the weights: a larger --tensor-parallel-size (weights and non-torch memory, "
    "printed as one figure, are the largest term)",
    "activation peak": "a smaller --max-num-batched-tokens (the activation peak is the largest term)",
    "non-torch memory": "raise --gpu-memory-utilization, or fewer GPUs per engine (non-torch memory is the largest term)",
    "CUDA graphs": "--enforce-eager or fewer capture sizes (CUDA graphs are the largest term)",
}


def _lever(terms: list[Term], log: StartupLog) -> str:
    # vLLM's figure where it printed one; kvlab's only for the terms kvlab derives from the model itself
    derived = ("weights", "activation peak")
    costs = {
        t.name: t.vllm if t.vllm is not None else (t.kvlab if t.name in derived else None) for t in terms
    }
    known = {k: v for k, v in costs.items() if k in _LEVERS and v is not None}
    fp8 = (
        ""
        if (log.kv_cache_dtype or "auto").startswith("fp8")
        else "; --kv-cache-dtype fp8 doubles the tokens per byte"
    )
    if log.withheld is not None:
        util = log.gpu_memory_utilization
        return (
            f"  lever: leave gpu_memory_utilization unset: {util if util is not None else 'a value under 1.0'} "
            f"withholds {log.withheld.bytes / 2**30:.2f} GiB from vLLM 0.34's measured cache, which needs no "
            f"headroom of its own{fp8}"
        )
    if log.transient_kept is not None and known and log.transient_kept.bytes >= max(known.values()):
        return (
            f"  lever: a smaller --max-num-batched-tokens or --max-num-seqs: vLLM 0.34 keeps the transient peak "
            f"({log.transient_kept.bytes / 2**30:.2f} GiB) and a margin of at least 1 GiB free{fp8}"
        )
    if not known:
        return f"  lever: the log prints no term besides the KV pool{fp8}"
    largest = max(known, key=lambda k: known[k] or 0)
    return f"  lever: {_LEVERS[largest]}{fp8}"


def main(
    path: str, model: str | None = None, total_bytes: int | None = None, version: str | None = None
) -> str:
    """Read `path` and explain it; a ValueError (one line) when the file is not a vLLM start-up log."""
    from kvlab.planning import vllm_log

    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    return explain(vllm_log.parse(text), model, total_bytes, version)
