"""Memory tiers beyond GPU memory: the links KV bytes travel over, from datasheets, and what each tier delivers here.

`LINKS` holds each offload path's datasheet or standard rate (PCIe from `kvlab.specs.hardware`'s table, NVMe drives,
networks); `CLUSTER_LINKS` holds the fabrics between GPUs and nodes (NVLink, InfiniBand XDR, RoCE); `link` finds one
by name. `measure_tiers` measures every tier this machine has: GPU memory (a device-to-device
copy) and the host link in both directions from pinned and from pageable host memory (GPU only; both measured by
`kvlab.specs.hardware`'s probes), a RAM copy, and reads from local disk. Every figure is payload bytes over seconds,
best of `repeat`, with every sample kept so that a lab can derive its tolerance from the spread
(`TierBandwidth`). The disk is read with `O_DIRECT` into page-aligned buffers (`kvlab.offload.direct_io`), so
the page cache cannot answer from RAM; where the filesystem refuses `O_DIRECT` (tmpfs), the file's pages are
dropped with `posix_fadvise(DONTNEED)` first and the method says so. A buffered re-read of the same file is
measured too: it is what the page cache makes a disk look like, and why a naive benchmark overstates it. Scratch
files live in a private temporary directory and are removed even when a measurement fails.
Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch

from kvlab.checks import check_count
from kvlab.env import device_name, pick_device
from kvlab.offload.direct_io import (
    ALIGN,
    aligned_buffer,
    drop_page_cache,
    open_direct,
    read_full,
    scratch_dir,
)
from kvlab.specs import hardware

MiB = 2**20
GB = 10**9
# The most any measurement here writes to disk.
MAX_SCRATCH_BYTES = 2 * 2**30


# Links and storage, from datasheets and standards


@dataclass(frozen=True)
class Link:
    """A path KV bytes can travel to the GPU, at its datasheet or standard rate (bytes/s, one direction)."""

    name: str
    bytes_per_s: float
    source: str
    # a label for tables and figures
    short: str = ""

    @property
    def label(self) -> str:
        return self.short or self.name


LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link(
            "PCIe Gen4 x16",
            hardware.PCIE_X16_BYTES_PER_S[4],
            "PCI-SIG PCIe 4.0: 16 GT/s x16, ~31.5 GB/s per direction (kvlab.specs.hardware)",
            "PCIe 4",
        ),
        Link(
            "PCIe Gen5 x16",
            hardware.PCIE_X16_BYTES_PER_S[5],
            "PCI-SIG PCIe 5.0: 32 GT/s x16, ~63 GB/s per direction (kvlab.specs.hardware)",
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

# The fabrics between GPUs and between nodes, which a disaggregated deployment moves KV over from a prefill
# GPU to a decode GPU; kept apart from LINKS, whose entries are tiers a single server offloads to.
CLUSTER_LINKS: dict[str, Link] = {
    link.name: link
    for link in [
        Link(
            "800 Gb InfiniBand XDR",
            100 * GB,
            "NVIDIA ConnectX-8 SuperNIC: 800 Gb/s XDR InfiniBand = 100 GB/s per port "
            "(https://www.nvidia.com/en-us/networking/products/ethernet/supernic/)",
            "IB XDR",
        ),
        Link(
            "400 Gb RoCE",
            50 * GB,
            "IEEE 802.3bs: 400 Gb/s Ethernet = 50 GB/s line rate, which RDMA over Converged Ethernet (RoCE v2) "
            "carries; NVIDIA ConnectX-7 offers 400 GbE ports (https://www.nvidia.com/en-us/networking/ethernet/connectx-7/)",
            "RoCE 400",
        ),
        Link(
            "NVLink 4 (H100 SXM)",
            hardware.gpu_link_bytes_per_s(hardware.get("H100-SXM")),
            "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 18 NVLink 4 links, 900 GB/s in both directions "
            "together, 450 GB/s each way (kvlab.specs.hardware)",
            "NVLink 4",
        ),
        Link(
            "NVLink 5 (B200)",
            hardware.gpu_link_bytes_per_s(hardware.get("B200")),
            "NVIDIA HGX platform page: fifth-generation NVLink, 1.8 TB/s per GPU in both directions together, "
            "900 GB/s each way (kvlab.specs.hardware)",
            "NVLink 5",
        ),
    ]
}


def link(name: str | Link) -> Link:
    """A `Link` of `LINKS` or `CLUSTER_LINKS` by name (case-insensitive); an unknown name lists the known ones."""
    if isinstance(name, Link):
        return name
    known = {**LINKS, **CLUSTER_LINKS}
    for key, value in known.items():
        if key.lower() == str(name).lower():
            return value
    raise ValueError(f"unknown link {name!r}; known: {', '.join(known)}")


# Bandwidth of each tier


@dataclass(frozen=True)
class TierBandwidth:
    """One tier's measured bandwidth: payload bytes per second, every sample kept."""

    tier: str
    # bytes/s of each repeat
    samples: tuple[float, ...]
    size_bytes: int
    method: str
    spec_bytes_per_s: float | None = None
    spec_source: str = ""
    # seconds of single 4 KiB transfers (disk reads, host-link copies)
    latency_samples: tuple[float, ...] = ()

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


def _require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device, got {device}")


def ram_copy(size_bytes: int = 64 * MiB, repeat: int = 5) -> TierBandwidth:
    """A host-memory copy of `size_bytes` (read once, written once): payload bytes per second."""
    check_count("repeat", repeat)
    probe = hardware.CopyProbe("cpu", size_bytes)
    probe.time(repeat, warmup=1)
    return TierBandwidth(
        "RAM copy", tuple(probe.nbytes / t for t in probe.seconds), probe.nbytes, "torch copy_ on CPU"
    )


def gpu_copy(
    device: str | torch.device | None = None, size_bytes: int = 256 * MiB, repeat: int = 5
) -> TierBandwidth:
    """A device-to-device copy on the GPU; reported as bytes read + written per second, the datasheet's convention."""
    device = pick_device(device)
    _require_cuda(device, "gpu_copy")
    probe = hardware.CopyProbe(device, size_bytes)
    probe.time(repeat, warmup=1)
    spec = hardware.spec_for(device_name(device))
    return TierBandwidth(
        "GPU memory (copy, read + write)",
        tuple(2 * probe.nbytes / t for t in probe.seconds),
        probe.nbytes,
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
    """Host-to-device (or device-to-host) copy of `size_bytes`, from pinned or pageable host memory, and the
    latency of one small synchronous copy, as a cache layer makes one per tensor per step."""
    device = pick_device(device)
    _require_cuda(device, "host_link")
    probe = hardware.HostLinkProbe(device, size_bytes, pinned=pinned, to_device=to_device)
    probe.time(repeat, warmup=1)
    latencies = probe.latency()
    spec = hardware.spec_for(device_name(device))
    arrow = "host → device" if to_device else "device → host"
    return TierBandwidth(
        f"{arrow}, {'pinned' if pinned else 'pageable'}",
        tuple(probe.nbytes / t for t in probe.seconds),
        probe.nbytes,
        "torch copy_ between CPU and GPU",
        spec.host_link_bytes_per_s if spec else None,
        f"{spec.name}: PCIe per direction ({spec.source})" if spec else "",
        tuple(latencies),
    )


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
    """The whole file, one `buf` at a time (`read_full`: a buffer past Linux's 2 GiB per call goes in chunks);
    the bytes read."""
    total = 0
    while True:
        n = read_full(fd, buf, total)
        total += n
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
    check_count("size_bytes", size_bytes, MiB)
    check_count("chunk_bytes", chunk_bytes, ALIGN)
    check_count("repeat", repeat)
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes must be a multiple of {ALIGN}, got {chunk_bytes}")
    with scratch_dir(directory) as tmp:
        _check_room(tmp, size_bytes)
        path = tmp / "tier.bin"
        _write_file(path, size_bytes, chunk_bytes)
        buf = aligned_buffer(chunk_bytes)
        try:
            if buffered:
                fd, direct = os.open(path, os.O_RDONLY), False
                method = "buffered read (page cache warm)"
            else:
                fd, direct = open_direct(path, os.O_RDONLY)
                method = (
                    "O_DIRECT read" if direct else "read after posix_fadvise(DONTNEED) (no O_DIRECT here)"
                )
            try:
                samples = []
                # The first read warms the drive (and, when buffered, fills the page cache); it is not kept.
                for i in range(repeat + 1):
                    if not direct and not buffered:
                        drop_page_cache(fd)
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


def compute_for(
    seconds: float,
    clock: Callable[[], float] = time.perf_counter,
    reads: Sequence[torch.Tensor] = (),
) -> None:
    """Keep this thread computing for `seconds` of `clock`, as a decode step does between its reads.

    The computing first reads each of `reads` once (a decoder layer's weights, say), as a one-token decode step
    reads a layer's weights between two layers' cache accesses, and so leaves the CPU's caches as full of other
    data as the step does; the rest of the time it runs small matmuls, which stay in the L1 cache."""
    end = clock() + seconds
    for tensor in reads:
        tensor.sum()
    a = torch.ones(64, 64)
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
    buf = aligned_buffer(ALIGN)
    try:
        stride = max(ALIGN, size_bytes // count // ALIGN * ALIGN)
        times = []
        for i in range(count):
            if not direct:
                drop_page_cache(fd)
            compute_for(busy_s)
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
