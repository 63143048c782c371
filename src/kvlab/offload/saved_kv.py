"""A prompt's KV saved to one file on disk and read back, past the page cache (`O_DIRECT`).

Each layer's K and V go to an aligned offset (`kvlab.offload.direct_io.ALIGN`), so the whole file is written and
read in aligned requests, one per GiB (`direct_io.CHUNK`: Linux moves at most 2 GiB - 4 KiB per call);
`load_kv` builds a `DynamicCache` that decodes on exactly as the saved one.
Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicCache

from kvlab.env import pick_device
from kvlab.offload.direct_io import ALIGN, aligned_buffer, drop_page_cache, open_direct, read_full, write_full


@dataclass(frozen=True)
class SavedKV:
    path: Path
    # per layer: (batch, heads, tokens, dim)
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    # K and V payload bytes, all layers
    nbytes: int
    # on disk, each layer padded to ALIGN
    file_bytes: int


def save_kv(cache: Cache, path: str | os.PathLike[str]) -> SavedKV:
    """Write every layer's K and V to one file, each layer padded to an aligned offset, with O_DIRECT."""
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.numel() == 0:
            raise ValueError("save_kv needs a cache whose every layer holds K/V (run a prefill first)")
        layers.append((keys, values))
    if not layers:
        raise ValueError("save_kv needs a cache whose every layer holds K/V (run a prefill first)")
    dtype = layers[0][0].dtype
    chunks, shapes, payload = [], [], 0
    for keys, values in layers:
        data = torch.stack([keys, values]).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        payload += len(data)
        chunks.append(data + bytes(-len(data) % ALIGN))
        shapes.append(tuple(keys.shape))
    blob = b"".join(chunks)
    target = Path(path)
    fd, direct = open_direct(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    buf = aligned_buffer(len(blob))
    try:
        buf[: len(blob)] = blob
        written = write_full(fd, memoryview(buf)[: len(blob)], 0)
        os.fsync(fd)
        if not direct:
            drop_page_cache(fd)
    finally:
        buf.close()
        os.close(fd)
    if written != len(blob):
        raise OSError(f"wrote {written} of {len(blob)} bytes to {target}")
    return SavedKV(target, tuple(shapes), dtype, payload, len(blob))


def staging_buffer(saved: SavedKV) -> mmap.mmap:
    """An aligned host buffer for `saved`'s file, every page touched: what an engine allocates once and reads
    every reload into (`load_kv(..., staging=)`). A buffer mapped afresh for each reload faults each 4 KiB page
    in as the read fills it, a cost the drive's bandwidth does not show."""
    buf = aligned_buffer(saved.file_bytes)
    view = memoryview(buf)
    try:
        view[:] = bytes(len(buf))
    finally:
        view.release()
    return buf


def read_saved(saved: SavedKV, buffer: mmap.mmap) -> None:
    """Read `saved`'s whole file into `buffer` (at least `file_bytes` long) with O_DIRECT, in aligned requests."""
    if len(buffer) < saved.file_bytes:
        raise ValueError(f"the buffer holds {len(buffer):,} bytes; {saved.path} has {saved.file_bytes:,}")
    fd, direct = open_direct(saved.path, os.O_RDONLY)
    try:
        if not direct:
            drop_page_cache(fd)
        got = read_full(fd, memoryview(buffer)[: saved.file_bytes], 0)
    finally:
        os.close(fd)
    if got != saved.file_bytes:
        raise OSError(f"read {got} of {saved.file_bytes} bytes from {saved.path}")


def _cache_from(saved: SavedKV, buffer: mmap.mmap, device: torch.device) -> DynamicCache:
    """The cache `buffer` holds, copied once into tensors of its own on `device` (DynamicCache concatenates what
    it is given into new tensors)."""
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=saved.file_bytes)
    data, offset = [], 0
    for shape in saved.shapes:
        n = 2 * math.prod(shape) * saved.dtype.itemsize
        kv = raw[offset : offset + n].view(saved.dtype).view(2, *shape).to(device)
        data.append((kv[0], kv[1]))
        offset += n + (-n % ALIGN)
    return DynamicCache(data)


def load_kv(
    saved: SavedKV, device: str | torch.device | None = None, staging: mmap.mmap | None = None
) -> DynamicCache:
    """Read a `save_kv` file back (O_DIRECT) into a `DynamicCache` on `device`: one read and one copy.

    `staging` (`staging_buffer`) is read into and kept, as an engine keeps its host buffer; without it a buffer
    is mapped for this call alone, and its page faults are part of the reload."""
    target = pick_device(device)
    buffer = staging if staging is not None else aligned_buffer(saved.file_bytes)
    try:
        read_saved(saved, buffer)
        return _cache_from(saved, buffer, target)
    finally:
        if staging is None:
            buffer.close()
