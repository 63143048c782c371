"""Which device a lab runs on, and a provenance line for every recorded result.

torch is imported when a function needs it, not with the module: `import kvlab` and the CLI stay fast.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.units import format_count

if TYPE_CHECKING:
    import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given, else cuda when available, else cpu."""
    import torch

    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The dtype a lab computes in on `device`: fp32 on CPU; bf16 on GPUs with bf16 tensor cores (compute
    capability 8.0 and up: A100, L4, H100, ...); fp16 on older GPUs such as the T4 (7.5), which has none."""
    import torch

    device = pick_device(device)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def device_name(device: str | torch.device | None = None) -> str:
    import torch

    device = pick_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = format_count(torch.get_num_threads(), "thread")
    return f"CPU ({platform.processor() or platform.machine()}, {threads})"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name as the kernel reports it (`platform.processor()` is often empty on Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def env_report(device: str | torch.device | None = None) -> dict[str, str]:
    """What wrote a result: the machine (CPU model and torch's CPU kernels, or the GPU with its compute
    capability, driver and CUDA), the thread count, the load when the lab started, the library versions and
    the date. Stored outputs differ from machine to machine in their last digits; this says which wrote them."""
    import torch
    import transformers

    from kvlab.version import __version__

    device = pick_device(device)
    load = load_average()
    report = {
        "device": device_name(device),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
        "cores": str(os.cpu_count() or "?"),
        "load_average": "unknown" if load is None else f"{load:.2f}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvlab": __version__,
        "python": platform.python_version(),
        "date": _dt.date.today().isoformat(),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        report["compute_capability"] = f"{major}.{minor}"
        report["cuda"] = torch.version.cuda or ""
        report["driver"] = _nvidia_driver()
    return report


def _nvidia_driver() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"
