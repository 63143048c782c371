"""Which device a lab runs on, and a provenance line for every recorded result."""

from __future__ import annotations

import datetime as _dt
import platform

import torch


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device` if given, else cuda when available, else cpu."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(device: str | torch.device | None = None) -> torch.dtype:
    """The dtype a lab computes in on `device`: fp32 on CPU; bf16 on GPUs with bf16 tensor cores (compute
    capability 8.0 and up: A100, L4, H100, ...); fp16 on older GPUs such as the T4 (7.5), which has none."""
    device = pick_device(device)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def device_name(device: str | torch.device | None = None) -> str:
    device = pick_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def env_report(device: str | torch.device | None = None) -> dict[str, str]:
    """Device, driver and library versions, and the date: what a reader needs to reproduce a figure."""
    import transformers

    import kvlab

    device = pick_device(device)
    report = {
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kvlab": kvlab.__version__,
        "python": platform.python_version(),
        "date": _dt.date.today().isoformat(),
    }
    if device.type == "cuda":
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
