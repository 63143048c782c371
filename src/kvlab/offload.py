"""Memory tiers beyond GPU memory: what each tier delivers, a decode loop that streams KV from one, and reload vs recompute.

Three parts, one per question the chapter *Beyond HBM* (book/12_beyond_hbm) asks.

**Bandwidth of each tier, measured** (`measure_tiers`). GPU memory (a device-to-device copy), the host link in
both directions from pinned and from pageable host memory (GPU only), a RAM copy, and reads from local disk.
Every figure is payload bytes over seconds, best of `repeat`, with every sample kept so that a lab can derive its
tolerance from the spread. The disk is read with `O_DIRECT` into page-aligned (`mmap`-allocated) buffers, so the
page cache cannot answer from RAM; where the filesystem refuses `O_DIRECT` (tmpfs), the file's pages are dropped
with `posix_fadvise(DONTNEED)` first and the method says so. A buffered re-read of the same file is measured too:
it is what the page cache makes a disk look like, and why a naive benchmark overstates it. Scratch files live in
a private temporary directory and are removed even when a measurement fails.

**Offloaded KV decode** (`OffloadedCache`). A transformers `Cache` whose chosen layers keep their K/V on a slower
tier and stream the whole layer in at every step: `"host"` (pinned CPU memory, read over the host link; needs a
GPU) or `"disk"` (a file per layer, written and read with `O_DIRECT` in whole aligned blocks; the newest,
not yet full block stays in RAM, as block-based offload engines keep a partial block resident; the reads are
polled, `PolledReader`). The other layers are ordinary transformers layers. The copies are synchronous: nothing
overlaps the transfer with compute, so the cost model is the compute-only step plus the offloaded bytes over the
tier's bandwidth (`offload_cost`, `fit_offload`). `time_offload` measures the offloaded loop in lockstep with an
in-memory one (`memory_reference`) and, after every step, repeats alone the two things in which they differ: the
in-memory layers' appends to the histories of the layers that are offloaded (`SyncedLayer.reappend`; an
offloaded layer does not concatenate, and counting that copy in the compute term as well made the prediction
3-6 % high), and the offloaded layers' tier work (`OffloadedCache.reread`): the bandwidth the tier delivers with
the loop's own requests, under the same load, the first copy out of the delivered bytes included. The band is a
test of equal medians from distribution-free intervals (`median_interval`), so that it holds at its designed rate
on any device; `measure_offload` and `check_offload` are one measurement and its `kvlab.claims` checks. On a CPU,
steps are timed in thread CPU time (`step_clock`). transformers' own `DynamicCache(offloading=True)` (GPU only)
prefetches the next layer on a side stream and overlaps; the lab compares against it where a GPU is present.

**Recompute or reload** (`recompute_vs_reload`). Restoring a prompt's KV costs either its prefill FLOPs again or
its KV bytes over a link. Reloading wins when the prefill's FLOPs per KV byte exceed the FLOPs the GPU could do
while the link delivers one byte (`flops / link bytes per second`). GQA divides the KV bytes by the group size and
leaves the FLOPs alone, so it pushes a model towards reload; MHA models sit closer to the break-even.
`time_reload` times both on the machine at hand and `check_reload` asks whether the model picks the stopwatch's
winner.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import math
import mmap
import os
import platform
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicCache,
    DynamicLayer,
    get_layer_types_and_kwargs,
)

from kvlab import claims, hardware, roofline
from kvlab.env import pick_device
from kvlab.measure import time_call
from kvlab.sizing import DType, kv_cache_bytes

MiB = 2**20
GB = 10**9
ALIGN = 4096  # O_DIRECT wants offsets, sizes and buffer addresses aligned to the logical block size; 4 KiB covers it
MAX_SCRATCH_BYTES = 2 * 2**30  # the most any measurement here writes to disk

# ---------------------------------------------------------------------------------------------------------------
# Links and storage, from datasheets and standards


@dataclass(frozen=True)
class Link:
    """A path KV bytes can travel to the GPU, at its datasheet or standard rate (bytes/s, one direction)."""

    name: str
    bytes_per_s: float
    source: str
    short: str = ""  # a label for tables and figures

    @property
    def label(self) -> str:
        return self.short or self.name


LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link(
            "PCIe Gen4 x16",
            32 * GB,
            "PCI-SIG PCIe 4.0: 16 GT/s x16, ~31.5 GB/s per direction (kvlab.hardware)",
            "PCIe 4",
        ),
        Link(
            "PCIe Gen5 x16",
            64 * GB,
            "PCI-SIG PCIe 5.0: 32 GT/s x16, ~63 GB/s per direction (kvlab.hardware)",
            "PCIe 5",
        ),
        Link(
            "NVMe Gen4 (Samsung 990 PRO)",
            7.45 * GB,
            "Samsung 990 PRO datasheet: sequential read up to 7,450 MB/s "
            "(https://semiconductor.samsung.com/consumer-storage/internal-ssd/990-pro/)",
            "NVMe 4",
        ),
        Link(
            "NVMe Gen5 (Crucial T705)",
            14.5 * GB,
            "Crucial T705 2 TB product page: sequential read up to 14,500 MB/s "
            "(https://www.crucial.com/ssd/t705/ct2000t705ssd3)",
            "NVMe 5",
        ),
        Link("100 Gb Ethernet", 12.5 * GB, "IEEE 802.3ba: 100 Gb/s = 12.5 GB/s line rate", "100 GbE"),
        Link(
            "400 Gb InfiniBand NDR",
            50 * GB,
            "NVIDIA ConnectX-7 datasheet: 400 Gb/s NDR = 50 GB/s per port "
            "(https://www.nvidia.com/en-us/networking/ethernet/connectx-7/)",
            "IB NDR",
        ),
    ]
}


def link(name: str | Link) -> Link:
    """A `Link` by name (case-insensitive); an unknown name lists the known ones."""
    if isinstance(name, Link):
        return name
    for key, value in LINKS.items():
        if key.lower() == str(name).lower():
            return value
    raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}")


# ---------------------------------------------------------------------------------------------------------------
# Bandwidth of each tier


@dataclass(frozen=True)
class TierBandwidth:
    """One tier's measured bandwidth: payload bytes per second, every sample kept."""

    tier: str
    samples: tuple[float, ...]  # bytes/s of each repeat
    size_bytes: int
    method: str
    spec_bytes_per_s: float | None = None
    spec_source: str = ""
    latency_samples: tuple[
        float, ...
    ] = ()  # seconds of single 4 KiB transfers (disk reads, host-link copies)

    @property
    def latency_s(self) -> float:
        """Median seconds of one 4 KiB transfer (on disk, a read issued after a burst of compute): what every
        request pays before its bytes flow; 0 if unmeasured."""
        return median(self.latency_samples) if self.latency_samples else 0.0

    @property
    def bytes_per_s(self) -> float:
        """The best sample: the ceiling, as STREAM reports it."""
        return max(self.samples)

    @property
    def median_bytes_per_s(self) -> float:
        return median(self.samples)

    @property
    def spread(self) -> float:
        """(best - worst) / median of the samples: how much this figure moved between repeats."""
        return (max(self.samples) - min(self.samples)) / self.median_bytes_per_s

    @property
    def fraction_of_spec(self) -> float | None:
        return None if self.spec_bytes_per_s is None else self.bytes_per_s / self.spec_bytes_per_s


def _check_size(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_repeat(repeat: Any) -> int:
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive integer, got {repeat!r}")
    return repeat


def _timed(fn: Callable[[], Any], sync: Callable[[], None], repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _nothing() -> None:
    return None


def ram_copy(size_bytes: int = 64 * MiB, repeat: int = 5) -> TierBandwidth:
    """A host-memory copy of `size_bytes` (read once, written once): payload bytes per second."""
    _check_size("size_bytes", size_bytes, MiB)
    _check_repeat(repeat)
    src = torch.ones(size_bytes // 4, dtype=torch.float32)  # ones, not empty: every page touched
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), _nothing, repeat)
    return TierBandwidth("RAM copy", tuple(src.nbytes / t for t in times), src.nbytes, "torch copy_ on CPU")


def _cuda_sync(device: torch.device) -> Callable[[], None]:
    return lambda: torch.cuda.synchronize(device)


def _require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device, got {device}")


def _spec_for(device: torch.device) -> hardware.Accelerator | None:
    """The spec-table entry for this GPU, if any: its family in the name ('NVIDIA H200' -> H200), and among
    several of a family the variant named too ('H100 PCIe' -> H100-PCIe, 'A100-SXM4-80GB' -> A100-80GB), else the
    first listed (H100 -> H100-SXM)."""
    if device.type != "cuda":
        return None
    return _match_spec(torch.cuda.get_device_name(device))


def _match_spec(device_name: str) -> hardware.Accelerator | None:
    name = device_name.upper().replace(" ", "-")
    family = [spec for key, spec in hardware.SPECS.items() if key.upper().split("-")[0] in name.split("-")]
    variant = [spec for spec in family if "-" in spec.name and spec.name.upper().split("-", 1)[1] in name]
    matches = variant or family
    return matches[0] if matches else None


def gpu_copy(
    device: str | torch.device | None = None, size_bytes: int = 256 * MiB, repeat: int = 5
) -> TierBandwidth:
    """A device-to-device copy on the GPU; reported as bytes read + written per second, the datasheet's convention."""
    device = pick_device(device)
    _require_cuda(device, "gpu_copy")
    _check_size("size_bytes", size_bytes, MiB)
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), _cuda_sync(device), repeat)
    spec = _spec_for(device)
    return TierBandwidth(
        "GPU memory (copy, read + write)",
        tuple(2 * src.nbytes / t for t in times),
        src.nbytes,
        "torch copy_ on the GPU, 2 × bytes",
        spec.bandwidth_bytes_per_s if spec else None,
        f"{spec.name} datasheet ({spec.source})" if spec else "",
    )


def host_link(
    device: str | torch.device | None = None,
    size_bytes: int = 64 * MiB,
    repeat: int = 5,
    pinned: bool = True,
    to_device: bool = True,
) -> TierBandwidth:
    """Host-to-device (or device-to-host) copy of `size_bytes`, from pinned or pageable host memory."""
    device = pick_device(device)
    _require_cuda(device, "host_link")
    _check_size("size_bytes", size_bytes, MiB)
    host = torch.ones(size_bytes // 4, dtype=torch.float32, pin_memory=pinned)
    gpu = torch.ones_like(host, device=device)
    if to_device:
        times = _timed(lambda: gpu.copy_(host, non_blocking=pinned), _cuda_sync(device), repeat)
    else:
        times = _timed(lambda: host.copy_(gpu, non_blocking=pinned), _cuda_sync(device), repeat)
    # Latency: one small synchronous copy, as a cache layer makes one per tensor per step.
    small_host, small_gpu = host[: ALIGN // 4], gpu[: ALIGN // 4]
    if to_device:
        latencies = _timed(lambda: small_gpu.copy_(small_host), _cuda_sync(device), 16)
    else:
        latencies = _timed(lambda: small_host.copy_(small_gpu), _cuda_sync(device), 16)
    spec = _spec_for(device)
    arrow = "host → device" if to_device else "device → host"
    return TierBandwidth(
        f"{arrow}, {'pinned' if pinned else 'pageable'}",
        tuple(host.nbytes / t for t in times),
        host.nbytes,
        "torch copy_ between CPU and GPU",
        spec.host_link_bytes_per_s if spec else None,
        f"{spec.name}: PCIe per direction ({spec.source})" if spec else "",
        tuple(latencies),
    )


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory of `nbytes` rounded up to `ALIGN`: page-aligned, as O_DIRECT requires."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN))


class _IOCB(ctypes.Structure):
    """Linux's `struct iocb` (linux/aio_abi.h, little-endian field order)."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _IOEvent(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}  # setup, destroy, getevents, submit


class PolledReader:
    """Reads with Linux native AIO, completion polled rather than waited for, where the kernel offers it.

    A synchronous read puts the thread to sleep until the drive answers; on a loaded machine the thread then
    waits for a CPU, often a whole scheduler time slice (milliseconds), which swamps a read of a few MiB and
    varies with the load. Submitting the read and spinning on its completion keeps the thread running, so a read
    costs the drive's time, as for engines that poll for completions (SPDK, io_uring's polled mode). Falls back
    to a plain `preadv` where native AIO is unavailable (`polled` is then False).
    """

    def __init__(self) -> None:
        self._ctx = ctypes.c_ulong(0)
        calls = _AIO_SYSCALLS.get(platform.machine())
        self._calls = calls or (-1, -1, -1, -1)
        self._libc: Any = None
        self.polled = False
        if calls is not None and os.name == "posix":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall.restype = ctypes.c_long
                if libc.syscall(self._calls[0], 1, ctypes.byref(self._ctx)) == 0:
                    self._libc, self.polled = libc, True
            except (OSError, AttributeError):
                pass

    def read(self, fd: int, view: memoryview, offset: int) -> int:
        """Read len(view) bytes at `offset` into `view` (a writable, aligned buffer); the bytes read."""
        if not self.polled:
            return os.preadv(fd, [view], offset)
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        iocb = _IOCB(opcode=0, fildes=fd, buf=address, nbytes=len(view), offset=offset)  # IOCB_CMD_PREAD
        batch = (ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(iocb))
        if self._libc.syscall(self._calls[3], self._ctx, 1, batch) != 1:
            errno = ctypes.get_errno()
            raise OSError(errno, f"io_submit failed: {os.strerror(errno)}")
        event, now = _IOEvent(), _Timespec(0, 0)
        while True:
            got = self._libc.syscall(self._calls[2], self._ctx, 0, 1, ctypes.byref(event), ctypes.byref(now))
            if got == 1:
                break
            if got < 0 and ctypes.get_errno() != errno_module.EINTR:
                errno = ctypes.get_errno()
                raise OSError(errno, f"io_getevents failed: {os.strerror(errno)}")
        if event.res < 0:
            raise OSError(-event.res, os.strerror(-event.res))
        return int(event.res)

    def close(self) -> None:
        if self.polled:
            self._libc.syscall(self._calls[1], self._ctx)
            self.polled = False


def _direct_flag() -> int:
    return getattr(os, "O_DIRECT", 0)


def _open_direct(path: str | os.PathLike[str], flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the filesystem allows it; else plainly. Returns (fd, direct)."""
    if _direct_flag():
        try:
            return os.open(path, flags | _direct_flag()), True
        except OSError:
            pass
    return os.open(path, flags), False


def _drop_page_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@contextmanager
def scratch_dir(directory: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A private temporary directory under `directory` (default: the system temp dir), removed on exit."""
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    if not base.is_dir():
        raise ValueError(f"directory {str(base)!r} does not exist")
    path = Path(tempfile.mkdtemp(prefix="kvlab-offload-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _check_room(directory: Path, nbytes: int) -> None:
    if nbytes > MAX_SCRATCH_BYTES:
        raise ValueError(f"refusing to write {nbytes:,} bytes; the limit is {MAX_SCRATCH_BYTES:,}")
    free = shutil.disk_usage(directory).free
    if free < 2 * nbytes:
        raise ValueError(f"{directory} has {free:,} bytes free; writing {nbytes:,} needs twice that")


def _write_file(path: Path, nbytes: int, chunk_bytes: int) -> None:
    # Random bytes, so no compressing or deduplicating layer can shortcut the write or the read.
    block = os.urandom(min(chunk_bytes, nbytes))
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            n = min(len(block), nbytes - written)
            f.write(block[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())


def _read_file(fd: int, buf: mmap.mmap) -> int:
    total, offset = 0, 0
    while True:
        n = os.preadv(fd, [buf], offset)
        total += n
        offset += n
        if n < len(buf):
            return total


def disk_read(
    size_bytes: int = 256 * MiB,
    directory: str | os.PathLike[str] | None = None,
    repeat: int = 3,
    chunk_bytes: int = 4 * MiB,
    buffered: bool = False,
) -> TierBandwidth:
    """Sequential read of a `size_bytes` file from local disk, bypassing the page cache (O_DIRECT).

    `buffered=True` reads the same file through the page cache after one warm-up read: the figure a naive
    benchmark reports. The file is written once, in a private temporary directory, and removed afterwards.
    """
    _check_size("size_bytes", size_bytes, MiB)
    _check_size("chunk_bytes", chunk_bytes, ALIGN)
    _check_repeat(repeat)
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}, got {chunk_bytes}")
    with scratch_dir(directory) as tmp:
        _check_room(tmp, size_bytes)
        path = tmp / "tier.bin"
        _write_file(path, size_bytes, chunk_bytes)
        buf = _aligned_buffer(chunk_bytes)
        try:
            if buffered:
                fd, direct = os.open(path, os.O_RDONLY), False
                method = "buffered read (page cache warm)"
            else:
                fd, direct = _open_direct(path, os.O_RDONLY)
                method = (
                    "O_DIRECT read" if direct else "read after posix_fadvise(DONTNEED) (no O_DIRECT here)"
                )
            try:
                samples = []
                # The first read warms the drive (and, when buffered, fills the page cache); it is not kept.
                for i in range(repeat + 1):
                    if not direct and not buffered:
                        _drop_page_cache(fd)
                    start = time.perf_counter()
                    got = _read_file(fd, buf)
                    seconds = time.perf_counter() - start
                    if got != size_bytes:
                        raise OSError(f"read {got} of {size_bytes} bytes from {path}")
                    if i:
                        samples.append(size_bytes / seconds)
                latencies = [] if buffered else _small_read_seconds(fd, size_bytes, direct)
            finally:
                os.close(fd)
        finally:
            buf.close()
    return TierBandwidth(
        "local disk, page cache" if buffered else "local disk",
        tuple(samples),
        size_bytes,
        f"{method}, {chunk_bytes // MiB} MiB chunks",
        None if buffered else LINKS["NVMe Gen4 (Samsung 990 PRO)"].bytes_per_s,
        "" if buffered else LINKS["NVMe Gen4 (Samsung 990 PRO)"].source,
        tuple(latencies),
    )


def _busy(seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
    """Keep this thread computing for `seconds` of `clock` (small matmuls), as a decode step does between its
    reads."""
    a = torch.ones(64, 64)
    end = clock() + seconds
    while clock() < end:
        a @ a


def _small_read_seconds(
    fd: int, size_bytes: int, direct: bool, count: int = 32, busy_s: float = 2e-3
) -> list[float]:
    """Seconds of `count` single 4 KiB reads spread over the file, each issued after `busy_s` of computing.

    A decode loop reads from disk between bursts of compute, not back to back. A read issued by a thread that
    has just been computing pays more than one in a tight loop: on a shared or virtualised machine the thread,
    or the virtual CPU, sleeps during the I/O and waits to be scheduled again (back-to-back 4 KiB reads took
    about 0.05 ms on the machine that built this book, reads after 2 ms of compute 1-3 ms).
    """
    buf = _aligned_buffer(ALIGN)
    try:
        stride = max(ALIGN, size_bytes // count // ALIGN * ALIGN)
        times = []
        for i in range(count):
            if not direct:
                _drop_page_cache(fd)
            _busy(busy_s)
            start = time.perf_counter()
            os.preadv(fd, [buf], i * stride % size_bytes)
            times.append(time.perf_counter() - start)
        return times
    finally:
        buf.close()


def measure_tiers(
    device: str | torch.device | None = None,
    size_bytes: int = 64 * MiB,
    disk_bytes: int = 256 * MiB,
    directory: str | os.PathLike[str] | None = None,
    repeat: int = 5,
) -> dict[str, TierBandwidth]:
    """Every tier this machine has, by name: GPU memory and the host link (GPU only), RAM, disk and page cache."""
    device = pick_device(device)
    tiers: list[TierBandwidth] = []
    if device.type == "cuda":
        tiers.append(gpu_copy(device, max(size_bytes, 256 * MiB), repeat))
        for pinned in (True, False):
            for to_device in (True, False):
                tiers.append(host_link(device, size_bytes, repeat, pinned=pinned, to_device=to_device))
    tiers.append(ram_copy(size_bytes, repeat))
    tiers.append(disk_read(disk_bytes, directory, repeat=max(2, repeat // 2)))
    tiers.append(disk_read(disk_bytes, directory, repeat=max(2, repeat // 2), buffered=True))
    return {t.tier: t for t in tiers}


# ---------------------------------------------------------------------------------------------------------------
# Cache layers that live on a slower tier


def _record_bytes(batch: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in one layer, for the whole batch."""
    return 2 * batch * heads * head_dim * dtype.itemsize


class _TierLayer(DynamicLayer):
    """A full-attention layer whose K/V live off the device; `update` returns them on the device, whole."""

    tier = ""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.bytes_streamed = 0  # bytes read back from the tier, summed over updates
        self._shape: tuple[int, int, int] = (0, 0, 0)  # batch, heads, head_dim
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
        return self.length * _record_bytes(batch, heads, head_dim, self._dtype) if self.is_initialized else 0

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


class HostLayer(_TierLayer):
    """K/V in pinned host memory, token-major; every update copies the new tokens out and the whole layer back in.

    Token-major storage, (tokens, 2, batch, heads, dim), keeps every prefix of the history one contiguous block of
    pinned memory, so each step is exactly two copies: the new tokens' K and V out, the layer's K and V in. The
    reordering to (batch, heads, tokens, dim) then runs on the device.
    """

    tier = "host"

    def __init__(self) -> None:
        super().__init__()
        self._host: torch.Tensor | None = None
        self._last_new: torch.Tensor | None = None  # the last update's new records, on the device
        self._scratch: torch.Tensor | None = None  # where `reread` copies them out to

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
        sync = _cuda_sync(self.device) if self.device.type == "cuda" else _nothing
        sync()
        start = clock()
        self._scratch.copy_(self._last_new)
        kv = self._host[: self.length].to(self.device).permute(1, 2, 3, 0, 4).contiguous()
        sync()
        seconds = clock() - start
        return kv.nbytes, seconds


class DiskLayer(_TierLayer):
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
        self.disk_tokens = 0  # tokens in full blocks on disk
        # (tokens, 2, batch, heads, dim) on CPU, fewer than block_tokens of them
        self._tail: torch.Tensor | None = None
        self._read_buf: mmap.mmap | None = None
        self._fd = -1
        self._reader: PolledReader | None = None
        self.direct = False
        self.bytes_read_from_disk = 0
        self._last_states: tuple[torch.Tensor, torch.Tensor] | None = None  # the last update's new K and V

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        record = _record_bytes(*self._shape, self._dtype)
        lcm = record * ALIGN // math.gcd(record, ALIGN)  # the smallest whole number of tokens that is aligned
        self.block_tokens = (lcm // record) * max(1, -(-self._min_block_bytes // lcm))
        self._fd, self.direct = _open_direct(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        self._reader = PolledReader()
        batch, heads, head_dim = self._shape
        self._tail = torch.empty(0, 2, batch, heads, head_dim, dtype=self._dtype)

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * _record_bytes(*self._shape, self._dtype)

    def _write_blocks(self, records: torch.Tensor) -> None:
        data = records.contiguous().view(torch.uint8).numpy().tobytes()
        buf = _aligned_buffer(len(data))
        try:
            buf[: len(data)] = data
            written = os.pwritev(
                self._fd, [memoryview(buf)[: len(data)]], self.disk_tokens * (len(data) // len(records))
            )
        finally:
            buf.close()
        if written != len(data):
            raise OSError(f"wrote {written} of {len(data)} bytes to {self.path}")
        if not self.direct:
            _drop_page_cache(self._fd)
        self.disk_tokens += len(records)

    def _read_records(self) -> torch.Tensor:
        """Every token's records, (tokens, 2, batch, heads, dim): the full blocks read from disk into aligned
        memory, the RAM block copied in after them (at most one block; no other copy)."""
        assert self._tail is not None
        record = _record_bytes(*self._shape, self._dtype)
        disk_bytes = self.disk_tokens * record
        nbytes = disk_bytes + len(self._tail) * record
        if self._read_buf is None or len(self._read_buf) < nbytes:
            if self._read_buf is not None:
                self._read_buf.close()
            self._read_buf = _aligned_buffer(2 * nbytes)
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
        new = torch.stack([key_states, value_states]).permute(3, 0, 1, 2, 4).to("cpu")  # (t, 2, b, h, d)
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
            return os.preadv(self._fd, [view], 0)
        return self._reader.read(self._fd, view, 0)

    def reread(self, clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
        """The last update's tier work again: the new token's records appended to the RAM block (into a copy),
        the full blocks read from disk into the loop's own read buffer, the RAM block appended, the records
        reordered for attention (the partial block is in RAM)."""
        if self._read_buf is None or self._last_states is None or not self.length:
            return 0, 0.0
        assert self._tail is not None
        counted = self.bytes_read_from_disk  # the decode loop's count; a repeated fetch is not part of it
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
            chosen = set(_check_layers(offload_layers, count))
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
        return sum(layer.stored_bytes() for layer in self.layers if isinstance(layer, _TierLayer))

    def bytes_streamed(self) -> int:
        """Bytes brought back from the tier so far, all updates of all offloaded layers."""
        return sum(layer.bytes_streamed for layer in self.layers if isinstance(layer, _TierLayer))

    def reread(
        self, compute_s: float = 0.0, clock: Callable[[], float] = time.perf_counter
    ) -> tuple[int, float]:
        """Every offloaded layer's tier accesses repeated as the last decode step made them: (bytes, seconds).

        Only the accesses are timed (`_TierLayer.reread`). Before each, `compute_s` seconds of computing (on the CPU) stand in for the
        layer's share of the decode step: a thread that has just been computing and then waits on a disk read
        is scheduled back later than one reading back to back, and the loop's reads always follow compute.
        """
        if isinstance(compute_s, bool) or not isinstance(compute_s, (int, float)) or compute_s < 0:
            raise ValueError(f"compute_s must be a non-negative number of seconds, got {compute_s!r}")
        total, seconds = 0, 0.0
        for layer in self.layers:
            if isinstance(layer, _TierLayer):
                if compute_s:
                    _busy(compute_s, clock)
                nbytes, s = layer.reread(clock)
                total += nbytes
                seconds += s
        return total, seconds


def _check_layers(layers: Iterable[int], count: int) -> list[int]:
    out = []
    for index in layers:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"offload layer {index!r} is not a layer index in 0..{count - 1}")
        out.append(index)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The decode loop and its cost model


@dataclass
class DecodeRun:
    tokens: list[list[int]]  # generated ids per sequence
    step_s: list[float]  # seconds of each decode step (not the prefill)
    prefill_s: float
    logits: torch.Tensor  # (batch, steps, vocab), the last position's logits at each step

    @property
    def median_step_s(self) -> float:
        return median(self.step_s)


def step_clock(device: torch.device) -> Callable[[], float]:
    """The clock decode steps are timed with: on a CPU running torch on one thread, this thread's CPU time
    (`time.thread_time`); otherwise the wall clock.

    On a shared CPU machine a step's wall time includes every moment another process held the core, which varies
    from step to step with the load; the thread's CPU time counts only the moments it ran. Disk reads are polled
    (`PolledReader`), so the thread runs, and is charged, while the drive works. That holds only while the calling
    thread does all the work (`torch.set_num_threads(1)`); with more threads the wall clock is used. On a GPU the
    host thread waits on the device, and the wall clock is the measure.
    """
    if device.type == "cuda" or torch.get_num_threads() > 1:
        return time.perf_counter
    return time.thread_time


@torch.inference_mode()
def decode(model: Any, input_ids: torch.Tensor, new_tokens: int, cache: Cache | None = None) -> DecodeRun:
    """Greedy decoding of `new_tokens` after a prefill of `input_ids`, one timed step at a time.

    `cache` defaults to `DynamicCache(config=model.config)` (everything in device memory); pass an
    `OffloadedCache` to stream some layers from a slower tier.
    """
    return decode_lockstep(model, input_ids, new_tokens, [cache])[0]


@torch.inference_mode()
def decode_lockstep(
    model: Any,
    input_ids: torch.Tensor,
    new_tokens: int,
    caches: list[Cache | None],
    after_step: Callable[[list[float]], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> list[DecodeRun]:
    """Greedy decoding of the same prompt with each of `caches`, their steps interleaved.

    Step i of every cache runs before step i + 1 of any, so a slow spell of the machine (another process, a
    frequency change) lands on all of them alike and their step times stay comparable. `None` stands for
    `DynamicCache(config=model.config)`. Each cache decodes from its own outputs. `after_step`, if given, runs
    after every round of steps, untimed, with that round's step seconds (one per cache).

    `clock` times the steps; by default `step_clock(model.device)`.
    """
    _check_size("new_tokens", new_tokens, 1)
    if not caches:
        raise ValueError("decode_lockstep needs at least one cache")
    device = model.device
    sync = _cuda_sync(device) if device.type == "cuda" else _nothing
    clock = clock or step_clock(device)
    ids = input_ids.to(device)
    states: list[dict[str, Any]] = []
    for cache in caches:
        cache = DynamicCache(config=model.config) if cache is None else cache
        start = clock()
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        sync()
        last = out.logits[:, -1]
        states.append(
            dict(cache=cache, prefill=clock() - start, logits=[last.float().cpu()],
                 tokens=[last.argmax(-1, keepdim=True)], steps=[])
        )  # fmt: skip
    for _ in range(new_tokens - 1):
        for state in states:
            start = clock()
            out = model(state["tokens"][-1], cache=state["cache"], use_cache=True)
            sync()
            state["steps"].append(clock() - start)
            state["logits"].append(out.logits[:, -1].float().cpu())
            state["tokens"].append(out.logits[:, -1].argmax(-1, keepdim=True))
        if after_step is not None:
            after_step([state["steps"][-1] for state in states])
    return [
        DecodeRun(
            torch.cat(state["tokens"], dim=1).tolist(),
            state["steps"],
            state["prefill"],
            torch.stack(state["logits"], dim=1),
        )
        for state in states
    ]


_HOPS = {"disk": "disk read", "ram": "reorder (RAM copy)", "h2d": "host → device"}


@dataclass(frozen=True)
class OffloadCost:
    """Predicted seconds a decode step adds by streaming offloaded layers: one term per hop."""

    bytes_per_step: int  # K/V bytes of the offloaded layers at this context
    disk_bytes_per_step: int  # of which read from disk (whole blocks)
    terms: dict[str, float] = field(default_factory=dict)  # hop -> seconds

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())


def offload_cost(
    config: PretrainedConfig,
    context: int,
    offloaded_layers: int,
    tier: str,
    bandwidths: dict[str, float],
    batch_size: int = 1,
    dtype: DType = "fp32",
    block_tokens: int | None = None,
    disk_latency_s: float = 0.0,
    link_latency_s: float = 0.0,
) -> OffloadCost:
    """Seconds per decode step that streaming `offloaded_layers` layers' K/V at `context` tokens adds.

    `bandwidths` maps each hop the bytes take to its measured bytes/s. `tier="disk"` needs `"disk"` (an O_DIRECT
    read; only whole blocks of `block_tokens` come from disk, the partial block is in RAM already), and on CPU
    `"ram"` (the one copy that reorders token-major records into (batch, heads, tokens, dim): a RAM copy's
    payload rate), on a GPU `"h2d"` (the upload from pageable memory; the reorder then runs on the GPU).
    `tier="host"` needs `"h2d"` (from pinned memory). Every hop given is charged; all full-attention layers are
    assumed the same size, as in the registry's models and the tiny ones. `disk_latency_s` is charged once per
    offloaded layer that has a block on disk (one read request each). `link_latency_s`, the latency of one small
    host-link copy, is charged twice per offloaded layer on the host tier (the new token's K and V copied out, the
    layer's K and V copied in, each one synchronous copy).
    """
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
    _check_size("context", context, 1)
    _check_size("offloaded_layers", offloaded_layers, 0)
    text = config.get_text_config(decoder=True)
    if offloaded_layers > text.num_hidden_layers:
        raise ValueError(f"offloaded_layers={offloaded_layers} exceeds the {text.num_hidden_layers} layers")
    for name, value in bandwidths.items():
        if name not in _HOPS:
            raise ValueError(f"unknown hop {name!r}; known: {', '.join(_HOPS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"bandwidth {name!r} must be a positive number of bytes/s, got {value!r}")
    required = "disk" if tier == "disk" else "h2d"
    if required not in bandwidths:
        raise ValueError(
            f"tier {tier!r} needs a {required!r} bandwidth; got {', '.join(bandwidths) or 'none'}"
        )
    if block_tokens is not None:
        _check_size("block_tokens", block_tokens, 1)
    for name, value in (("disk_latency_s", disk_latency_s), ("link_latency_s", link_latency_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
    per_layer = kv_cache_bytes(config, context, batch_size, dtype) // text.num_hidden_layers
    total = per_layer * offloaded_layers
    disk_tokens = context if block_tokens is None else context // block_tokens * block_tokens
    disk_bytes = total // context * disk_tokens if tier == "disk" else 0
    terms: dict[str, float] = {}
    for hop, rate in bandwidths.items():
        if hop == "disk" and tier == "disk":
            requests = offloaded_layers if disk_bytes else 0
            terms[_HOPS[hop]] = requests * disk_latency_s + disk_bytes / rate
        elif hop != "disk":
            terms[_HOPS[hop]] = total / rate
    if tier == "host" and link_latency_s:
        terms["copy latency"] = 2 * offloaded_layers * link_latency_s
    return OffloadCost(total, disk_bytes, terms)


def median_interval(values: Sequence[float], confidence: float = 0.99) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of the population `values` were drawn from.

    The k-th smallest and the k-th largest of n values bracket the median with probability
    1 - 2 P(Binomial(n, 1/2) <= k - 1), whatever the distribution (the sign test); k is the largest for which
    that is at least `confidence`. Needs enough values for any k to qualify (8 at 0.99)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    n = len(values)
    tail, k = 0.0, 0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n
        if 2 * tail > 1 - confidence:
            break
        k += 1
    if k == 0:
        raise ValueError(f"{n} values are too few for a {confidence:.0%} interval of their median")
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


class SyncedLayer(DynamicLayer):
    """An ordinary in-memory transformers layer that waits for the device where a tier layer does.

    A layer on the host tier or on disk starts its update by copying the new token's K and V to the host, a copy
    that waits for all the work queued on the GPU; the next layer's kernels then start on an idle device. In the
    in-memory reference the offloaded layers are these, so that its step drains the GPU at the same points and
    differs from the offloaded step only by what the layers do with their K/V. On a CPU there is nothing to wait
    for and this is a plain `DynamicLayer`. `reappend` times the last update's concatenation again.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._appended = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.device.type == "cuda":
            torch.cuda.synchronize(key_states.device)
        self._appended = key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def reappend(self, clock: Callable[[], float] = time.perf_counter) -> float:
        """Seconds of the copy the last update made, appending its new K and V to the history, made again."""
        if not self.is_initialized or not self._appended or self.keys is None or self.values is None:
            return 0.0
        device = self.keys.device
        sync = _cuda_sync(device) if device.type == "cuda" else _nothing
        n = self._appended
        sync()
        start = clock()
        torch.cat([self.keys[..., :-n, :], self.keys[..., -n:, :]], dim=-2)
        torch.cat([self.values[..., :-n, :], self.values[..., -n:, :]], dim=-2)
        sync()
        return clock() - start


def memory_reference(config: PretrainedConfig, offload_layers: Iterable[int]) -> DynamicCache:
    """The in-memory cache an offloaded one is compared with: `DynamicCache(config=config)`, its layers at
    `offload_layers` `SyncedLayer`s."""
    cache = DynamicCache(config=config)
    count = len(cache.layers)
    for index in _check_layers(offload_layers, count):
        cache.layers[index] = SyncedLayer()
    return cache


@dataclass
class OffloadTiming:
    """One context's offload measurement: the in-memory and offloaded loops in lockstep, and after every step, under
    the same load, the in-memory layers' appends (`SyncedLayer.reappend`) and the offloaded layers' tier work
    (`OffloadedCache.reread`) repeated alone."""

    context: int
    memory: DecodeRun  # the in-memory reference (`memory_reference`)
    offloaded: DecodeRun
    transfer_bytes: list[int]  # bytes each repeated transfer moved
    transfer_s: list[float]  # seconds each took
    append_s: list[float]  # seconds of the reference's appends to the offloaded layers' histories, repeated
    disk_bytes: int  # bytes of the offloaded layers on disk at the last step (tier "disk"; else 0)
    others: list[DecodeRun] = field(default_factory=list)  # further caches decoded in lockstep

    @property
    def compute_s(self) -> list[float]:
        """Each in-memory step less its appends to the offloaded layers: what both loops do alike."""
        return [m - a for m, a in zip(self.memory.step_s, self.append_s, strict=True)]

    @property
    def bandwidth(self) -> TierBandwidth:
        """The tier as the loop uses it: the loop's transfers, with its request sizes, between its steps."""
        samples = tuple(
            b / s for b, s in zip(self.transfer_bytes, self.transfer_s, strict=True) if b and s > 0
        )
        if not samples:
            raise ValueError(
                f"context {self.context}: nothing was transferred (no full block on the tier yet)"
            )
        return TierBandwidth(
            "tier, as the loop reads it",
            samples,
            max(self.transfer_bytes),
            "the offloaded layers re-read between decode steps, one request per layer",
        )


def time_offload(
    model: Any,
    input_ids: torch.Tensor,
    new_tokens: int,
    cache: OffloadedCache,
    others: Iterable[Cache | None] = (),
    compute_s: float | None = None,
) -> OffloadTiming:
    """Decode `input_ids` with the in-memory reference (`memory_reference`), `cache` and `others` in lockstep,
    and after each step repeat the reference's appends to the offloaded layers and `cache`'s tier work alone,
    timed (`SyncedLayer.reappend`, `OffloadedCache.reread`).

    `compute_s` is the computing done before each repeated transfer; by default, on a CPU, the in-memory step's
    median so far divided by the layer count (each offloaded layer's read follows its share of the step), on a
    GPU none (the host thread does not compute there; it waits on the device).
    """
    device = model.device
    clock = step_clock(device)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    memory = memory_reference(model.config, cache.offload_layers)
    synced = [layer for layer in memory.layers if isinstance(layer, SyncedLayer)]
    memory_steps: list[float] = []
    moved: list[int] = []
    seconds: list[float] = []
    appends: list[float] = []

    def repeat_transfers(step_s: list[float]) -> None:
        memory_steps.append(step_s[0])
        appends.append(sum(layer.reappend(clock) for layer in synced))
        burst = compute_s
        if burst is None:
            burst = 0.0 if device.type == "cuda" else median(memory_steps) / layers
        nbytes, s = cache.reread(burst, clock)
        moved.append(nbytes)
        seconds.append(s)

    runs = decode_lockstep(
        model, input_ids, new_tokens, [memory, cache, *others], after_step=repeat_transfers, clock=clock
    )
    disk_bytes = sum(
        layer.disk_tokens * _record_bytes(*layer._shape, layer._dtype)
        for layer in cache.layers
        if isinstance(layer, DiskLayer)
    )
    return OffloadTiming(input_ids.shape[1], runs[0], runs[1], moved, seconds, appends, disk_bytes, runs[2:])


@dataclass(frozen=True)
class OffloadFit:
    """Predicted against measured median offloaded step at one context, with the band the measurements' spread
    allows. No overlap: the loop transfers and computes one after the other, so predicted = compute + transfer."""

    context: int
    compute_s: float  # median in-memory step less its appends to the offloaded layers: the compute-only step
    cost: OffloadCost  # the transfer term, from the bandwidth of the loop's own transfers repeated between steps
    measured_s: float  # median offloaded step
    low_s: float
    high_s: float
    memory_s: float = 0.0  # median in-memory step, appends included
    confidence: float = 0.99
    overlap: bool = False

    @property
    def transfer_s(self) -> float:
        return self.cost.seconds

    @property
    def predicted_s(self) -> float:
        """compute + transfer with no overlap; max(compute, transfer) if the loop overlapped them perfectly."""
        if self.overlap:
            return max(self.compute_s, self.transfer_s)
        return self.compute_s + self.transfer_s

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s

    @property
    def band(self) -> tuple[float, float]:
        """The band's edges relative to the prediction: (low / predicted - 1, high / predicted - 1)."""
        return self.low_s / self.predicted_s - 1, self.high_s / self.predicted_s - 1

    @property
    def transfer_share(self) -> float:
        """The transfer term's share of the predicted step."""
        return self.transfer_s / self.predicted_s

    @property
    def holds(self) -> bool:
        return self.low_s <= self.measured_s <= self.high_s


def fit_offload(
    timing: OffloadTiming,
    config: PretrainedConfig,
    offloaded_layers: int,
    tier: str,
    batch_size: int = 1,
    dtype: DType = "fp32",
    block_tokens: int | None = None,
    confidence: float = 0.99,
) -> OffloadFit:
    """The cost model against one `time_offload` measurement.

    compute: the median in-memory step less the in-memory layers' appends to the histories of the layers that
    are offloaded (an offloaded layer does not concatenate; it reorders what the tier delivered, which the
    transfer term times). transfer: `offload_cost` at the loop's middle context over the median bandwidth of the
    repeated tier work (the loop's request sizes, so per-request latency is in that figure). No overlap is
    modelled, because the loop has none.

    The band is a test of equal medians, with no allowance a machine or device would have to justify: the
    measured median's distribution-free `confidence` interval (`median_interval`) and the prediction's (from the
    per-step predictions, each step's compute plus the transfer repeated right after it, same load) must
    overlap. Placed around the prediction: the measured median must lie within the prediction's interval widened
    by the measured median's, below by (its upper edge - median), above by (median - its lower edge). Where the
    model is right, the two intervals miss each other less often than either misses its own median.
    """
    steps = len(timing.offloaded.step_s)
    if steps < 8:
        raise ValueError(f"fit_offload needs at least 8 decode steps, got {steps}")
    context = timing.context + steps // 2 + 1  # the history grows by one token per step: the middle step's
    hop = "disk" if tier == "disk" else "h2d"
    cost = offload_cost(
        config, context, offloaded_layers, tier, {hop: timing.bandwidth.median_bytes_per_s},
        batch_size=batch_size, dtype=dtype, block_tokens=block_tokens,
    )  # fmt: skip
    compute = median(timing.compute_s)
    predicted = compute + cost.seconds
    per_step = [c + t for c, t in zip(timing.compute_s, timing.transfer_s, strict=True)]
    p_low, p_high = median_interval(per_step, confidence)
    centre = median(per_step)
    measured = timing.offloaded.median_step_s
    m_low, m_high = median_interval(timing.offloaded.step_s, confidence)
    low = predicted - (centre - p_low) - (m_high - measured)
    high = predicted + (p_high - centre) + (measured - m_low)
    return OffloadFit(
        timing.context, compute, cost, measured, low, high, timing.memory.median_step_s, confidence
    )


def random_prompt(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """`batch` prompts of `length` ids drawn from [2, vocab_size), seeded by `seed + length`: the same prompt
    at a given length in every run."""
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(2, vocab_size, (batch, length), generator=generator)


@dataclass(frozen=True)
class OffloadSweep:
    """One measurement of the offloaded decode loop at each context: the timings and the fits."""

    tier: str
    offloaded: tuple[int, ...]
    timings: dict[int, OffloadTiming]
    fits: dict[int, OffloadFit]

    @property
    def tokens(self) -> int:
        """Greedy tokens per loop, all contexts and sequences: every loop produced these same tokens."""
        return sum(len(seq) for t in self.timings.values() for seq in t.memory.tokens)


def measure_offload(
    model: Any,
    contexts: Sequence[int],
    offloaded: Sequence[int],
    tier: str,
    new_tokens: int,
    batch: int = 1,
    seed: int = 0,
    transformers_offloading: bool = False,
    make_cache: Callable[..., OffloadedCache] = OffloadedCache,
) -> OffloadSweep:
    """`time_offload` and `fit_offload` at every context, on `random_prompt`s: one measurement of the claim.

    With `transformers_offloading`, transformers' `DynamicCache(offloading=True)` decodes in lockstep too (GPU
    only). `make_cache(config, layers, tier=...)` builds the offloaded cache (a test can hand in a wrong one).
    The loops must produce the same greedy tokens: moving bytes changes no value, so a difference is a bug,
    not noise, and raises."""
    config = model.config
    vocab = config.get_text_config(decoder=True).vocab_size
    timings, fits = {}, {}
    for context in contexts:
        with make_cache(config, list(offloaded), tier=tier) as cache:
            others = [DynamicCache(config=config, offloading=True)] if transformers_offloading else []
            ids = random_prompt(vocab, batch, context, seed)
            timing = time_offload(model, ids, new_tokens, cache, others)
            layer = cache.layers[offloaded[0]]
            block_tokens = layer.block_tokens if isinstance(layer, DiskLayer) else None
        runs = [timing.offloaded, *timing.others]
        if any(run.tokens != timing.memory.tokens for run in runs):
            raise AssertionError(f"context {context}: a loop's tokens differ from the in-memory loop's")
        timings[context] = timing
        fits[context] = fit_offload(timing, config, len(offloaded), tier, batch, model.dtype, block_tokens)
    return OffloadSweep(tier, tuple(offloaded), timings, fits)


def check_offload(sweep: OffloadSweep, min_share: float = 0.2) -> list[claims.Check]:
    """The claim on one `measure_offload`: at the longest context the transfer is at least `min_share` of the
    step and the offloaded step is longer than the compute-only one; at every context where the transfer is that
    large, the measured median step is in the band around compute + transfer (`fit_offload`), and the band's lower
    edge is above the compute-only step, so that it tells a loop that pays for its transfers from one that does
    not (whose median step would be the compute-only step)."""
    fits = [sweep.fits[c] for c in sorted(sweep.fits)]
    last = fits[-1]
    checks = [
        claims.Check(
            f"{last.context} tokens: transfer at least {min_share:.0%} of the predicted step",
            last.transfer_share >= min_share,
            f"{last.transfer_share:.0%}",
        ),
        claims.less(
            f"{last.context} tokens: compute-only step shorter than the offloaded step (ms)",
            last.compute_s * 1e3,
            last.measured_s * 1e3,
        ),
    ]
    for f in fits:
        if f.transfer_share >= min_share:
            checks.append(
                claims.between(
                    f"{f.context} tokens: offloaded step (ms) in the band around compute + transfer",
                    f.measured_s * 1e3,
                    f.low_s * 1e3,
                    f.high_s * 1e3,
                )
            )
            checks.append(
                claims.less(
                    f"{f.context} tokens: band above the compute-only step (ms)",
                    f.compute_s * 1e3,
                    f.low_s * 1e3,
                )
            )
    return checks


# ---------------------------------------------------------------------------------------------------------------
# Recompute or reload


@dataclass(frozen=True)
class ReloadEstimate:
    """Restoring one prompt's KV: recomputing its prefill on `gpu`, or reading its KV over `link`."""

    model: str
    link: str
    prompt_len: int
    kv_bytes: int
    prefill_flops: float
    recompute_s: float  # roofline prefill time: max(FLOPs / FLOP/s, bytes / bandwidth)
    reload_s: float  # KV bytes / link bytes per second

    @property
    def flops_per_kv_byte(self) -> float:
        return self.prefill_flops / self.kv_bytes

    @property
    def speedup(self) -> float:
        """recompute / reload: above 1, reloading is faster."""
        return self.recompute_s / self.reload_s


def break_even_flops_per_byte(gpu: hardware.Ceilings | str, over: str | Link | float) -> float:
    """FLOPs the GPU does while `over` delivers one byte: reload wins for prompts above this many FLOPs per KV byte."""
    return _hw(gpu).flops / _link_rate(over)


def _hw(gpu: hardware.Ceilings | str) -> hardware.Ceilings:
    return hardware.get(gpu) if isinstance(gpu, str) else gpu


def _link_rate(over: str | Link | float) -> float:
    if isinstance(over, (int, float)) and not isinstance(over, bool):
        if not over > 0:
            raise ValueError(f"link bandwidth must be positive, got {over!r}")
        return float(over)
    return link(over).bytes_per_s  # type: ignore[arg-type]


def prefill_flops_per_kv_byte(
    config: PretrainedConfig | str, prompt_len: int, dtype: DType = None, kv_dtype: DType = None
) -> float:
    """Prefill FLOPs of a `prompt_len` prompt over the KV bytes it leaves in the cache (batch 1)."""
    step = roofline.prefill(config, hardware.get("H100-SXM"), 1, prompt_len, dtype, kv_dtype)
    return step.flops / step.kv_bytes


def recompute_vs_reload(
    config: PretrainedConfig | str,
    gpu: hardware.Ceilings | str,
    over: str | Link | float,
    prompt_len: int,
    dtype: DType = None,
    kv_dtype: DType = None,
) -> ReloadEstimate:
    """Time to restore a `prompt_len` prompt's KV by prefill (roofline on `gpu`) or by reading it over `over`."""
    hw = _hw(gpu)
    rate = _link_rate(over)
    step = roofline.prefill(config, hw, 1, prompt_len, dtype, kv_dtype)
    name = config if isinstance(config, str) else getattr(config, "_name_or_path", "") or config.model_type
    link_name = (
        over.name if isinstance(over, Link) else (str(over) if isinstance(over, str) else f"{rate:.3g} B/s")
    )
    return ReloadEstimate(
        model=name,
        link=link_name,
        prompt_len=prompt_len,
        kv_bytes=int(step.kv_bytes),
        prefill_flops=step.flops,
        recompute_s=step.time_s,
        reload_s=step.kv_bytes / rate,
    )


# ---------------------------------------------------------------------------------------------------------------
# Saving a prompt's KV to disk and reading it back


@dataclass(frozen=True)
class SavedKV:
    path: Path
    shapes: tuple[tuple[int, ...], ...]  # per layer: (batch, heads, tokens, dim)
    dtype: torch.dtype
    nbytes: int  # K and V payload bytes, all layers
    file_bytes: int  # on disk, each layer padded to ALIGN


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
    fd, direct = _open_direct(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    buf = _aligned_buffer(len(blob))
    try:
        buf[: len(blob)] = blob
        written = os.pwritev(fd, [memoryview(buf)[: len(blob)]], 0)
        os.fsync(fd)
        if not direct:
            _drop_page_cache(fd)
    finally:
        buf.close()
        os.close(fd)
    if written != len(blob):
        raise OSError(f"wrote {written} of {len(blob)} bytes to {target}")
    return SavedKV(target, tuple(shapes), dtype, payload, len(blob))


def load_kv(saved: SavedKV, device: str | torch.device | None = None) -> DynamicCache:
    """Read a `save_kv` file back (O_DIRECT) into a `DynamicCache` on `device`."""
    fd, direct = _open_direct(saved.path, os.O_RDONLY)
    buf = _aligned_buffer(saved.file_bytes)
    try:
        if not direct:
            _drop_page_cache(fd)
        got = os.preadv(fd, [buf], 0)
        if got != saved.file_bytes:
            raise OSError(f"read {got} of {saved.file_bytes} bytes from {saved.path}")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=saved.file_bytes).clone()
    finally:
        os.close(fd)
        buf.close()
    target = pick_device(device)
    data, offset = [], 0
    for shape in saved.shapes:
        n = 2 * math.prod(shape) * saved.dtype.itemsize
        kv = raw[offset : offset + n].view(saved.dtype).view(2, *shape).to(target)
        data.append((kv[0], kv[1]))
        offset += n + (-n % ALIGN)
    return DynamicCache(data)


# ---------------------------------------------------------------------------------------------------------------
# Recompute or reload, timed


@torch.inference_mode()
def prefill_cache(model: Any, input_ids: torch.Tensor) -> DynamicCache:
    """The prefill of `input_ids` (on the model's device), its K/V in a new `DynamicCache`, the device synced."""
    cache = DynamicCache(config=model.config)
    model(input_ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return cache


@dataclass(frozen=True)
class ReloadTiming:
    """One measurement of recompute against reload for one prompt: the best of `repeat` runs of each."""

    saved: SavedKV  # the saved cache (its file is removed after the measurement)
    recompute_s: float  # the prefill, again
    reload_s: float  # `load_kv` of the saved cache onto the device
    same_next_token: bool  # decoding on from the reloaded cache gives the recomputed cache's next token

    @property
    def speedup(self) -> float:
        """recompute / reload, measured: above 1, reloading was faster."""
        return self.recompute_s / self.reload_s


@torch.inference_mode()
def time_reload(
    model: Any,
    input_ids: torch.Tensor,
    repeat: int = 5,
    directory: str | os.PathLike[str] | None = None,
) -> ReloadTiming:
    """Save the prompt's cache with O_DIRECT (`save_kv`), then time, best of `repeat` after a warm-up
    (`kvlab.measure.time_call`), running its prefill again and reading the cache back onto the device."""
    _check_repeat(repeat)
    device = model.device
    with scratch_dir(directory) as tmp:
        saved = save_kv(prefill_cache(model, input_ids), tmp / "prompt.kv")
        recompute_s = min(time_call(lambda: prefill_cache(model, input_ids), device, repeat))
        reload_s = min(time_call(lambda: load_kv(saved, device), device, repeat))
        last = input_ids[:, -1:].to(device)
        reloaded = model(last, cache=load_kv(saved, device)).logits.argmax(-1)
        recomputed = model(last, cache=prefill_cache(model, input_ids)).logits.argmax(-1)
    return ReloadTiming(saved, recompute_s, reload_s, bool(torch.equal(reloaded, recomputed)))


def predicted_reload_speedup(estimate: ReloadEstimate, latency_s: float = 0.0) -> float:
    """recompute / reload as the model predicts it, the reload charged one request's `latency_s` besides its bytes
    over the link."""
    if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or latency_s < 0:
        raise ValueError(f"latency_s must be a non-negative number of seconds, got {latency_s!r}")
    return estimate.recompute_s / (estimate.reload_s + latency_s)


def check_reload(
    timing: ReloadTiming, estimate: ReloadEstimate, latency_s: float = 0.0
) -> list[claims.Check]:
    """The claim on one `time_reload`: the cost model (`recompute_vs_reload`, the reload charged `latency_s`)
    picks the same winner, recompute or reload, as the stopwatch."""
    predicted = predicted_reload_speedup(estimate, latency_s)
    return [
        claims.Check(
            "the model picks the same winner as the stopwatch",
            (predicted > 1) == (timing.speedup > 1),
            f"recompute / reload predicted {predicted:.2f}x, measured {timing.speedup:.2f}x",
        )
    ]
