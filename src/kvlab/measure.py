"""Measuring what the cache holds, how much memory a step takes, and how long it takes.

- `cache_inventory` / `cache_tensor_bytes`: every tensor a transformers `Cache` object keeps, and their bytes;
  `cache_growth`: those bytes after a prefill and after each decode step.
- `module_kv_bytes_per_token` / `expected_pool_bytes`: what a KV cache must hold per token, read from the model's
  own attention modules (the output sizes of each K and V projection), not from its config: the expectation that
  a pool's bytes, measured from its tensors, are checked against (`tensor_bytes` counts those).
- `MemoryTracker`: CUDA allocator statistics on a GPU; on CPU, accounting of every tensor storage created inside
  the block (a `TorchDispatchMode` sees each aten op's outputs, and weak references see them freed).
- `time_call` / `Timer`: CUDA events on a GPU, `perf_counter` on CPU (or `step_clock`: the thread's CPU time).
- `percentiles`: the one percentile helper (nearest-rank-free, linear interpolation as numpy does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from kvlab.env import pick_device
from kvlab.kv_format import SCALE_DTYPE, pool_format

# The CPU memory tracker relies on three torch internals; another torch version may move them. Import them
# guarded, so that only the CPU tracker fails, with a message that says why.
try:
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError as _err:  # pragma: no cover
    _TRACKER_ERROR: str | None = (
        f"kvlab.measure.MemoryTracker on CPU needs torch internals this torch {torch.__version__} lacks ({_err}); "
        "use torch 2.4 or newer, or measure on CUDA"
    )
    TorchDispatchMode = object  # type: ignore[misc,assignment]
else:
    _TRACKER_ERROR = None


@dataclass(frozen=True)
class CacheTensor:
    layer: int
    # The attribute that holds it; a tensor inside a dict or list attribute is named `attribute[key]`
    # (a linear-attention layer's `conv_states[0]`, `recurrent_states[0]`)
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # numel × element size of this tensor (a view counts only what it shows)
    nbytes: int
    # Bytes of the storage behind it (can exceed nbytes for a sliced view)
    storage_nbytes: int
    # True for what the cache keeps per sequence: K/V and the conv and recurrent state of state layers; False for
    # bookkeeping such as the 0-d integer window size of a sliding layer
    is_state: bool


# The attributes of a transformers cache layer that hold K/V (`cache_tensor_bytes` counts every tensor, these
# and state alike; the names are kept for readers of the inventory).
_STATE_NAMES = ("keys", "values")
# How deep `_cache_tensors` follows containers and plain objects inside one layer.
_MAX_DEPTH = 6


def _layers(cache: Any) -> list[Any]:
    if hasattr(cache, "layers"):
        return list(cache.layers)
    # Legacy tuple-of-(k, v) format
    if isinstance(cache, (tuple, list)):
        return [dict(keys=kv[0], values=kv[1]) for kv in cache]
    raise TypeError(f"cannot read a cache of type {type(cache).__name__}; expected a transformers Cache")


def _walk(obj: Any, name: str, seen: set[int], depth: int) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor reachable from `obj` through dicts, lists, tuples and plain objects."""
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{name}[{key}]", seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for key, value in enumerate(obj):
            yield from _walk(value, f"{name}[{key}]", seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module, torch.device, torch.dtype)):
        for key, value in vars(obj).items():
            yield from _walk(value, f"{name}.{key}" if name else key, seen, depth + 1)


def _cache_tensors(cache: Any) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, name, tensor) for every tensor each layer of the cache holds, each tensor object once: K and V,
    the conv and recurrent states of a linear-attention (Mamba, gated-DeltaNet) layer, bookkeeping scalars."""
    seen: set[int] = set()
    rows: list[tuple[int, str, torch.Tensor]] = []
    for index, layer in enumerate(_layers(cache)):
        attributes = layer if isinstance(layer, dict) else vars(layer)
        for attribute, value in attributes.items():
            rows.extend((index, name, tensor) for name, tensor in _walk(value, attribute, seen, 0))
    return rows


def _is_state(tensor: torch.Tensor) -> bool:
    # A 0-d integer (a sliding layer's window size) is bookkeeping; everything else is K/V or state.
    return not (tensor.dim() == 0 and not tensor.is_floating_point())


def cache_inventory(cache: Any) -> list[CacheTensor]:
    """Every tensor the cache object keeps, layer by layer, with shape, dtype and bytes: K and V, and the conv
    and recurrent state tensors of state layers (in dict attributes such as `conv_states`, named `conv_states[0]`)."""
    return [
        CacheTensor(
            layer=index,
            name=name,
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            nbytes=tensor.numel() * tensor.element_size(),
            storage_nbytes=tensor.untyped_storage().nbytes(),
            is_state=_is_state(tensor),
        )
        for index, name, tensor in _cache_tensors(cache)
    ]


def cache_tensor_bytes(cache: Any, storage: bool = False) -> int:
    """Bytes of every K/V and state tensor a cache holds (0-d integer bookkeeping excluded).

    Attention layers' K and V, and the fixed-size conv and recurrent states of state layers (Mamba-2, gated
    DeltaNet: transformers' `LinearAttentionLayer`) alike: what `kvlab.specs.sizing.kv_cache_bytes` predicts.
    A tensor region held twice is counted once. `storage=True` counts the storages behind them instead, each
    storage once: a sliding-window layer's tensor can be a view into a larger buffer until the next update, so
    the allocator can hold more than the cache logically needs.
    """
    tensors = [tensor for _, _, tensor in _cache_tensors(cache) if _is_state(tensor)]
    seen: dict[tuple[Any, ...], int] = {}
    for tensor in tensors:
        st = tensor.untyped_storage()
        if storage:
            # Shared storages (K and V cut from one buffer) are counted once.
            seen[(str(tensor.device), st.data_ptr(), st.nbytes())] = st.nbytes()
        else:
            region = (
                str(tensor.device),
                st.data_ptr(),
                tensor.storage_offset(),
                tuple(tensor.shape),
                tensor.stride(),
            )
            seen[region] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


@torch.inference_mode()
def cache_growth(model: PreTrainedModel, ids: torch.Tensor, steps: int) -> list[tuple[int, int]]:
    """(tokens held per sequence, bytes of the cache's K/V tensors) after a prefill of `ids` (batch, prompt)
    into a fresh `DynamicCache`, then after each of `steps` greedy decode steps."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    cache = DynamicCache(config=model.config)
    out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    held = [(ids.shape[1], cache_tensor_bytes(cache))]
    for _ in range(steps):
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        held.append((held[-1][0] + 1, cache_tensor_bytes(cache)))
    return held


def module_kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes one token's K and V take in every layer, read from the model's attention modules.

    Each module with `k_proj` and `v_proj` linear layers writes `k_proj.out_features` key and
    `v_proj.out_features` value elements per token (kv_heads × head_dim each); their sum over all such modules,
    times the element size (`dtype`, else the K projection's weight dtype), is what a cache of every layer must
    store per token. Nothing here reads the config or `kvlab.specs.arch`, so it is an independent expectation for the
    engine's pool, whose shape comes from `kvlab.specs.arch.describe`.
    """
    total = 0
    for name, module in model.named_modules():
        k_proj, v_proj = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if k_proj is None and v_proj is None:
            continue
        if not (isinstance(k_proj, torch.nn.Linear) and isinstance(v_proj, torch.nn.Linear)):
            raise ValueError(
                f"{name or 'model'}: k_proj and v_proj must both be nn.Linear to read the K/V width"
            )
        itemsize = (dtype or k_proj.weight.dtype).itemsize
        total += (k_proj.out_features + v_proj.out_features) * itemsize
    if not total:
        raise ValueError(
            f"{type(model).__name__} has no attention module with k_proj and v_proj (fused QKV or MLA projections "
            "are not read)"
        )
    return total


def expected_pool_bytes(
    model: torch.nn.Module, num_tokens: int, dtype: torch.dtype | None = None, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes a KV store of `num_tokens` token slots in every layer must hold: `module_kv_bytes_per_token` × tokens.

    This is the engine's pool when its blocks span every layer (one KV-cache group: Llama, Mistral, Qwen). In a
    hybrid model (Gemma 3) a block spans one group's layers, so the pool holds fewer layers per slot.
    `kv_cache_dtype` "fp8"/"int8" (`EngineConfig`): one byte per K/V element plus one fp16 scale per token and
    head, the heads counted as each projection's width over the module's `head_dim`.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if kv_cache_dtype == "auto":
        return num_tokens * module_kv_bytes_per_token(model, dtype)
    code_dtype = pool_format(kv_cache_dtype).code_dtype
    assert code_dtype is not None
    # K and V elements per token, all layers
    elements = module_kv_bytes_per_token(model, torch.uint8)
    heads = 0
    for module in model.modules():
        k_proj, v_proj = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
        if isinstance(k_proj, torch.nn.Linear) and isinstance(v_proj, torch.nn.Linear):
            heads += (k_proj.out_features + v_proj.out_features) // int(module.head_dim)  # type: ignore[arg-type]
    return num_tokens * (elements * code_dtype.itemsize + heads * SCALE_DTYPE.itemsize)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the storages behind these tensors, each storage counted once (views of one buffer share it)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected tensors, got {type(tensor).__name__}")
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


class _TensorAccounting(TorchDispatchMode):
    """Counts live bytes of tensor storages created while active (CPU stand-in for allocator statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
        return out


# PyTorch's CUDA caching allocator hands out a cached free block whole, unsplit, when what would be left over is
# at most 1 MiB (kSmallSize; `should_split` in c10/cuda/CUDACachingAllocator.cpp), and memory_allocated counts the
# whole block: an allocation served from the cache can count up to 1 MiB more than its tensor holds.
CUDA_REUSED_BLOCK_SLACK = 1 << 20


def allocator_slack_bytes(device: str | torch.device | None = None) -> int:
    """Bytes by which `MemoryTracker`'s retained bytes may exceed the tensors allocated: `CUDA_REUSED_BLOCK_SLACK`
    on CUDA, whose allocator may hand out a reused block larger than asked; 0 on CPU, where it counts storages
    exactly."""
    return CUDA_REUSED_BLOCK_SLACK if pick_device(device).type == "cuda" else 0


@dataclass
class MemoryTracker:
    """Peak and retained bytes of what a block allocates.

    On CUDA: from the caching allocator (`max_memory_allocated`), relative to the start of the block.
    On CPU: from accounting of every tensor storage the block creates.
    """

    device: str | torch.device | None = None
    peak_bytes: int = 0
    retained_bytes: int = 0
    _start: int = field(default=0, repr=False)
    _mode: _TensorAccounting | None = field(default=None, repr=False)

    def __enter__(self) -> MemoryTracker:
        self.device = pick_device(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if _TRACKER_ERROR:
                raise RuntimeError(_TRACKER_ERROR)
            self._mode = _TensorAccounting()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        device = pick_device(self.device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.peak_bytes = torch.cuda.max_memory_allocated(device) - self._start
            self.retained_bytes = torch.cuda.memory_allocated(device) - self._start
        else:
            mode, self._mode = self._mode, None
            if mode is None:
                raise RuntimeError("MemoryTracker exited without being entered")
            mode.__exit__(*exc)
            mode._sweep()
            self.peak_bytes, self.retained_bytes = mode.peak, mode.current


def cuda_context_bytes(device: str | torch.device | None = None) -> int:
    """Device memory this process holds outside PyTorch's caching allocator: CUDA context, cuBLAS and other
    library workspaces. Measured as (total - free) - reserved, which assumes no other process uses the GPU
    (the way vLLM measures its "non-torch" memory). Raises on a machine without CUDA."""
    device = pick_device(device)
    if device.type != "cuda":
        raise ValueError(f"the CUDA context can only be measured on a CUDA device, not {device}")
    torch.cuda.init()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def synchronize(device: str | torch.device | None = None) -> None:
    device = pick_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], Any],
    device: str | torch.device | None = None,
    repeat: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] | None = None,
) -> list[float]:
    """The one best-of-N timer: the seconds of each of `repeat` calls of `fn`, after `warmup` untimed calls.

    The best is `min` of the list (on a shared machine noise only ever adds time), the median
    `percentiles(times, (50,))["p50"]`. Each call is timed by a `Timer`: on a GPU between CUDA events recorded on
    the current stream before and after `fn`, waited for, so asynchronous work `fn` queues on that stream (a
    non-blocking copy, a kernel) is counted; on a CPU by `clock`, by default the wall clock (`time.perf_counter`;
    `step_clock` gives the thread's CPU time). A result `fn` returns is dropped: a caller that needs it keeps it
    from inside `fn`.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    device = pick_device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        with Timer(device, clock=clock) as timer:
            fn()
        times.append(timer.seconds)
    return times


def step_clock(device: str | torch.device | None = None) -> Callable[[], float]:
    """The clock a timed step on `device` is read with: on a CPU running torch on one thread, this thread's CPU
    time (`time.thread_time`), otherwise the wall clock (`time.perf_counter`; a GPU is timed with CUDA events
    whatever the clock).

    On a shared CPU a step's wall time includes every moment another process held the core, which varies from
    step to step with the load; the thread's CPU time counts only the moments it ran (its page faults included).
    That holds only while the calling thread does all the work (`torch.set_num_threads(1)`).
    """
    if pick_device(device).type == "cuda" or torch.get_num_threads() > 1:
        return time.perf_counter
    return time.thread_time


@dataclass
class Timer:
    """Time of a block: on CUDA between events on the current stream; on CPU by `clock` (default: the wall
    clock, `time.perf_counter`; `step_clock` gives this thread's CPU time where that is the better measure)."""

    device: str | torch.device | None = None
    seconds: float = 0.0
    clock: Callable[[], float] | None = None

    def __enter__(self) -> Timer:
        self.device = pick_device(self.device)
        if self.device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._read = self.clock or time.perf_counter
            self._t0 = self._read()
        return self

    def __exit__(self, *exc: object) -> None:
        if pick_device(self.device).type == "cuda":
            self._events[1].record()
            self._events[1].synchronize()
            self.seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
        else:
            self.seconds = self._read() - self._t0


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """{"p50": ..., "p95": ..., "p99": ...} with numpy's linear interpolation. Empty input is an error."""
    data = np.asarray(values if isinstance(values, (np.ndarray, list, tuple)) else list(values), dtype=float)
    if data.size == 0:
        raise ValueError("percentiles of an empty sequence are undefined")
    return {f"p{q:g}": float(np.percentile(data, q)) for q in qs}
