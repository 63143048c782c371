"""`kvlab explain-vllm LOGFILE`: a vLLM server's start-up budget, term by term, beside kvlab's figures.

The log (read by `kvlab.vllm_log`) gives what vLLM measured: weights, memory outside PyTorch, the activation
peak, CUDA graphs, the KV memory left and the tokens it holds. kvlab prints its own figure for each term
(`kvlab.sizing`, `kvlab.budget`), recomputes the token count from the printed KV memory with its exact per-token
bytes, explains the concurrency figure, and names the lever for the largest term. Chapter: *Active tokens, not
batch size* (book/05_active_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab import arch, budget
from kvlab.units import dtype_bytes, format_bytes
from kvlab.vllm_log import DEFAULT_BLOCK_SIZE, StartupLog

# Fine-tuned checkpoints whose config.json has the same layers, heads and widths as a registry entry, so the
# registry entry sizes them. Checked against the published files:
# https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json and .../Llama-3.1-8B/...,
# https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json and .../Llama-3.1-70B/...
SAME_SHAPE = {
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Llama-3.1-70B",
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
    from kvlab.shape import shape

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


def explain(log: StartupLog, model: str | None = None, total_bytes: int | None = None) -> str:
    """The report `kvlab explain-vllm` prints. `model` and `total_bytes` fill what the log does not say."""
    name = model or log.model
    sized = registry_name(name)
    tp = log.tensor_parallel_size or 1
    block = log.block_size or DEFAULT_BLOCK_SIZE
    total = log.total_gpu_memory.bytes if log.total_gpu_memory else total_bytes
    utilization = log.gpu_memory_utilization
    batched = log.max_num_batched_tokens or budget.MAX_NUM_BATCHED_TOKENS
    out = [
        f"vLLM start-up log ({log.format}, vLLM {log.vllm_version or 'version not printed'}): "
        f"model {name or 'not printed (pass --model)'}, TP={tp}, max_seq_len={log.max_seq_len or 'not printed'}"
    ]
    if sized is None:
        out.append(
            f"  kvlab cannot size {name or 'an unnamed model'} offline (not in `kvlab models`): vLLM's figures only"
        )
    dtype = kv_dtype(log)
    per_token = kv_estimate = weights = activation = None
    if sized is not None:
        from kvlab.sizing import kv_bytes_per_token, weight_bytes_per_gpu

        per_token = kv_bytes_per_token(sized, dtype, tp=tp)
        weights = weight_bytes_per_gpu(sized, "bf16", tp=tp)
        activation = budget.activation_workspace_bytes(sized, batched, budget.MAX_NUM_SEQS, "bf16", tp=tp)
        if total is not None:
            kv_estimate = budget.MemoryBudget(
                capacity_bytes=total,
                gpu_memory_utilization=utilization or budget.GPU_MEMORY_UTILIZATION,
                runtime_bytes=budget.CUDA_CONTEXT_BYTES,
                weight_bytes=weights,
                activation_bytes=activation,
                block_size=block,
                kv_bytes_per_token=per_token,
            ).kv_headroom_bytes
    reserve = None
    if total is not None:
        reserve = total - int(total * (utilization or budget.GPU_MEMORY_UTILIZATION))

    def printed(value: object) -> int | None:
        return None if value is None else value.bytes  # type: ignore[attr-defined]

    terms = [
        Term(
            "GPU memory",
            total,
            total,
            "printed total_gpu_memory, or --gpu-memory" if total else "not printed",
        ),
        Term(
            "engine reserve",
            reserve if utilization is not None else None,
            reserve,
            f"1 - gpu_memory_utilization ({utilization})"
            if utilization is not None
            else f"not printed; kvlab takes gpu_memory_utilization {budget.GPU_MEMORY_UTILIZATION}",
        ),
        Term("weights", printed(log.weights), weights, "kvlab: parameters × 2 bytes (bf16), one GPU's share"),
        Term(
            "non-torch memory",
            printed(log.non_torch),
            budget.CUDA_CONTEXT_BYTES,
            "kvlab: a fixed CUDA-context default (estimate)",
        ),
        Term(
            "activation peak",
            printed(log.activation_peak),
            activation,
            f"kvlab: estimate at {batched:,} batched tokens (kvlab.budget.activation_workspace_bytes)",
        ),
        Term("CUDA graphs", printed(log.cuda_graph), None, "kvlab does not charge graph memory"),
        Term(
            "available KV memory",
            printed(log.available_kv),
            kv_estimate,
            "kvlab: GPU memory less the terms above",
        ),
    ]
    out.append(f"  {'term':<21}{'vLLM printed':>14}{'kvlab':>14}   note")
    out += [f"  {t.name:<21}{_cell(t.vllm):>14}{_cell(t.kvlab):>14}   {t.note}" for t in terms]
    printed_tokens = log.tokens
    if per_token is not None and log.available_kv is not None:
        recomputed = tokens_from_memory(log.available_kv.bytes, per_token, block)
        out.append(
            f"  KV tokens: vLLM {printed_tokens if printed_tokens is None else f'{printed_tokens:,}'}; kvlab "
            f"{recomputed:,} from the printed {format_bytes(log.available_kv.bytes)} at {per_token:,} B/token "
            f"per GPU, blocks of {block} (the printed memory is rounded to ±{format_bytes(log.available_kv.half_ulp_bytes)})"
        )
    out += _concurrency(log, sized, dtype, tp, batched)
    out.append(_lever(terms, log))
    return "\n".join(out)


def _concurrency(log: StartupLog, sized: str | None, dtype: str | None, tp: int, batched: int) -> list[str]:
    tokens, seq = log.tokens, log.max_concurrency_tokens or log.max_seq_len
    if tokens is None:
        return ["  concurrency: the log prints no token count to explain"]
    if seq is None:
        return [f"  concurrency: {tokens:,} tokens; the log prints no max_seq_len to divide them by"]
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
    from kvlab.sizing import kv_bytes_per_token

    return kv_bytes_per_token(sized, dtype, tp=tp)


_LEVERS = {
    "engine reserve": "raise --gpu-memory-utilization (the reserve is the largest term)",
    "weights": "shard the weights: a larger --tensor-parallel-size (the weights are the largest term)",
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
    if not known:
        return f"  lever: the log prints no term besides the KV pool{fp8}"
    largest = max(known, key=lambda k: known[k] or 0)
    return f"  lever: {_LEVERS[largest]}{fp8}"


def main(path: str, model: str | None = None, total_bytes: int | None = None) -> str:
    """Read `path` and explain it; a ValueError (one line) when the file is not a vLLM start-up log."""
    from kvlab import vllm_log

    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}") from None
    return explain(vllm_log.parse(text), model, total_bytes)
