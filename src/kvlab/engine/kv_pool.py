"""The paged KV pool: one tensor of fixed-size blocks that every layer's K and V live in.

Every layer owns `num_blocks × block_size × kv_heads × head_dim` for K and again for V. A request's cache is a
list of block ids (its block table): token `i` lives in block `table[i // block_size]` at offset
`i % block_size`, that is in slot `block * block_size + offset` of the pool. Layers are grouped by attention kind
(`kv_cache_groups`), as vLLM's hybrid KV-cache manager groups them, and a block spans one group's layers.

`KVPool` writes a step's K and V at their slots and gathers blocks back into a reused workspace, dequantizing an
fp8 or int8 pool on the way. How attention reads it is `kvlab.engine.attention`. Chapters 5, 7 and 11.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from kvlab.kv_format import SCALE_DTYPE, pool_format
from kvlab.specs.arch import describe
from kvlab.specs.layers import SlidingWindowAttention


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose caches share block tables: one attention kind (`window` None for full attention)."""

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(config: PretrainedConfig) -> list[KVCacheGroup]:
    """The model's layers in KV-cache groups of equal size, as vLLM's hybrid KV cache manager forms them.

    One group when every layer has the same attention kind (Llama: all full; Mistral: all one window). A hybrid
    model (Gemma 3: five sliding layers to one full) is cut into groups of the smallest kind's layer count, so
    that every group's block spans the same number of layers and all groups draw on one pool of equal blocks
    (vLLM's uniform page size). Full groups come first, then sliding groups by window.
    """
    by_kind: dict[int | None, list[int]] = {}
    for i, layer in enumerate(describe(config).layers):
        window = layer.window if isinstance(layer, SlidingWindowAttention) else None
        by_kind.setdefault(window, []).append(i)
    size = min(len(layers) for layers in by_kind.values())
    groups = []
    for window in sorted(by_kind, key=lambda w: (w is not None, w or 0)):
        layers = by_kind[window]
        groups += [KVCacheGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return groups


@dataclass(frozen=True)
class KVShape:
    """What one block holds: `block_size` tokens of `kv_heads × head_dim` for K and again for V, in each of
    `num_layers` layer rows. A block spans every layer, except in a hybrid model, where it spans one KV-cache
    group's layers and `layer_rows` gives each model layer's row (its place in its group)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    # None: layer i is row i
    layer_rows: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVShape:
        spec = describe(config)
        other = sorted({layer.kind for layer in spec.layers} - {"full", "sliding"})
        if other:
            raise ValueError(
                f"{spec.model_type}: the paged cache holds full and sliding-window attention layers only, "
                f"not {' or '.join('MLA' if kind == 'mla' else kind for kind in other)} layers"
            )
        shapes = {(layer.kv_heads, layer.head_dim, layer.v_head_dim) for layer in spec.layers}  # type: ignore[attr-defined]
        if len(shapes) != 1 or next(iter(shapes))[1] != next(iter(shapes))[2]:
            raise ValueError(
                f"{spec.model_type}: layers must share one K/V shape to share a pool, got {shapes}"
            )
        kv_heads, head_dim, _ = shapes.pop()
        groups = kv_cache_groups(config)
        if len(groups) == 1:
            return cls(spec.num_layers, kv_heads, head_dim)
        rows = [0] * spec.num_layers
        for group in groups:
            for row, layer in enumerate(group.layers):
                rows[layer] = row
        return cls(max(len(g.layers) for g in groups), kv_heads, head_dim, tuple(rows))

    def row(self, layer_idx: int) -> int:
        return layer_idx if self.layer_rows is None else self.layer_rows[layer_idx]


class KVPool:
    """The physical cache: one tensor `(layers, 2, num_blocks, block_size, kv_heads, head_dim)`, allocated once.

    `kv_cache_dtype` (vLLM's name): ``"auto"`` stores K and V in `dtype`, the model's. ``"fp8"`` (e4m3) and
    ``"int8"`` store `kv` as one byte per element and `scales`, one fp16 scale per token and head
    `(layers, 2, num_blocks, block_size, kv_heads)`: `write` quantizes (`kvlab.kv_format.quantize_fp8` /
    `quantize_int8`), `gather` dequantizes the blocks it reads into the workspace, in `dtype`.
    """

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.format = pool_format(kv_cache_dtype)
        # What attention reads: the model's dtype
        self.dtype = dtype
        dims = (shape.num_layers, 2, num_blocks, block_size, shape.kv_heads)
        self.kv = torch.zeros(*dims, shape.head_dim, dtype=self.format.code_dtype or dtype, device=device)
        self.scales: torch.Tensor | None = None
        if self.format.quantized:
            self.scales = torch.zeros(dims, dtype=SCALE_DTYPE, device=device)
        # Where `gather` copies blocks to: (2, blocks, block_size * kv_heads * head_dim), grown on demand.
        self.workspace = torch.empty(
            2, 0, block_size * shape.kv_heads * shape.head_dim, dtype=dtype, device=device
        )
        # Per layer row, K and V viewed by slot and by block, made once: a view per call costs as much as the
        # copy of a decode step's token
        codes = self.kv.view(torch.uint8) if self.format.quantized else self.kv
        self._by_slot = [
            [codes[row, i].view(-1, *self.kv.shape[4:]) for i in (0, 1)] for row in range(shape.num_layers)
        ]
        self._by_block = [
            [codes[row, i].view(num_blocks, -1) for i in (0, 1)] for row in range(shape.num_layers)
        ]

    @staticmethod
    def bytes_per_token(shape: KVShape, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one token slot: every layer row, K and V, each head's codes plus scale when quantized."""
        per_head = pool_format(kv_cache_dtype).bytes_per_head_token(shape.head_dim, dtype)
        return shape.num_layers * 2 * shape.kv_heads * per_head

    @property
    def block_bytes(self) -> int:
        """Bytes one block of K (or of V) of one layer takes once gathered, in the model's dtype."""
        return self.workspace.shape[2] * self.workspace.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the pool itself, scales included (not the gather workspace, which is activation memory)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the pool holds: `kv`, and `scales` when quantized."""
        return [self.kv] if self.scales is None else [self.kv, self.scales]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of one layer, each `(num_blocks, block_size, kv_heads, head_dim)` (codes when quantized)."""
        row = self.shape.row(layer_idx)
        return self.kv[row, 0], self.kv[row, 1]

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `(tokens, kv_heads, head_dim)` K and V at flat slot indices `block * block_size + offset`."""
        row = self.shape.row(layer_idx)
        for i, x in enumerate((key, value)):
            flat = self._by_slot[row][i]
            if self.scales is None:
                flat.index_copy_(0, slots, x if x.dtype == flat.dtype else x.to(flat.dtype))
                continue
            assert self.format.quantize is not None
            codes, scale = self.format.quantize(x)
            # index_copy_ has no float8 kernel on CPU: the codes are copied as bytes
            flat.index_copy_(0, slots, codes.view(torch.uint8))
            self.scales[row, i].view(-1, self.shape.kv_heads).index_copy_(0, slots, scale[..., 0])

    def read_tokens(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of K and V of token positions `start..end-1` of a sequence with this block table, as
        `(layers, 2, end - start, kv_heads, head_dim)` in the pool's dtype: what a prefill instance sends."""
        self._check_plain("read tokens out of")
        slots = torch.tensor(slots_for(block_table, start, end, self.block_size), device=self.kv.device)
        flat = self.kv.view(*self.kv.shape[:2], -1, *self.kv.shape[4:])
        return flat.index_select(2, slots)

    def write_tokens(self, block_table: list[int], start: int, kv: torch.Tensor) -> None:
        """Store `(layers, 2, tokens, kv_heads, head_dim)` K and V at positions `start..` of a sequence with this
        block table (the inverse of `read_tokens`): what a decode instance does with what it receives."""
        self._check_plain("write tokens into")
        expected = (self.kv.shape[0], 2, kv.shape[2], *self.kv.shape[4:])
        if tuple(kv.shape) != expected or kv.dtype != self.kv.dtype:
            raise ValueError(
                f"K/V {tuple(kv.shape)} {kv.dtype} does not fit this pool's {expected} {self.kv.dtype}"
            )
        slots = slots_for(block_table, start, start + kv.shape[2], self.block_size)
        flat = self.kv.view(*self.kv.shape[:2], -1, *self.kv.shape[4:])
        flat.index_copy_(2, torch.tensor(slots, device=self.kv.device), kv.to(self.kv.device))

    def _check_plain(self, what: str) -> None:
        if self.format.quantized or self.shape.layer_rows is not None:
            raise ValueError(
                f"only a pool of one KV-cache group stored in the model's dtype can {what} (kv_cache_dtype 'auto')"
            )

    def gather(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks as `(len(block_ids), block_size, kv_heads, head_dim)` each, in the model's dtype.

        They are views of the workspace, valid until the next gather (`load`).
        """
        self.load(layer_idx, block_ids)
        n = block_ids.numel()
        return self.workspace[0, :n].view(n, *self.kv.shape[3:]), self.workspace[1, :n].view(
            n, *self.kv.shape[3:]
        )

    def load(self, layer_idx: int, block_ids: torch.Tensor) -> None:
        """Copy K and V of these blocks into the first rows of `workspace`, in the model's dtype.

        One `index_select` per pool (a memcpy per block), into memory that is already mapped, instead of a new
        allocation in every layer of every step. A quantized pool's codes and scales are selected the same way, then
        dequantized into the workspace.
        """
        n = block_ids.numel()
        if self.workspace.shape[1] < n:
            self.workspace = self.workspace.new_empty(
                2, max(n, 2 * self.workspace.shape[1]), self.workspace.shape[2]
            )
        row = self.shape.row(layer_idx)
        for i, pool in enumerate(self._by_block[row]):
            rows = self.workspace[i, :n]
            if self.scales is None:
                torch.index_select(pool, 0, block_ids, out=rows)
                continue
            codes = torch.index_select(pool, 0, block_ids)
            scales = torch.index_select(self.scales[row, i].view(self.num_blocks, -1), 0, block_ids)
            rows.copy_(codes.view(self.kv.dtype))
            rows.view(n, -1, self.shape.head_dim).mul_(scales.view(n, -1, 1))


def slots_for(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat pool slots of token positions `start..end-1` of a request with this block table."""
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]
