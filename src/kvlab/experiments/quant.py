"""Quantized KV caches as transformers cache layers, their exact stored bytes, and their accuracy.

`make_cache(method, config)` returns a `transformers.Cache` whose full-attention layers store keys and values in
fewer bits; `model.generate(ids, cache=cache)` and `model(ids, cache=cache)` use it like a
`DynamicCache`. Four methods:

- ``"int8"``: symmetric int8, one scale per token and head (over the head dimension);
- ``"fp8"``: float8 e4m3 (``torch.float8_e4m3fn``) with one scale per token and head;
- ``"int4"``: asymmetric 4-bit codes packed two per byte, a scale and a minimum per group of ``group_size``
  channels of each token (default 32, or the whole head if narrower);
- ``"kivi2"``: KIVI-style 2-bit (Liu et al., 2024, arXiv:2402.02750): keys quantized per channel over groups of
  ``group_size`` tokens, values per token over groups of ``group_size`` channels, codes packed four per byte, and
  the most recent tokens (fewer than ``residual_length``) kept in full precision until a whole block can be
  quantized.

Scales and minima are stored in fp16. Every stored tensor is its own allocation (no views), so `stored_bytes`
is exactly what the layers hold. Attention reads the whole cache dequantized to the model's dtype at every step:
that transient copy is the decode step's *working set*, measured separately by `decode_step_memory`.

Sliding-window layers (Mistral, Gemma, ...) keep transformers' `DynamicSlidingWindowLayer` in full precision by
default (``sliding="full"``): they hold at most ``window - 1`` tokens, a bounded cost, and quantizing them would
need a ring buffer of codes. ``sliding="error"`` refuses such models instead, as transformers' `QuantizedCache`
always does. The int8 and fp8 quantizers, and the storage format of the engine's paged pool, are
`kvlab.kv_format`'s. Chapter: *Quantizing the cache* (book/11_kv_quantization).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache, DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from kvlab.experiments import evict
from kvlab.experiments.decode import DecodeResult, greedy_decode
from kvlab.kv_format import (
    SCALE_DTYPE,
    TINY_SCALE,
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from kvlab.measure import MemoryTracker, time_call

# ---------------------------------------------------------------------------------------------------------------
# Quantizers on plain tensors (pure functions, tested one by one); int8 and fp8 are `kvlab.kv_format`'s.


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, dim: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric `bits`-bit codes over groups of `group_size` along `dim`: x ≈ minimum + code × scale.

    Returns `(codes, scale, minimum)`: codes as uint8 (unpacked) with `x`'s shape, and one fp16 scale and minimum
    per group (`dim` shrunk by `group_size`). The rounding error is at most half a step, `scale / 2`, per group.
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group_size:
        raise ValueError(f"group_size={group_size} must divide the quantized dimension ({n})")
    levels = 2**bits - 1
    grouped = x.float().unflatten(dim, (n // group_size, group_size))
    lo = grouped.amin(dim=dim + 1, keepdim=True).to(SCALE_DTYPE)
    hi = grouped.amax(dim=dim + 1, keepdim=True)
    scale = ((hi - lo.float()) / levels).clamp(min=TINY_SCALE).to(SCALE_DTYPE)
    codes = torch.round((grouped - lo.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return codes.flatten(dim, dim + 1), scale.squeeze(dim + 1), lo.squeeze(dim + 1)


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
    dim: int = -1,
) -> torch.Tensor:
    dim = dim % codes.dim()
    grouped = codes.float().unflatten(dim, (codes.shape[dim] // group_size, group_size))
    x = grouped * scale.float().unsqueeze(dim + 1) + minimum.float().unsqueeze(dim + 1)
    return x.flatten(dim, dim + 1).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of `bits` (2 or 4) bits, 8 // bits per byte, along the last dimension."""
    per_byte = 8 // bits
    if bits not in (2, 4) or codes.shape[-1] % per_byte:
        raise ValueError(f"cannot pack {bits}-bit codes along a last dimension of {codes.shape[-1]}")
    grouped = codes.unflatten(-1, (codes.shape[-1] // per_byte, per_byte)).to(torch.uint8)
    out = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per_byte):
        out |= grouped[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = 2**bits - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------------------
# Cache layers.


class QuantizedKVLayer(DynamicLayer):
    """A full-attention cache layer that stores K and V quantized; subclasses choose the format.

    `update` appends the new states and returns the whole history dequantized to the model's dtype (plus any
    full-precision residual): attention reads quantized values for every stored token, as a decode step does.
    """

    method = "base"
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.stored: dict[str, torch.Tensor] = {}
        self.length = 0
        self.dtype = torch.float32

    # Subclasses: quantize new states into `self.stored`, and rebuild full K, V from it.
    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        # DynamicLayer's empty placeholders: what transformers inspects; they hold no bytes.
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        self.length += key_states.shape[-2]
        return self._dequantized()

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.stored = {}
        self.length = 0
        super().reset()

    def _cat(self, name: str, tensor: torch.Tensor, dim: int = -2) -> None:
        old = self.stored.get(name)
        # A fresh allocation either way: never a view of (or alias to) the caller's tensor.
        self.stored[name] = (
            tensor.clone(memory_format=torch.contiguous_format)
            if old is None
            else torch.cat([old, tensor], dim=dim)
        )

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.stored.values()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.stored = {k: v.repeat_interleave(repeats, dim=0) for k, v in self.stored.items()}

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.stored = {k: v[indices].contiguous() for k, v in self.stored.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.stored = {k: v.index_select(0, beam_idx.to(v.device)) for k, v in self.stored.items()}


class PerTokenLayer(QuantizedKVLayer):
    """One byte per element and one fp16 scale per token and head; the subclass names its quantizer."""

    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, x in (("k", keys), ("v", values)):
            codes, scale = type(self).quantize(x)
            self._cat(name, codes)
            self._cat(name + "_scale", scale)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        s, dequantize = self.stored, type(self).dequantize
        return dequantize(s["k"], s["k_scale"], self.dtype), dequantize(s["v"], s["v_scale"], self.dtype)


class Int8Layer(PerTokenLayer):
    method = "int8"
    quantize = staticmethod(quantize_int8)
    dequantize = staticmethod(dequantize_int8)


class Fp8Layer(PerTokenLayer):
    method = "fp8"
    quantize = staticmethod(quantize_fp8)
    dequantize = staticmethod(dequantize_fp8)


class Int4Layer(QuantizedKVLayer):
    method = "int4"

    def __init__(self, group_size: int | None = None) -> None:
        super().__init__()
        # Default: 32 channels, or the whole head if it is narrower
        self.group_size = group_size or 0

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.group_size = self.group_size or min(32, keys.shape[-1])
        for name, x in (("k", keys), ("v", values)):
            codes, scale, minimum = quantize_groups(x, 4, self.group_size, dim=-1)
            self._cat(name, pack(codes, 4))
            self._cat(name + "_scale", scale)
            self._cat(name + "_min", minimum)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        s, g = self.stored, self.group_size
        k = dequantize_groups(unpack(s["k"], 4), s["k_scale"], s["k_min"], g, self.dtype)
        v = dequantize_groups(unpack(s["v"], 4), s["v_scale"], s["v_min"], g, self.dtype)
        return k, v


class Kivi2Layer(QuantizedKVLayer):
    """KIVI's asymmetric 2-bit cache: keys per channel (groups along tokens), values per token, recent tokens full.

    Tokens wait in a full-precision residual; once it holds `residual_length` or more, the oldest whole multiple
    of `residual_length` tokens is quantized, so the residual always holds fewer than `residual_length` tokens.
    """

    method = "kivi2"

    def __init__(self, group_size: int = 32, residual_length: int = 128) -> None:
        super().__init__()
        if residual_length % group_size:
            raise ValueError(
                f"residual_length={residual_length} must be a multiple of group_size={group_size}"
            )
        self.group_size = group_size
        self.residual_length = residual_length

    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._cat("k_residual", keys)
        self._cat("v_residual", values)
        held = self.stored["k_residual"].shape[-2]
        flush = (held // self.residual_length) * self.residual_length
        if not flush:
            return
        k_res, v_res = self.stored["k_residual"], self.stored["v_residual"]
        codes, scale, minimum = quantize_groups(k_res[..., :flush, :], 2, self.group_size, dim=-2)
        self._cat("k", pack(codes, 2))
        self._cat("k_scale", scale)
        self._cat("k_min", minimum)
        codes, scale, minimum = quantize_groups(v_res[..., :flush, :], 2, self._value_group(), dim=-1)
        self._cat("v", pack(codes, 2))
        self._cat("v_scale", scale)
        self._cat("v_min", minimum)
        # Clones, not views: a view would keep the flushed tokens' full-precision storage alive.
        self.stored["k_residual"] = k_res[..., flush:, :].clone()
        self.stored["v_residual"] = v_res[..., flush:, :].clone()

    def _value_group(self) -> int:
        """Values are grouped along the head dimension: `group_size` channels, or the whole head if narrower."""
        return min(self.group_size, self.stored["v_residual"].shape[-1])

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        s, g = self.stored, self.group_size
        if "k" not in s:
            return s["k_residual"], s["v_residual"]
        k = dequantize_groups(unpack(s["k"], 2), s["k_scale"], s["k_min"], g, self.dtype, dim=-2)
        v = dequantize_groups(
            unpack(s["v"], 2), s["v_scale"], s["v_min"], self._value_group(), self.dtype, dim=-1
        )
        return torch.cat([k, s["k_residual"]], dim=-2), torch.cat([v, s["v_residual"]], dim=-2)


LAYERS: dict[str, Callable[..., QuantizedKVLayer]] = {
    "fp8": Fp8Layer,
    "int8": Int8Layer,
    "int4": Int4Layer,
    "kivi2": Kivi2Layer,
}
METHODS = tuple(LAYERS)
# Stored bits per cached element at long context (residual excluded), for head_dim 64 and the default groups.


def make_cache(
    method: str, config: PretrainedConfig | Any, *, sliding: str = "full", **options: Any
) -> Cache:
    """A `transformers.Cache` for `config` (or a model) whose full-attention layers store K and V per `method`.

    `method`: one of ``"fp8"``, ``"int8"``, ``"int4"``, ``"kivi2"``. `options` go to the layer (``group_size``
    for int4 and kivi2, ``residual_length`` for kivi2). `sliding`: ``"full"`` keeps sliding-window layers in full
    precision (transformers' own layer), ``"error"`` refuses models that have them.
    """
    if method not in LAYERS:
        raise ValueError(f"unknown KV quantization method {method!r}; known methods: {', '.join(METHODS)}")
    if sliding not in ("full", "error"):
        raise ValueError(f"sliding must be 'full' or 'error', got {sliding!r}")
    config = getattr(config, "config", config)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"make_cache needs a transformers config or model, got {type(config).__name__}")
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    layers: list[Any] = []
    for kind, kwargs in zip(layer_types, layer_kwargs, strict=True):
        if kind == "full_attention":
            try:
                layers.append(LAYERS[method](**options))
            except TypeError:
                raise ValueError(f"method {method!r} takes no option among {sorted(options)}") from None
        elif kind in ("sliding_attention", "chunked_attention") and sliding == "full":
            layers.append(DynamicSlidingWindowLayer(**kwargs))
        else:
            raise ValueError(
                f"layer kind {kind!r} is not quantized by kvlab.experiments.quant"
                + (" (sliding='error' refuses sliding-window layers)" if "sliding" in kind else "")
            )
    return Cache(layers=layers)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def stored_bytes(cache: Cache) -> int:
    """Exact bytes of the tensors a cache's layers hold: codes, scales, minima and full-precision residual.

    Works for `make_cache` caches, `DynamicCache`, and transformers' `QuantizedCache` (its quantized tuples and
    residual). Each distinct storage is counted once, at its full size.
    """
    seen: dict[tuple[int, int], int] = {}
    for layer in cache.layers:
        if isinstance(layer, QuantizedKVLayer):
            found = list(layer.tensors())
        else:
            found = list(_tensors([getattr(layer, "keys", None), getattr(layer, "values", None)]))
            for name in ("_quantized_keys", "_quantized_values"):
                found += list(_tensors(getattr(layer, name, None)))
        for tensor in found:
            storage = tensor.untyped_storage()
            if storage.nbytes():
                seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def stored_bits_per_element(method: str, head_dim: int = 64, group_size: int = 32) -> float:
    """Bits a long-context cached K or V element costs in `method`, scales included (KIVI's residual excluded)."""
    scale_bits = 16
    if method in ("int8", "fp8"):
        return 8 + scale_bits / head_dim
    if method == "int4":
        return 4 + 2 * scale_bits / group_size
    if method == "kivi2":
        return 2 + 2 * scale_bits / group_size
    raise ValueError(f"unknown KV quantization method {method!r}; known methods: {', '.join(METHODS)}")


def predicted_stored_bytes(
    method: str,
    config: PretrainedConfig,
    tokens: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    group_size: int | None = None,
    residual_length: int = 128,
) -> int:
    """Bytes a cache of `method` holds after `tokens` tokens, from the format alone (every layer full attention).

    ``"none"`` is the full-precision `DynamicCache`; ``"hf-fp8"`` is transformers' `QuantizedCache("fp8")`
    (1-byte codes and one fp32 scale per K or V tensor per layer). Scales and minima are fp16 (2 bytes).
    """
    text = config.get_text_config(decoder=True)
    layers, heads = text.num_hidden_layers, text.num_key_value_heads
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # (batch, head, token) rows of `d` elements, for K and for V
    rows = batch * heads * tokens
    elem = torch.empty(0, dtype=dtype).element_size()
    if method == "none":
        per_layer = 2 * rows * d * elem
    elif method == "hf-fp8":
        per_layer = 2 * (rows * d + 4)
    elif method in ("int8", "fp8"):
        per_layer = 2 * rows * (d + 2)
    elif method == "int4":
        g = group_size or min(32, d)
        per_layer = 2 * rows * (d // 2 + 2 * 2 * (d // g))
    elif method == "kivi2":
        g = group_size or 32
        flushed = (tokens // residual_length) * residual_length
        q_rows = batch * heads * flushed
        keys = q_rows * d // 4 + 2 * 2 * (q_rows // g) * d
        values = q_rows * d // 4 + 2 * 2 * q_rows * (d // min(g, d))
        per_layer = keys + values + 2 * batch * heads * (tokens - flushed) * d * elem
    else:
        raise ValueError(
            f"unknown KV quantization method {method!r}; known methods: none, hf-fp8, {', '.join(METHODS)}"
        )
    return layers * per_layer


# ---------------------------------------------------------------------------------------------------------------
# Accuracy, memory and speed on a model.

CacheFactory = Callable[[], Cache]


def cache_factory(method: str | None, model: Any, **options: Any) -> CacheFactory:
    """A zero-argument builder of fresh caches: None → `DynamicCache`, ``"hf-fp8"`` → transformers' own
    `QuantizedCache(backend="fp8")`, an eviction policy (`kvlab.experiments.evict.POLICIES`) → its cache, else
    `make_cache(method, ...)`."""
    config = model.config
    if method is None or method == "none":
        return lambda: DynamicCache(config=config)
    if method == "hf-fp8":
        from transformers import QuantizedCache

        return lambda: QuantizedCache("fp8", config)
    if method in evict.POLICIES:
        # Validate now, not inside a loop
        evict.make_cache(method, model, **options)
        return lambda: evict.make_cache(method, model, **options)
    # Validate now, not inside a loop
    make_cache(method, config, **options)
    return lambda: make_cache(method, config, **options)


def evaluation_text() -> str:
    """The English text chapter 11 scores the caches on: this book's introduction and chapters 1-9 (Markdown),
    frozen in `kvlab/data/book_prose.txt` so that the figures do not move when the chapters are edited."""
    from importlib.resources import files

    return (files("kvlab") / "data" / "book_prose.txt").read_text(encoding="utf-8")


@dataclass
class Accuracy:
    """A cache variant against the full-precision cache on the same tokens (teacher-forced)."""

    method: str
    # Positions scored
    tokens: int
    # Mean negative log-likelihood (nats per token)
    nll: float
    reference_nll: float
    # Mean KL(reference || variant) of next-token distributions, nats
    kl: float
    # Fraction of positions whose argmax matches the reference's
    top1_agreement: float
    # ||attn_q - attn|| / ||attn|| over all layers, on the last chunk
    attention_rel_error: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(self.reference_nll)


def _attention_modules(model: Any) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]


def _run_chunks(
    model: Any, ids: torch.Tensor, cache: Cache, chunk: int, capture: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Feed `ids` (1 × T) through the model `chunk` tokens at a time with `cache`; log-probs of every position.

    With `capture`, the attention outputs of the last chunk are appended to it, layer by layer.
    """
    hooks = []
    if capture is not None:
        last_start = ((ids.shape[1] - 1) // chunk) * chunk

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if state["start"] == last_start:
                capture.append((output[0] if isinstance(output, tuple) else output).detach().float())

        state = {"start": 0}
        hooks = [m.register_forward_hook(hook) for m in _attention_modules(model)]
    out = []
    try:
        with torch.inference_mode():
            for start in range(0, ids.shape[1], chunk):
                if capture is not None:
                    state["start"] = start
                logits = model(ids[:, start : start + chunk], cache=cache, use_cache=True).logits
                out.append(torch.log_softmax(logits[0].float(), dim=-1))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(out)


def accuracy(
    model: Any,
    ids: torch.Tensor,
    methods: list[str],
    *,
    segment: int = 1024,
    chunk: int = 64,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Accuracy]:
    """Teacher-forced accuracy of each cache variant against `DynamicCache` on a long token stream `ids` (1-D).

    The stream is cut into segments of `segment` tokens; each segment is fed `chunk` tokens at a time, so every
    chunk attends to the cache's stored (quantized or evicted) history and to its own stored states. The first chunk
    of each segment is not scored (it has no history). Methods are `make_cache` names, ``"hf-fp8"`` or eviction
    policies (`kvlab.experiments.evict`).
    """
    ids = ids.reshape(-1)
    if ids.numel() < 2 * chunk or segment < 2 * chunk:
        raise ValueError(f"need at least two chunks of {chunk} tokens per segment (segment={segment})")
    device = next(model.parameters()).device
    options = options or {}
    factories = {m: cache_factory(m, model, **options.get(m, {})) for m in methods}
    sums = {m: dict(nll=0.0, ref=0.0, kl=0.0, top1=0.0, num=0.0, den=0.0) for m in methods}
    scored = 0
    for start in range(0, ids.numel() - 2 * chunk + 1, segment):
        seg = ids[start : start + segment].to(device).unsqueeze(0)
        targets = seg[0, chunk + 1 :]
        first = start == 0
        ref_attn: list[torch.Tensor] = []
        ref = _run_chunks(model, seg, DynamicCache(config=model.config), chunk, ref_attn if first else None)
        ref_lp = ref[chunk:-1]
        ref_nll = -ref_lp.gather(1, targets[:, None]).sum().item()
        scored += targets.numel()
        for m in methods:
            attn: list[torch.Tensor] = []
            lp = _run_chunks(model, seg, factories[m](), chunk, attn if first else None)[chunk:-1]
            s = sums[m]
            s["nll"] -= lp.gather(1, targets[:, None]).sum().item()
            s["ref"] += ref_nll
            s["kl"] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            s["top1"] += (lp.argmax(-1) == ref_lp.argmax(-1)).sum().item()
            if first:
                s["num"] = sum(((a - b) ** 2).sum().item() for a, b in zip(attn, ref_attn, strict=True))
                s["den"] = sum((b**2).sum().item() for b in ref_attn)
    return {
        m: Accuracy(
            method=m,
            tokens=scored,
            nll=s["nll"] / scored,
            reference_nll=s["ref"] / scored,
            kl=s["kl"] / scored,
            top1_agreement=s["top1"] / scored,
            attention_rel_error=math.sqrt(s["num"] / s["den"]),
        )
        for m, s in sums.items()
    }


@dataclass
class GreedyRun:
    method: str
    tokens: list[int]
    reference: list[int]
    seconds_per_token: float
    # per generated token, the ids of the `top_k` largest logits, the chosen token first (kvlab.agreement's rule)
    top_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        """Fraction of the generated positions where the variant's token equals the full-precision one."""
        return sum(a == b for a, b in zip(self.tokens, self.reference, strict=True)) / len(self.reference)

    @property
    def common_prefix(self) -> int:
        """Tokens generated before the first difference."""
        for i, (a, b) in enumerate(zip(self.tokens, self.reference, strict=True)):
            if a != b:
                return i
        return len(self.reference)


def greedy(
    model: Any,
    ids: torch.Tensor,
    method: str | None,
    steps: int,
    reference: list[int] | None = None,
    top_k: int = 2,
    **options: Any,
) -> GreedyRun:
    """Greedy decoding of `steps` tokens with a cache variant (None: `DynamicCache`), timed per token.

    The loop is `kvlab.experiments.decode.greedy_decode` into a fresh cache of `method`, choosing no end-of-sequence token (the
    tokens of `generate(..., min_new_tokens=steps)`), timed once by `kvlab.measure.time_call`. Each step's `top_k`
    best token ids are kept, from the logits after the timing, so that another path's tokens can be compared
    with these under `kvlab.agreement`'s near-tie rule.
    """
    device = next(model.parameters()).device
    ids = ids.to(device).reshape(1, -1)
    cache = cache_factory(method, model, **options)()
    runs: list[DecodeResult] = []
    seconds = time_call(
        lambda: runs.append(greedy_decode(model, ids, steps, cache=cache, min_new_tokens=steps)),
        device,
        repeat=1,
        warmup=0,
    )
    tokens = runs[0].tokens[0]
    top = runs[0].top_token_ids(top_k)[0]
    return GreedyRun(
        str(method), tokens, reference if reference is not None else tokens, seconds[0] / steps, top
    )


@dataclass
class StepMemory:
    """A decode step at a given context: what the cache stores, and the peak of what the step allocates."""

    method: str
    context: int
    stored_bytes: int
    # Peak bytes allocated during one decode forward (dequantized K/V, activations, logits)
    step_peak_bytes: int


def decode_step_memory(model: Any, ids: torch.Tensor, method: str | None, **options: Any) -> StepMemory:
    """Prefill `ids` into a fresh cache of `method`, then measure one decode step with `MemoryTracker`."""
    device = next(model.parameters()).device
    ids = ids.to(device).reshape(1, -1)
    cache = cache_factory(method, model, **options)()
    with torch.inference_mode():
        logits = model(ids, cache=cache, use_cache=True).logits
        nxt = logits[:, -1:].argmax(-1)
        del logits
        with MemoryTracker(device) as mem:
            model(nxt, cache=cache, use_cache=True)
    return StepMemory(str(method), ids.shape[1] + 1, stored_bytes(cache), mem.peak_bytes)


# ---------------------------------------------------------------------------------------------------------------
# Quantized weights, for contrast (book/10_weights_not_cache): the cache does not shrink with them.


def weight_bytes_held(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor storage in the model's state (parameters, buffers, quantized data and
    scales); a tied embedding counts once."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in model.state_dict(keep_vars=False).values():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
    return sum(seen.values())


def quantize_weights_int8(
    model: torch.nn.Module, exclude: str | list[str] | None = "lm_head"
) -> torch.nn.Module:
    """Weight-only int8 quantization of the model's linear layers in place, with optimum-quanto (frozen).

    The lm_head is left alone by default: in tied-embedding models it shares its table with the input embedding.
    """
    try:
        from optimum.quanto import freeze, qint8, quantize  # type: ignore[import-untyped]
    except ImportError:
        raise ModuleNotFoundError(
            "weight quantization needs optimum-quanto: run `pip install --no-deps optimum-quanto==0.2.7`"
        ) from None
    quantize(model, weights=qint8, exclude=exclude)
    freeze(model)
    return model


@dataclass(frozen=True)
class ShrinkPoint:
    """One way to shrink the cache, measured on the same text: what it stores against what it costs."""

    name: str
    # Bytes stored after a segment, over the full cache's on the same tokens
    stored_fraction: float
    perplexity: float
    reference_perplexity: float
    kl: float
    top1_agreement: float


def compare_shrinks(
    model: Any,
    ids: torch.Tensor,
    variants: dict[str, tuple[str, dict[str, Any]]],
    *,
    segment: int,
    chunk: int,
) -> list[ShrinkPoint]:
    """Quantized and evicting caches on one token stream: each variant (`name: (method or policy, options)`)
    scored by `kvlab.experiments.accuracy`, and its stored bytes after one `segment` fed `chunk` tokens at a
    time, against a `DynamicCache`'s (`kvlab.experiments.stored_bytes`)."""
    ids = ids.reshape(-1)
    device = next(model.parameters()).device
    first = ids[:segment].to(device)[None]
    full = stored_bytes(_filled(model, first, cache_factory(None, model)(), chunk))
    points = []
    for name, (method, options) in variants.items():
        (score,) = accuracy(
            model, ids, [method], segment=segment, chunk=chunk, options={method: options}
        ).values()
        cache = _filled(model, first, cache_factory(method, model, **options)(), chunk)
        points.append(
            ShrinkPoint(
                name,
                stored_bytes(cache) / full,
                score.perplexity,
                score.reference_perplexity,
                score.kl,
                score.top1_agreement,
            )
        )
    return points


def _filled(model: Any, ids: torch.Tensor, cache: Cache, chunk: int) -> Cache:
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start : start + chunk], cache=cache)
    return cache
