"""Accelerator spec sheets: memory, memory bandwidth, dense bf16 compute and the host link.

Every figure is the vendor's datasheet number, in SI units (1 GB = 1e9 bytes, 1 TB/s = 1e12 bytes/s). Compute is
the dense figure (datasheets often headline the 2:4-sparse one, which is twice as large). Memory is the
datasheet capacity; what a process can allocate is a little less (the driver and CUDA context keep some).
The host link is the PCIe bandwidth per direction.
Chapters: *Why decode is bandwidth-bound*, *Beyond HBM*, *Capacity planning*.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
TB = 10**12
TFLOPS = 10**12

# PCIe x16 per direction: Gen3 ~15.75 GB/s, Gen4 ~31.5 GB/s, Gen5 ~63 GB/s (PCI-SIG specifications);
# datasheets round these to 16/32/64 GB/s and quote those, which is what we store.
_PCIE3, _PCIE4, _PCIE5 = 16 * GB, 32 * GB, 64 * GB


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float  # HBM/GDDR bandwidth
    bf16_flops: float  # dense tensor-core peak, FLOP/s
    host_link_bytes_per_s: float  # host interface (PCIe) per direction
    interconnect_bytes_per_s: float | None  # GPU-to-GPU (NVLink) total, None where the part has none
    source: str
    note: str = ""

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (FLOP per byte of memory traffic) where compute and bandwidth limits meet."""
        return self.bf16_flops / self.bandwidth_bytes_per_s


_SPECS = [
    Accelerator(
        "T4",
        16 * GB,
        320 * GB,
        65 * TFLOPS,
        _PCIE3,
        None,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
        "T4 has no bf16 tensor cores; the figure is its fp16 tensor-core peak.",
    ),
    Accelerator(
        "L4",
        24 * GB,
        300 * GB,
        121 * TFLOPS,
        _PCIE4,
        None,
        "https://www.nvidia.com/en-us/data-center/l4/ (L4 datasheet: 242 TFLOPS bf16 with sparsity)",
    ),
    Accelerator(
        "A100-40GB",
        40 * GB,
        1555 * GB,
        312 * TFLOPS,
        _PCIE4,
        600 * GB,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        "SXM4 form factor.",
    ),
    Accelerator(
        "A100-80GB",
        80 * GB,
        2039 * GB,
        312 * TFLOPS,
        _PCIE4,
        600 * GB,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        "SXM4 form factor.",
    ),
    Accelerator(
        "H100-SXM",
        80 * GB,
        3.35 * TB,
        989.4 * TFLOPS,
        _PCIE5,
        900 * GB,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM column)",
    ),
    Accelerator(
        "H100-PCIe",
        80 * GB,
        2.0 * TB,
        756 * TFLOPS,
        _PCIE5,
        None,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 PCIe column)",
        "An NVLink bridge (600 GB/s) links pairs of cards; the table keeps the card alone.",
    ),
    Accelerator(
        "H200",
        141 * GB,
        4.8 * TB,
        989.4 * TFLOPS,
        _PCIE5,
        900 * GB,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet column)",
    ),
    Accelerator(
        "B200",
        180 * GB,
        7.7 * TB,
        2250 * TFLOPS,
        _PCIE5,
        1800 * GB,
        "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per-GPU figures: 4.5 PFLOPS bf16 sparse)",
    ),
]
SPECS: dict[str, Accelerator] = {spec.name: spec for spec in _SPECS}


def names() -> list[str]:
    return list(SPECS)


def get(name: str) -> Accelerator:
    """The spec sheet of `name` (case-insensitive); an unknown name lists the known ones."""
    for key, spec in SPECS.items():
        if key.lower() == str(name).lower():
            return spec
    raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(SPECS)}")
