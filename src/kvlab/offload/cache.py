"""Cache layers that keep their K/V on a slower tier and stream the whole layer in at every step.

`OffloadedCache` is a transformers `Cache` whose chosen layers live on `"host"` (pinned CPU memory, read over the
host link; needs a GPU: `HostLayer`) or `"disk"` (a file per layer, written and read with `O_DIRECT` in whole
aligned blocks; the newest, not yet full block stays in RAM, as block-based offload engines keep a partial block
resident; the reads are polled, `kvlab.offload.direct_io.PolledReader`: `DiskLayer`). The other layers are
ordinary transformers layers. The copies are synchronous: nothing overlaps the transfer with compute. Each tier
layer can repeat its last step's tier work without changing the cache (`reread`), so that a loop can time the
tier as it uses it (`kvlab.offload.loop.time_offload`). Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    get_layer_types_and_kwargs,
)

from kvlab.offload.direct_io import (
    ALIGN,
    PolledReader,
    aligned_buffer,
    drop_page_cache,
    open_direct,
    read_full,
    write_full,
)
from kvlab.offload.tiers import compute_for
from kvlab.units import cdiv


def _nothing() -> None:
    return None


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for `device` to finish its queued work: `torch.cuda.synchronize` on a GPU, nothing on a CPU.
    Built once, outside the timed region it is called in."""
    return partial(torch.cuda.synchronize, device) if device.type == "cuda" else _nothing


def record_bytes(batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in one layer, for the whole batch."""
    return 2 * batch * heads * head_dim * dtype.itemsize


class TierLayer(DynamicLayer):
    """A full-attention layer whose K/V live off the device; `update` returns them on the device, whole."""

    tier = ""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        # bytes read back from the tier, summed over updates
        self.bytes_streamed = 0
        # batch, heads, head_dim
        self._shape: tuple[int, int, int] = (0, 0, 0)
        self._dtype = torch.float32

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, head_dim = key_states.shape
        self._shape = (batch, heads, head_dim)
        self._dtype = key_states.dtype
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self.length

    def stored_bytes(self) -> int:
        """Bytes of K and V this layer holds on its tier."""
        batch, heads, head_dim = self._shape
        return self.length * record_bytes(batch, heads, head_dim, self._dtype) if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support changing the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support changing the batch")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support beam search")

    def reread(self, clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
        """Do again what the last `update` did with the tier, without changing the cache.

        Returns (bytes brought back, seconds): the new token's records sent to the tier, the layer brought back and
        reordered into the layout attention reads, with the same request size, buffer and file offsets as the
        decode loop's, so that timing it between decode steps measures the tier as the loop uses it, under the
        loop's own conditions. The reordering copy belongs here: it is the first to read the bytes the tier
        delivered, which arrive in memory, not in the CPU's caches. (What is not repeated: the new token written
        to the tier when it fills a block, once every `block_tokens` steps, which a median step does not see.)"""
        raise NotImplementedError


class HostLayer(TierLayer):
    """K/V in pinned host memory, token-major; every update copies the new tokens out and the whole layer back in.

    Token-major storage, (tokens, 2, batch, heads, dim), keeps every prefix of the history one contiguous block of
    pinned memory, so each step is exactly two copies: the new tokens' K and V out, the layer's K and V in. The
    reordering to (batch, heads, tokens, dim) then runs on the device.
    """

    tier = "host"

    def __init__(self) -> None:
        super().__init__()
        self._host: torch.Tensor | None = None
        # the last update's new records, on the device
        self._last_new: torch.Tensor | None = None
        # where `reread` copies them out to
        self._scratch: torch.Tensor | None = None

    def _grow(self, needed: int) -> None:
        capacity = 0 if self._host is None else self._host.shape[0]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 64)
        host = torch.empty(
            new_capacity, 2, *self._shape, dtype=self._dtype, pin_memory=torch.cuda.is_available()
        )
        if self._host is not None:
            host[: self.length] = self._host[: self.length]
        self._host = host

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[2]
        self._grow(self.length + new)
        assert self._host is not None
        self._last_new = torch.stack([key_states, value_states]).permute(3, 0, 1, 2, 4)
        self._host[self.length : self.length + new].copy_(self._last_new)
        self.length += new
        kv = self._host[: self.length].to(self.device).permute(1, 2, 3, 0, 4).contiguous()
        self.bytes_streamed += kv.nbytes
        return kv[0], kv[1]

    def reread(self, clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
        if self._host is None or self._last_new is None or not self.length:
            return 0, 0.0
        if self._scratch is None or self._scratch.shape != self._last_new.shape:
            pinned = self._host.is_pinned()
            self._scratch = torch.empty(self._last_new.shape, dtype=self._dtype, pin_memory=pinned)
        sync = device_sync(self.device)
        sync()
        start = clock()
        self._scratch.copy_(self._last_new)
        kv = self._host[: self.length].to(self.device).permute(1, 2, 3, 0, 4).contiguous()
        sync()
        seconds = clock() - start
        return kv.nbytes, seconds


class DiskLayer(TierLayer):
    """K/V in a file on local disk, in whole aligned blocks written and read with O_DIRECT.

    Tokens are stored token-major (each token's K then V for the whole batch). Full blocks go to the file; the
    newest block, until it fills, stays in RAM. Every update reads every full block back (O_DIRECT, into
    page-aligned memory), appends the RAM block, and returns K and V reshaped to (batch, heads, tokens, dim) on
    the device.
    """

    tier = "disk"

    def __init__(self, path: str | os.PathLike[str], block_bytes: int = 64 * 1024) -> None:
        super().__init__()
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        self.path = Path(path)
        self._min_block_bytes = block_bytes
        self.block_tokens = 0
        # tokens in full blocks on disk
        self.disk_tokens = 0
        # (tokens, 2, batch, heads, dim) on CPU, fewer than block_tokens of them
        self._tail: torch.Tensor | None = None
        self._read_buf: mmap.mmap | None = None
        self._fd = -1
        self._reader: PolledReader | None = None
        self.direct = False
        self.bytes_read_from_disk = 0
        # the last update's new K and V
        self._last_states: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        record = record_bytes(*self._shape, self._dtype)
        # the smallest whole number of tokens that is aligned
        lcm = record * ALIGN // math.gcd(record, ALIGN)
        self.block_tokens = (lcm // record) * max(1, cdiv(self._min_block_bytes, lcm))
        self._fd, self.direct = open_direct(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self._reader = PolledReader()
        batch, heads, head_dim = self._shape
        self._tail = torch.empty(0, 2, batch, heads, head_dim, dtype=self._dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * record_bytes(*self._shape, self._dtype)

    @property
    def disk_bytes(self) -> int:
        """Bytes of K and V in full blocks on disk."""
        return self.disk_tokens * record_bytes(*self._shape, self._dtype)

    def _write_blocks(self, records: torch.Tensor) -> None:
        data = records.contiguous().view(torch.uint8).numpy().tobytes()
        buf = aligned_buffer(len(data))
        try:
            buf[: len(data)] = data
            written = write_full(
                self._fd, memoryview(buf)[: len(data)], self.disk_tokens * (len(data) // len(records))
            )
        finally:
            buf.close()
        if written != len(data):
            raise OSError(f"wrote {written} of {len(data)} bytes to {self.path}")
        if not self.direct:
            drop_page_cache(self._fd)
        self.disk_tokens += len(records)

    def _read_records(self) -> torch.Tensor:
        """Every token's records, (tokens, 2, batch, heads, dim): the full blocks read from disk into aligned
        memory, the RAM block copied in after them (at most one block; no other copy)."""
        assert self._tail is not None
        record = record_bytes(*self._shape, self._dtype)
        disk_bytes = self.disk_tokens * record
        nbytes = disk_bytes + len(self._tail) * record
        if self._read_buf is None or len(self._read_buf) < nbytes:
            if self._read_buf is not None:
                self._read_buf.close()
            self._read_buf = aligned_buffer(2 * nbytes)
        if disk_bytes:
            view = memoryview(self._read_buf)[:disk_bytes]
            got = self._read(view)
            view.release()
            if got != disk_bytes:
                raise OSError(f"read {got} of {disk_bytes} bytes from {self.path}")
            self.bytes_read_from_disk += disk_bytes
        raw = torch.frombuffer(self._read_buf, dtype=torch.uint8, count=nbytes)
        records = raw.view(self._dtype).view(self.disk_tokens + len(self._tail), 2, *self._shape)
        records[self.disk_tokens :] = self._tail
        return records

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._tail is not None
        self._last_states = (key_states, value_states)
        # (t, 2, b, h, d)
        new = torch.stack([key_states, value_states]).permute(3, 0, 1, 2, 4).to("cpu")
        tail = torch.cat([self._tail, new])
        full = len(tail) // self.block_tokens * self.block_tokens
        if full:
            self._write_blocks(tail[:full])
        self._tail = tail[full:].clone()
        self.length += key_states.shape[2]
        records = self._read_records()
        # One reordering copy, to (2, batch, heads, tokens, dim); on a GPU it runs there, after the upload.
        kv = records.to(self.device).permute(1, 2, 3, 0, 4).contiguous()
        del records
        self.bytes_streamed += kv.nbytes
        return kv[0], kv[1]

    def _read(self, view: memoryview) -> int:
        if self._reader is None:
            return read_full(self._fd, view, 0)
        return self._reader.read(self._fd, view, 0)

    def reread(self, clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
        """The last update's tier work again: the new token's records appended to the RAM block (into a copy),
        the full blocks read from disk into the loop's own read buffer, the RAM block appended, the records
        reordered for attention (the partial block is in RAM)."""
        if self._read_buf is None or self._last_states is None or not self.length:
            return 0, 0.0
        assert self._tail is not None
        # the decode loop's count; a repeated fetch is not part of it
        counted = self.bytes_read_from_disk
        keys, values = self._last_states
        start = clock()
        new = torch.stack([keys, values]).permute(3, 0, 1, 2, 4).to("cpu")
        torch.cat([self._tail, new]).clone()
        records = self._read_records()
        kv = records.to(self.device).permute(1, 2, 3, 0, 4).contiguous()
        seconds = clock() - start
        del records
        self.bytes_read_from_disk = counted
        return kv.nbytes, seconds

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._read_buf is not None:
            self._read_buf.close()
            self._read_buf = None


TIERS = ("host", "disk")


def _cleanup(layers: list[Any], directory: str | None) -> None:
    for layer in layers:
        if isinstance(layer, DiskLayer):
            layer.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class OffloadedCache(Cache):
    """A transformers `Cache` that keeps the K/V of `offload_layers` on `tier` and streams them in every step.

    `tier="host"` keeps them in pinned CPU memory (the model must run on a GPU); `tier="disk"` in one file per
    layer under a private temporary directory inside `directory`, removed by `close()` (also on garbage
    collection, and at the end of a `with` block). Layers not offloaded are the transformers layers
    `DynamicCache(config=...)` would build. Only full-attention layers can be offloaded.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        offload_layers: Iterable[int] | str = "all",
        tier: str = "disk",
        directory: str | os.PathLike[str] | None = None,
        block_bytes: int = 64 * 1024,
    ) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
        if tier == "host" and not torch.cuda.is_available():
            raise ValueError(
                "tier 'host' streams over the host link and needs a CUDA device; on CPU use 'disk'"
            )
        text = config.get_text_config(decoder=True)
        layer_types, kwargs = get_layer_types_and_kwargs(text)
        count = len(layer_types)
        if isinstance(offload_layers, str):
            if offload_layers != "all":
                raise ValueError(f"offload_layers must be 'all' or layer indices, got {offload_layers!r}")
            chosen = set(range(count))
        else:
            chosen = set(check_layers(offload_layers, count))
        for index in sorted(chosen):
            if layer_types[index] != "full_attention":
                raise ValueError(
                    f"layer {index} is {layer_types[index]!r}; only full_attention layers can be offloaded"
                )
        self.tier = tier
        self.offload_layers = sorted(chosen)
        self.directory: str | None = None
        if tier == "disk" and chosen:
            base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
            if not base.is_dir():
                raise ValueError(f"directory {str(base)!r} does not exist")
            self.directory = tempfile.mkdtemp(prefix="kvlab-kv-", dir=base)
        layers: list[Any] = []
        for index, (kind, kw) in enumerate(zip(layer_types, kwargs, strict=True)):
            if index not in chosen:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            elif tier == "host":
                layers.append(HostLayer())
            else:
                assert self.directory is not None
                layers.append(DiskLayer(Path(self.directory) / f"layer{index}.kv", block_bytes))
        super().__init__(layers=layers)
        self._finalizer = weakref.finalize(self, _cleanup, layers, self.directory)

    def close(self) -> None:
        """Close the layer files and remove the directory holding them."""
        self._finalizer()

    def __enter__(self) -> OffloadedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def offloaded_bytes(self) -> int:
        """Bytes of K/V held on the slower tier."""
        return sum(layer.stored_bytes() for layer in self.layers if isinstance(layer, TierLayer))

    def bytes_streamed(self) -> int:
        """Bytes brought back from the tier so far, all updates of all offloaded layers."""
        return sum(layer.bytes_streamed for layer in self.layers if isinstance(layer, TierLayer))

    def reread(
        self,
        compute_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        reads: Sequence[Sequence[torch.Tensor]] = (),
    ) -> tuple[int, float]:
        """Every offloaded layer's tier accesses repeated as the last decode step made them: (bytes, seconds).

        Only the accesses are timed (`TierLayer.reread`). Before each, `compute_s` seconds of computing (on the
        CPU) stand in for the layer's share of the decode step: a thread that has just been computing and then
        waits on a disk read is scheduled back later than one reading back to back, and the loop's reads always
        follow compute. `reads[i]` is what the computing before the i-th offloaded layer's access reads
        (`kvlab.offload.tiers.compute_for`): the weights of the decoder layer before it, which the step reads
        there, so that each access finds the CPU's caches as full of other data as in the step.
        """
        if reads and len(reads) != len(self.offload_layers):
            raise ValueError(
                f"reads has {len(reads)} entries for {len(self.offload_layers)} offloaded layers"
            )
        if isinstance(compute_s, bool) or not isinstance(compute_s, (int, float)) or compute_s < 0:
            raise ValueError(f"compute_s must be a non-negative number of seconds, got {compute_s!r}")
        total, seconds = 0, 0.0
        tier_layers = [layer for layer in self.layers if isinstance(layer, TierLayer)]
        for i, layer in enumerate(tier_layers):
            if compute_s:
                compute_for(compute_s, clock, reads[i] if reads else ())
            nbytes, s = layer.reread(clock)
            total += nbytes
            seconds += s
        return total, seconds


def check_layers(layers: Iterable[int], count: int) -> list[int]:
    out = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"offload layer {index!r} is not a layer index in 0..{count - 1}")
        out.append(index)
    return out
