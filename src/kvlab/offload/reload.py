"""Recompute or reload: restoring a prompt's KV by its prefill again, or by reading its bytes over a link.

Reloading wins when the prefill's FLOPs per KV byte exceed the FLOPs the GPU could do while the link delivers one
byte (`flops / link bytes per second`, `break_even_flops_per_byte`). GQA divides the KV bytes by the group size
and leaves the FLOPs alone, so it pushes a model towards reload; MHA models sit closer to the break-even.
`recompute_vs_reload` estimates both on a spec sheet over a cited link (`kvlab.offload.tiers.LINKS`);
`time_reload` times both on the machine at hand (`kvlab.offload.saved_kv`) and `check_reload` asks whether the
model picks the stopwatch's winner. Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from kvlab import claims
from kvlab.checks import check_count
from kvlab.costs import roofline
from kvlab.measure import time_call
from kvlab.offload.direct_io import scratch_dir
from kvlab.offload.saved_kv import SavedKV, load_kv, save_kv
from kvlab.offload.tiers import Link, link
from kvlab.specs import hardware
from kvlab.specs.sizing import DType


@dataclass(frozen=True)
class ReloadEstimate:
    """Restoring one prompt's KV: recomputing its prefill on `gpu`, or reading its KV over `link`."""

    model: str
    link: str
    prompt_len: int
    kv_bytes: int
    prefill_flops: float
    # roofline prefill time: max(FLOPs / FLOP/s, bytes / bandwidth)
    recompute_s: float
    # KV bytes / link bytes per second
    reload_s: float

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

    # the saved cache (its file is removed after the measurement)
    saved: SavedKV
    # the prefill, again
    recompute_s: float
    # `load_kv` of the saved cache onto the device
    reload_s: float
    # decoding on from the reloaded cache gives the recomputed cache's next token
    same_next_token: bool

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
    check_count("repeat", repeat)
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
