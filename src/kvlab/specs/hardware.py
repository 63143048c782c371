"""Accelerators: the memory the driver reports, memory bandwidth, dense compute and the host link.

`memory_bytes` is the capacity the driver reports: the total `nvidia-smi` prints, in MiB (2**20 bytes). It is
more than the datasheet's decimal "80 GB" suggests (an H100 80GB reports 81,559 MiB = 79.6 GiB, an A100 80GB
81,920 MiB = 80 GiB), and it is still more than any engine gives the KV cache: the CUDA context, the weights,
the activation workspace and the engine's utilisation cap come off it first (`kvlab.costs.budget`). The datasheet
figure is kept as `datasheet_memory_bytes`.
Bandwidth and compute are the vendor's datasheet numbers in SI units (1 TB/s = 1e12 bytes/s). Compute is the
dense figure (datasheets often headline the 2:4-sparse one, which is twice as large) in `flops_dtype`: bf16,
or fp16 on parts without bf16 tensor cores. The host link is the PCIe bandwidth per direction.
`spec_for` finds a GPU's entry by the name its driver reports.

This module alone measures copies and links on the machine at hand: a copy within device (or host) memory
(`CopyProbe`), a copy over the host link (`HostLinkProbe`, either direction, pinned or pageable), a matmul
(`MatmulProbe`), a model's linear maps at a batch (`LinearProbe`), each timed by `kvlab.measure.time_call`; `measure` gathers them into the ceilings the roofline
runs on. Importing it does not import torch (the CLI reads the spec table alone): the probes import it when built.
Chapters: *Why decode is bandwidth-bound* (book/04_bandwidth_bound), *Active tokens, not batch size* (book/05_active_tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvlab.checks import check_count
from kvlab.units import format_count

if TYPE_CHECKING:
    import torch

GB = 10**9
TB = 10**12
TFLOPS = 10**12
MiB = 2**20

# PCIe x16 per direction, by generation: Gen3 ~15.75 GB/s, Gen4 ~31.5 GB/s, Gen5 ~63 GB/s (PCI-SIG
# specifications); datasheets round these to 16/32/64 GB/s and quote those, which is what we store.
PCIE_X16_BYTES_PER_S: dict[int, float] = {3: 16 * GB, 4: 32 * GB, 5: 64 * GB}
# A small transfer, as a cache layer makes one per tensor per step: what one request costs before bytes flow.
LATENCY_BYTES = 4096

# Where the driver-reported totals come from: `nvidia-smi`'s Memory-Usage column on an idle card. Each value was
# checked against several public nvidia-smi logs (2026-11-30); the H100 one, for example, is printed in
# huggingface/diffusers' torchao quantization README ("2MiB / 81559MiB" on an H100 80GB HBM3).
_SMI = "nvidia-smi Memory-Usage total as printed by the driver on an idle card"


@runtime_checkable
class Ceilings(Protocol):
    """Anything the roofline can run on: a spec-sheet `Accelerator` or a `Measurement` of this machine."""

    @property
    def name(self) -> str: ...

    @property
    def bandwidth_bytes_per_s(self) -> float: ...

    @property
    def flops(self) -> float: ...


class UnknownAcceleratorError(KeyError):
    """An accelerator name the spec table does not hold."""

    # KeyError would print the message in quotes
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class Accelerator:
    name: str
    # what the driver reports (nvidia-smi total)
    memory_bytes: int
    # the datasheet's decimal figure, e.g. 80 GB = 80e9
    datasheet_memory_bytes: int
    # HBM/GDDR bandwidth
    bandwidth_bytes_per_s: float
    # dense tensor-core peak in `flops_dtype`, FLOP/s
    flops: float
    # host interface (PCIe) per direction
    host_link_bytes_per_s: float
    # GPU-to-GPU (NVLink) total of both directions, as datasheets quote it (H100 SXM: 18 NVLink 4 links,
    # 900 GB/s total, i.e. 450 GB/s each way: NVIDIA H100 Tensor Core GPU Architecture whitepaper, "NVLink");
    # None where the part has none. `gpu_link_bytes_per_s` gives one direction.
    interconnect_bytes_per_s: float | None
    # datasheet
    source: str
    memory_source: str = _SMI
    flops_dtype: str = "bf16"
    note: str = ""
    # Dense fp8 tensor-core peak, FLOP/s: twice the bf16 figure on Ada, Hopper and Blackwell (the same datasheet,
    # halving its with-sparsity fp8 figure); None where the part has no fp8 tensor cores (T4, A100).
    fp8_flops: float | None = None
    # Whether NCCL can run NVLink SHARP (NVLS) among these GPUs: HGX boards of Hopper or later, whose third-generation
    # NVSwitch reduces in the switch. NVLS buffers make NCCL's memory much larger there (NVIDIA/NeMo-Framework-
    # Launcher#127 sets NCCL_NVLS_ENABLE=0 "for memory saving"; NVIDIA/JAX-Toolbox#383: communicator set-up with NVLS
    # "is memory intensive"), so vLLM's non-torch memory at TP >= 2 depends on it (kvlab.costs.budget).
    nvls: bool = False

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (FLOP per byte of memory traffic) where compute and bandwidth limits meet."""
        return self.flops / self.bandwidth_bytes_per_s


_SPECS = [
    Accelerator(
        "T4",
        15360 * MiB,
        16 * GB,
        320 * GB,
        65 * TFLOPS,
        PCIE_X16_BYTES_PER_S[3],
        None,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf",
        flops_dtype="fp16",
        note="T4 has no bf16 tensor cores; the figure is its fp16 tensor-core peak.",
    ),
    Accelerator(
        "L4",
        23034 * MiB,
        24 * GB,
        300 * GB,
        121 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        None,
        "https://www.nvidia.com/en-us/data-center/l4/ (L4 datasheet: 242 TFLOPS bf16 with sparsity)",
        fp8_flops=242.5 * TFLOPS,
    ),
    Accelerator(
        "A100-40GB",
        40960 * MiB,
        40 * GB,
        1555 * GB,
        312 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        600 * GB,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        note="SXM4 form factor.",
    ),
    Accelerator(
        "A100-80GB",
        81920 * MiB,
        80 * GB,
        2039 * GB,
        312 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        600 * GB,
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        note="SXM4 form factor.",
    ),
    Accelerator(
        "H100-SXM",
        81559 * MiB,
        80 * GB,
        3.35 * TB,
        989.4 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        900 * GB,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 SXM column)",
        fp8_flops=1978.9 * TFLOPS,
        nvls=True,
    ),
    Accelerator(
        "H100-PCIe",
        81559 * MiB,
        80 * GB,
        2.0 * TB,
        756 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        None,
        "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100 PCIe column)",
        note="An NVLink bridge (600 GB/s) links pairs of cards; the table keeps the card alone.",
        fp8_flops=1513 * TFLOPS,
    ),
    Accelerator(
        "H200",
        143771 * MiB,
        141 * GB,
        4.8 * TB,
        989.4 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        900 * GB,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM datasheet column)",
        fp8_flops=1978.9 * TFLOPS,
        nvls=True,
    ),
    Accelerator(
        "B200",
        183359 * MiB,
        180 * GB,
        7.7 * TB,
        2250 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        1800 * GB,
        "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200 per-GPU figures: 4.5 PFLOPS bf16 sparse)",
        fp8_flops=4500 * TFLOPS,
        nvls=True,
    ),
    Accelerator(
        "MI300X",
        196288 * MiB,
        192 * GB,
        5.3 * TB,
        1307.4 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        896 * GB,
        "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-"
        "sheet.pdf (AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, BF16 1,307.4 and FP8 2,614.9 TFLOPS "
        "dense, 7 Infinity Fabric links of 128 GB/s, PCIe Gen5 x16)",
        memory_source="rocm-smi --showmeminfo vram on an idle card ('VRAM Total Memory (B): 205822885888')",
        note="AMD, OAM module on ROCm: vLLM and SGLang run on it through ROCm/HIP; `nvidia-smi` does not exist "
        "there. The peer figure is the seven Infinity Fabric links summed, as the datasheet quotes them.",
        fp8_flops=2614.9 * TFLOPS,
    ),
    # The parts below are the ones readers deploy beside the datacentre flagships: the export variants sold in
    # China (H800, A800, H20, L20) and the Ada/Ampere cards of small servers (L40S, RTX 4090, RTX 3090).
    Accelerator(
        "H800",
        81559 * MiB,
        80 * GB,
        3.35 * TB,
        989.4 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        400 * GB,
        "H100 SXM column of https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet for "
        "memory and compute; NVLink from DeepSeek-AI, 'Insights into DeepSeek-V3', arXiv:2505.09343, sec. 2",
        memory_source=f"{_SMI} ('NVIDIA H800 ... 14MiB / 81559MiB' in public nvidia-smi logs)",
        note="SXM5. NVIDIA no longer hosts an H800 datasheet: the part is the H100 SXM's silicon and clocks with "
        "NVLink cut from 900 to 400 GB/s (and FP64 cut), so the H100 SXM figures stand for its memory and compute.",
        fp8_flops=1978.9 * TFLOPS,
        nvls=True,
    ),
    Accelerator(
        "A800-80GB",
        81920 * MiB,
        80 * GB,
        2039 * GB,
        312 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        400 * GB,
        "A100 80GB SXM column of https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; NVLink 400 GB/s as NVIDIA gave it at launch "
        "(Reuters, 2022-11-08, via https://tweakers.net/nieuws/203182/)",
        memory_source=f"{_SMI} ('NVIDIA A800-SXM4-80GB ... 81920MiB')",
        note="SXM4. The A100's silicon, memory and clocks with NVLink cut from 600 to 400 GB/s (press report of "
        "NVIDIA's own statement); the PCIe A800 80GB has 1,935 GB/s and no NVLink.",
    ),
    Accelerator(
        "H20",
        97871 * MiB,
        96 * GB,
        4.0 * TB,
        148 * TFLOPS,
        PCIE_X16_BYTES_PER_S[5],
        900 * GB,
        "PRESS REPORT, not a vendor datasheet: NVIDIA publishes none for the H20. Tom's Hardware, 2024-02, "
        "https://www.tomshardware.com/pc-components/gpus/new-nvidia-ai-gpus-designed-to-get-around-us-export-"
        "bans-come-to-china-h20-l20-and-l2-to-fill-void-left-by-restricted-models (the retailer Vipera's listing "
        "of NVIDIA's spec sheet: 96 GB HBM3, 4.0 TB/s, BF16/FP16 148 and FP8 296 TFLOPS); NVLink 900 GB/s and "
        "PCIe Gen5 from TweakTown, https://www.tweaktown.com/news/95224/",
        memory_source=f"{_SMI} ('NVIDIA H20 ... 4MiB / 97871MiB', driver 550.144.03)",
        note="HGX (SXM) module, Hopper with 78 SMs. The 148 TFLOPS are dense: FP8 is exactly twice, and a "
        "measured 8k-square bf16 matmul reaches 142 TFLOPS (zzc0721/torch-performance-test-data#77). A 141 GB "
        "HBM3e H20 also exists; this entry is the 96 GB part.",
        fp8_flops=296 * TFLOPS,
        nvls=True,
    ),
    Accelerator(
        "L20",
        46068 * MiB,
        48 * GB,
        864 * GB,
        119.5 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        None,
        "PRESS REPORT, not a vendor datasheet: NVIDIA publishes none for the L20. Tom's Hardware, 2024-02 (same "
        "article as the H20: 48 GB GDDR6 with ECC, 864 GB/s, BF16/FP16 119.5 and FP8 239 TFLOPS, PCIe)",
        memory_source=f"{_SMI} ('NVIDIA L20 ... / 46068MiB', as for the L40S)",
        note="PCIe Gen4 x16 card, Ada AD102 with 92 SMs; no NVLink. The 119.5 TFLOPS are dense (FP8 is twice).",
        fp8_flops=239 * TFLOPS,
    ),
    Accelerator(
        "L40S",
        46068 * MiB,
        48 * GB,
        864 * GB,
        362.05 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        None,
        "https://www.nvidia.com/en-us/data-center/l40s/ (L40S datasheet: BF16 362.05 | 733 TFLOPS with "
        "sparsity, FP8 733 | 1,466, PCIe Gen4 x16 64 GB/s bidirectional)",
        memory_source=f"{_SMI} ('NVIDIA L40S ... 1MiB / 46068MiB')",
        note="No NVLink.",
        fp8_flops=733 * TFLOPS,
    ),
    Accelerator(
        "RTX-4090",
        24564 * MiB,
        24 * GB,
        1008 * GB,
        165.2 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        None,
        "NVIDIA Ada GPU architecture whitepaper, appendix table of the GeForce RTX 4090: "
        "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        memory_source=f"{_SMI} ('NVIDIA GeForce RTX 4090 ... 1MiB / 24564MiB')",
        note="GeForce: BF16 with FP32 accumulate (what PyTorch's bf16 matmul uses) runs at half the FP16-"
        "accumulate rate, 165.2 of 330.3 dense TFLOPS; fp8 likewise 330.3 of 660.6. No NVLink.",
        fp8_flops=330.3 * TFLOPS,
    ),
    Accelerator(
        "RTX-3090",
        24576 * MiB,
        24 * GB,
        936 * GB,
        71 * TFLOPS,
        PCIE_X16_BYTES_PER_S[4],
        None,
        "NVIDIA Ampere GA102 GPU architecture whitepaper, table of the GeForce RTX 3090: "
        "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf",
        memory_source=f"{_SMI} ('NVIDIA GeForce RTX 3090 ... 2MiB / 24576MiB')",
        note="GeForce: BF16 with FP32 accumulate, 71 of 142 dense TFLOPS (FP16 accumulate); no fp8 tensor cores. "
        "An NVLink bridge (112.5 GB/s) links pairs of cards; the table keeps the card alone.",
    ),
]
SPECS: dict[str, Accelerator] = {spec.name: spec for spec in _SPECS}


def gpu_link_bytes_per_s(spec: Accelerator) -> float:
    """One direction of the GPU's link to its peers: half the NVLink total where it has NVLink, else its PCIe
    host link (per direction), which GPU-to-GPU traffic crosses without NVLink."""
    if spec.interconnect_bytes_per_s is not None:
        return spec.interconnect_bytes_per_s / 2
    return spec.host_link_bytes_per_s


def peak_flops(spec: Ceilings, dtype: str | None = None) -> float:
    """Dense tensor-core peak for matmuls whose weights are `dtype`: the fp8 peak for fp8 weights on parts that
    have one (the fp8 datasheet figures: 3,958 TFLOPS with sparsity on H100 SXM and H200, 3,026 on H100 PCIe,
    9 PFLOPS on an HGX B200 GPU, 485 on L4; halved for dense), else `flops` (bf16/fp16; a measurement's own)."""
    fp8 = getattr(spec, "fp8_flops", None)
    if dtype is not None and str(dtype).lower().startswith(("fp8", "float8")) and fp8:
        return float(fp8)
    return float(spec.flops)


def registry() -> list[str]:
    """Names of the accelerators in the spec table."""
    return list(SPECS)


def get(name: str) -> Accelerator:
    """The spec sheet of `name` (case-insensitive); an unknown name lists the known ones."""
    for key, spec in SPECS.items():
        if key.lower() == str(name).lower():
            return spec
    raise UnknownAcceleratorError(f"unknown accelerator {name!r}; known: {', '.join(SPECS)}")


def _family(key: str) -> list[str]:
    """The words of a spec-table name up to its first with a digit: 'H100-SXM' -> H100, 'RTX-4090' -> RTX, 4090."""
    words = key.upper().split("-")
    first = next((i for i, word in enumerate(words) if any(c.isdigit() for c in word)), len(words) - 1)
    return words[: first + 1]


# Form-factor words in driver-reported names: the same family ships in parts with different memory and clocks.
_FORM_FACTORS = ("PCIE", "SXM", "SXM4", "SXM5", "NVL")


def spec_for(device_name: str) -> Accelerator | None:
    """The spec-table entry for a GPU by the name its driver reports, if any: its family in the name
    ('NVIDIA H200' -> H200), and among several of a family the variant named too ('H100 PCIe' -> H100-PCIe,
    'A100-SXM4-80GB' -> A100-80GB), else the first listed (H100 -> H100-SXM). A family is the name up to its
    first word with a digit ('H100', 'RTX 4090'), so 'RTX 5090' or 'RTX A6000' match nothing."""
    name = device_name.upper().replace(" ", "-")
    words = name.split("-")
    family = [spec for key, spec in SPECS.items() if all(word in words for word in _family(key))]
    variant = [spec for spec in family if "-" in spec.name and spec.name.upper().split("-", 1)[1] in name]
    # A form factor the table does not hold (an H800 PCIe, when only the SXM part is listed) is another part:
    # its memory and clocks differ, so the family's first entry would be a silently wrong spec.
    named_form = [form for form in _FORM_FACTORS if form in words]
    if (
        named_form
        and not variant
        and not any(form in spec.name.upper() for spec in family for form in named_form)
    ):
        return None
    matches = variant or family
    return matches[0] if matches else None


@dataclass(frozen=True)
class Measurement:
    """Ceilings measured on this machine, usable wherever the roofline takes a spec-sheet `Accelerator`.

    `flops` is the matmul throughput in `flops_dtype` (on CPU the fp32 figure by default).
    """

    name: str
    memory_bytes: int
    # large device-to-device copy, bytes read + written
    bandwidth_bytes_per_s: float
    # square matmul, FLOP/s
    flops: float
    flops_dtype: str
    # pinned host-to-device copy; None on CPU (there is no link)
    host_link_bytes_per_s: float | None
    # size of the copied buffer
    copy_bytes: int
    # n of the n × n × n matmul
    matmul_size: int
    interconnect_bytes_per_s: float | None = None
    source: str = "measured by kvlab.specs.hardware.measure"
    note: str = ""
    # The rate a matrix-vector product reads weights (`LinearProbe`), where it, not the copy, sets how fast a
    # step reads its weights: on a CPU. None: weights are read at `bandwidth_bytes_per_s`, like the cache.
    weight_read_bytes_per_s: float | None = None

    @property
    def ridge_flops_per_byte(self) -> float:
        return self.flops / self.bandwidth_bytes_per_s

    @property
    def weight_ridge_flops_per_byte(self) -> float:
        """FLOP per weight byte at which a step's weight reads take as long as its matmuls."""
        return self.flops / weight_read_rate(self)


def weight_read_rate(hw: Ceilings) -> float:
    """Bytes per second at which `hw` reads a model's weights: a measured matrix-vector rate where it has one
    (`Measurement.weight_read_bytes_per_s`), else its bandwidth."""
    rate = getattr(hw, "weight_read_bytes_per_s", None)
    return hw.bandwidth_bytes_per_s if rate is None else float(rate)


def _host_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _Probe:
    """Work kept ready to time again and again (`time`), every timing kept in `seconds`. `clock` reads the time
    on a CPU (default: the wall clock; see `kvlab.measure.step_clock`); a GPU is timed with CUDA events."""

    def __init__(self, device: str | torch.device | None, clock: Callable[[], float] | None) -> None:
        from kvlab.env import pick_device

        self.device = pick_device(device)
        self.clock = clock
        self.seconds: list[float] = []

    def run(self) -> object:
        raise NotImplementedError

    def time(self, repeat: int = 1, warmup: int = 0) -> float:
        """Time `repeat` runs (after `warmup` untimed ones), keep them, and return the fastest."""
        from kvlab.measure import time_call

        times = time_call(self.run, self.device, repeat=repeat, warmup=warmup, clock=self.clock)
        self.seconds.extend(times)
        return min(times)

    def fastest_s(self) -> float:
        """The fastest run timed so far."""
        if not self.seconds:
            raise ValueError("the probe has not been timed yet")
        return min(self.seconds)


class _CopyProbe(_Probe):
    """`dst.copy_(src)` kept ready to time, asynchronous where `non_blocking` (from pinned host memory)."""

    src: torch.Tensor
    dst: torch.Tensor
    non_blocking = False

    @property
    def nbytes(self) -> int:
        return self.src.nbytes

    def run(self) -> object:
        return self.dst.copy_(self.src, non_blocking=self.non_blocking)


class CopyProbe(_CopyProbe):
    """A large copy within one device's memory kept ready to time again and again: the bandwidth ceiling,
    re-measured.

    A measurement taken once, before a timed sweep, can fall in a burst of other work on a shared machine while
    the sweep does not (or the other way round); timing the probe between the sweep's rounds puts the ceiling
    and the steps it predicts under the same conditions (`kvlab.experiments.timing.sweep_decode`).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        size_bytes: int = 256 * 2**20,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import torch

        check_count("size_bytes", size_bytes, MiB)
        super().__init__(device, clock)
        # ones, not empty: every page is touched before the first timed copy
        self.src = torch.ones(size_bytes // 4, dtype=torch.float32, device=self.device)
        self.dst = torch.empty_like(self.src)

    def bandwidth_at(self, seconds: float) -> float:
        """Bytes read + written per second by a copy that took `seconds` (STREAM's count: 2 × the buffer)."""
        return 2 * self.nbytes / seconds

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """`bandwidth_at` the fastest copy timed so far."""
        return self.bandwidth_at(self.fastest_s())


class LinearProbe(_Probe):
    """`rows` activation rows through a stack of weight matrices, as a decode step of `rows` sequences runs its
    layers' linear maps, kept ready to time again and again (see `CopyProbe`).

    It measures what the copy cannot: the rate at which this device's matmul kernels stream weights at that
    batch. On a CPU the host runs each kernel in turn, so the kernel, not the memory system, sets how fast a
    decode step reads its weights: a matrix-vector product can read at well under the rate a copy moves bytes,
    and a few-row matmul at well under the matrix-vector product's (MKL on AMD EPYC, for one).
    """

    def __init__(
        self, weights: Sequence[torch.Tensor], rows: int = 1, clock: Callable[[], float] | None = None
    ) -> None:
        import torch

        if not weights:
            raise ValueError("LinearProbe needs at least one weight matrix")
        check_count("rows", rows)
        super().__init__(weights[0].device, clock)
        self.weights, self.rows = list(weights), rows
        dtype = weights[0].dtype
        widths = {int(w.shape[1]) for w in self.weights}
        self.inputs = {k: torch.full((rows, k), 0.5, dtype=dtype, device=self.device) for k in widths}

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def run(self) -> object:
        import torch.nn.functional as F

        return [F.linear(self.inputs[int(w.shape[1])], w) for w in self.weights]

    def read_rate_at(self, seconds: float) -> float:
        """Weight bytes per second of a pass that took `seconds`."""
        return self.nbytes / seconds

    @property
    def read_bytes_per_s(self) -> float:
        """`read_rate_at` the fastest pass timed so far."""
        return self.read_rate_at(self.fastest_s())


def linear_weights(
    shapes: Sequence[tuple[int, int]],
    size_bytes: int,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
) -> list[torch.Tensor]:
    """Weight matrices of `shapes` (out × in, a model's linear maps in the order it runs them), in `dtype` on
    `device`: the longest prefix of `shapes` within `size_bytes`, and at least the first. Constant values: the
    time of a dense matmul does not depend on them."""
    import torch

    from kvlab.env import pick_device

    if not shapes:
        raise ValueError("linear_weights needs at least one shape")
    check_count("size_bytes", size_bytes, 1)
    target, itemsize = pick_device(device), torch.empty((), dtype=dtype).element_size()
    weights: list[torch.Tensor] = []
    total = 0
    for out_features, in_features in shapes:
        nbytes = out_features * in_features * itemsize
        if weights and total + nbytes > size_bytes:
            break
        weights.append(torch.full((out_features, in_features), 0.01, dtype=dtype, device=target))
        total += nbytes
    return weights


class HostLinkProbe(_CopyProbe):
    """A copy over the host link kept ready to time again and again: host to device (`to_device`) or back, from
    pinned host memory (an asynchronous copy the device's DMA engine makes) or pageable (staged by the driver)."""

    def __init__(
        self,
        device: str | torch.device | None = None,
        size_bytes: int = 64 * 2**20,
        pinned: bool = True,
        to_device: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import torch

        check_count("size_bytes", size_bytes, MiB)
        super().__init__(device, clock)
        if self.device.type != "cuda":
            raise ValueError(f"HostLinkProbe needs a CUDA device, got {self.device}")
        self.pinned, self.to_device, self.non_blocking = pinned, to_device, pinned
        # ones, not empty: every page is touched before the first timed copy
        host = torch.ones(size_bytes // 4, dtype=torch.float32, pin_memory=pinned)
        gpu = torch.ones_like(host, device=self.device)
        self.src, self.dst = (host, gpu) if to_device else (gpu, host)

    def latency(self, count: int = 16) -> list[float]:
        """Seconds of each of `count` single synchronous copies of `LATENCY_BYTES` in this probe's direction
        (after one untimed): what a cache layer that copies one tensor at a time pays per copy."""
        from kvlab.measure import time_call

        small_src, small_dst = self.src[: LATENCY_BYTES // 4], self.dst[: LATENCY_BYTES // 4]
        return time_call(lambda: small_dst.copy_(small_src), self.device, repeat=count, clock=self.clock)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Payload bytes over the fastest copy timed so far (one direction)."""
        return self.nbytes / self.fastest_s()


class MatmulProbe(_Probe):
    """An n × n by n × n matmul kept ready to time again and again: the compute ceiling, re-measured (see
    `CopyProbe`)."""

    def __init__(
        self,
        device: str | torch.device | None,
        n: int,
        dtype: torch.dtype,
        clock: Callable[[], float] | None = None,
    ) -> None:
        import torch

        check_count("matmul_size", n)
        super().__init__(device, clock)
        self.n = n
        self.a = torch.randn(n, n, device=self.device).to(dtype)
        self.b = torch.randn(n, n, device=self.device).to(dtype)

    def run(self) -> object:
        return self.a @ self.b

    def flops_at(self, seconds: float) -> float:
        """2n³ FLOP over `seconds`, one matmul's time."""
        return 2 * self.n**3 / seconds

    @property
    def flops(self) -> float:
        """`flops_at` the fastest matmul timed so far."""
        return self.flops_at(self.fastest_s())


def measure(
    device: str | torch.device | None = None,
    size_bytes: int = 256 * 2**20,
    matmul_size: int | None = None,
    dtype: torch.dtype | None = None,
    repeat: int = 5,
    probe: CopyProbe | None = None,
    matmul_probe: MatmulProbe | None = None,
) -> Measurement:
    """Achieved memory bandwidth and matmul FLOP/s of `device` (default: cuda if any, else cpu).

    Bandwidth: `dst.copy_(src)` of `size_bytes`, counting read + write (2 × size); 256 MiB is past the
    last-level cache of the CPUs and GPUs this book meets. FLOP/s: an n × n by n × n matmul (2n³ FLOP) in
    `dtype`, by default `kvlab.env.compute_dtype`: bf16 on GPUs with bf16 tensor cores, fp16 on older ones
    (a T4), fp32 on CPU, the dtype the CPU labs run their models in (CPUs with AMX run bf16 several times
    faster: pass `dtype=torch.bfloat16` to see it). Each figure is the best of `repeat`
    runs, as STREAM reports: the ceiling, not the typical run. On CPU the defaults take about a second.
    With `probe` (a `CopyProbe` kept to be timed again later), the copy is the probe's, of its size, and the
    bandwidth the fastest of every copy the probe has timed so far; with `matmul_probe` likewise the matmul (its
    size and dtype replace `matmul_size` and `dtype`).
    """
    import torch

    from kvlab import env

    if probe is not None:
        size_bytes = probe.nbytes
    check_count("size_bytes", size_bytes, MiB)
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    device = env.pick_device(device)
    gpu = device.type == "cuda"
    dtype = dtype or env.compute_dtype(device)
    n = check_count("matmul_size", (8192 if gpu else 1024) if matmul_size is None else matmul_size)

    if probe is None:
        probe = CopyProbe(device, size_bytes)
    probe.time(repeat=repeat, warmup=1)
    host_link = None
    if gpu:
        link = HostLinkProbe(device, size_bytes)
        link.time(repeat=repeat, warmup=1)
        host_link = link.bandwidth_bytes_per_s
    if matmul_probe is None:
        matmul_probe = MatmulProbe(device, n, dtype)
    matmul_probe.time(repeat=repeat, warmup=1)
    copy_s, copied = probe.fastest_s(), probe.nbytes
    n, dtype, matmul_s = matmul_probe.n, matmul_probe.a.dtype, matmul_probe.fastest_s()
    flops_dtype = str(dtype).removeprefix("torch.")
    memory = torch.cuda.get_device_properties(device).total_memory if gpu else _host_memory_bytes()
    return Measurement(
        name=f"measured {env.device_name(device)}",
        memory_bytes=int(memory),
        bandwidth_bytes_per_s=2 * copied / copy_s,
        flops=2 * n**3 / matmul_s,
        flops_dtype=flops_dtype,
        host_link_bytes_per_s=host_link,
        copy_bytes=copied,
        matmul_size=n,
        note=format_count(torch.get_num_threads(), "torch thread") if not gpu else "",
    )
