"""Recompute or reload: restoring a prompt's KV by its prefill again, or by reading its bytes over a link.

Reloading wins when the prefill's FLOPs per KV byte exceed the FLOPs the GPU could do while the link delivers one
byte (`flops / link bytes per second`, `break_even_flops_per_byte`). GQA divides the KV bytes by the group size
and leaves the FLOPs alone, so it pushes a model towards reload; MHA models sit closer to the break-even.
`recompute_vs_reload` estimates both on a spec sheet over a cited link (`kvlab.offload.tiers.LINKS`);
`time_reload` times both on the machine at hand (`kvlab.offload.saved_kv`), `predict_reload` predicts both from
what was timed beside them, and `check_reload` claims the prediction to within `RELOAD_BAND` either way.
Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache

from kvlab import claims
from kvlab.checks import check_count
from kvlab.costs import roofline
from kvlab.measure import Timer, step_clock
from kvlab.offload.direct_io import scratch_dir
from kvlab.offload.saved_kv import SavedKV, load_kv, read_saved, save_kv, staging_buffer
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
    """One measurement of recompute against reload for one prompt, and of what predicts them, timed in the same
    rounds: the best of `repeat` rounds of each."""

    # the saved cache (its file is removed after the measurement)
    saved: SavedKV
    prompt_len: int
    # the prefill, again (on a CPU in this thread's CPU time, `kvlab.measure.step_clock`)
    recompute_s: float
    # `load_kv` of the saved cache onto the device, into the staging buffer kept between reloads (wall clock)
    reload_s: float
    # decoding on from the reloaded cache gives the recomputed cache's next token
    same_next_token: bool
    # the prefill of the prompt's first half, clocked as `recompute_s`
    half_prefill_s: float = 0.0
    # the O_DIRECT read of the saved file into the staging buffer alone (wall clock)
    read_s: float = 0.0
    # payload bytes per second of a copy into a resident tensor on the device: a RAM copy on a CPU, a
    # pageable host-to-device copy on a GPU (clocked as `recompute_s`)
    copy_bytes_per_s: float = 0.0
    # `load_kv` into a buffer mapped for that reload alone, as `load_kv` does without a staging buffer: its page
    # faults included (wall clock)
    fresh_reload_s: float = 0.0

    @property
    def speedup(self) -> float:
        """recompute / reload, measured: above 1, reloading was faster."""
        return self.recompute_s / self.reload_s


# times a round of `time_reload` runs the reload, the read and the copy
READS_PER_ROUND = 4


def _timed(fn: Callable[[], object], device: torch.device, clock: Callable[[], float]) -> float:
    with Timer(device, clock=clock) as timer:
        fn()
    return timer.seconds


@torch.inference_mode()
def time_reload(
    model: Any,
    input_ids: torch.Tensor,
    repeat: int = 5,
    directory: str | os.PathLike[str] | None = None,
) -> ReloadTiming:
    """Save the prompt's cache with O_DIRECT (`save_kv`), then time, best of `repeat` rounds after one untimed
    round: running its prefill again, reading the cache back onto the device (`load_kv` into a staging buffer
    kept for every reload, as an engine keeps its host buffer), and, for `predict_reload`, the prefill of the
    prompt's first half, the file's read alone, a copy of its payload into a resident tensor, and `load_kv` into a
    buffer mapped for that reload alone. Every round runs each, so a burst of load on a shared machine hits them
    alike."""
    check_count("repeat", repeat)
    prompt_len = int(input_ids.shape[-1])
    if prompt_len < 2:
        raise ValueError(
            f"time_reload needs a prompt of at least 2 tokens (it also times its first half), got {prompt_len}"
        )
    device = model.device
    compute = step_clock(device)
    half_ids = input_ids[..., : prompt_len // 2]
    with scratch_dir(directory) as tmp:
        saved = save_kv(prefill_cache(model, input_ids), tmp / "prompt.kv")
        staging = staging_buffer(saved)
        host = torch.ones(saved.nbytes // 4, dtype=torch.float32)
        resident = torch.empty_like(host, device=device)
        # (what, callable, clock): reads wait on the drive, so the wall clock times them
        work: list[tuple[str, Callable[[], object], Callable[[], float]]] = [
            ("recompute", lambda: prefill_cache(model, input_ids), compute),
            ("half", lambda: prefill_cache(model, half_ids), compute),
            ("reload", lambda: load_kv(saved, device, staging), time.perf_counter),
            ("read", lambda: read_saved(saved, staging), time.perf_counter),
            ("copy", lambda: resident.copy_(host), compute),
            ("fresh", lambda: load_kv(saved, device), time.perf_counter),
        ]
        best: dict[str, float] = {}
        try:
            for round_ in range(repeat + 1):
                # a read or a copy takes a few ms, a prefill a hundred or more: the short ones run
                # READS_PER_ROUND times a round, so that their best is as likely as the prefill's to miss
                # the bursts of other work
                for name, fn, clock in work[:2] + work[2:] * READS_PER_ROUND:
                    seconds = _timed(fn, device, clock)
                    if round_:
                        best[name] = min(best.get(name, seconds), seconds)
            last = input_ids[:, -1:].to(device)
            reloaded = model(last, cache=load_kv(saved, device, staging)).logits.argmax(-1)
            recomputed = model(last, cache=prefill_cache(model, input_ids)).logits.argmax(-1)
        finally:
            staging.close()
    return ReloadTiming(
        saved,
        prompt_len,
        best["recompute"],
        best["reload"],
        bool(torch.equal(reloaded, recomputed)),
        best["half"],
        best["read"],
        host.nbytes / best["copy"],
        best["fresh"],
    )


@dataclass(frozen=True)
class ReloadPrediction:
    """Recompute and reload of one prompt as the cost model predicts them on the machine at hand."""

    # the prompt's prefill FLOPs at the FLOP rate its first half's prefill ran at (a compute-bound prefill)
    recompute_s: float
    # the saved file's read plus one copy of its payload into the cache's tensors
    reload_s: float

    @property
    def speedup(self) -> float:
        return self.recompute_s / self.reload_s


def predict_reload(timing: ReloadTiming, config: PretrainedConfig) -> ReloadPrediction:
    """The cost model on one `time_reload`: recompute = the prompt's prefill FLOPs (`kvlab.costs.roofline`) at the
    FLOP rate the prefill of its first half ran at; reload = the O_DIRECT read of the file, timed alone, plus its
    K/V payload at the device's copy rate. Nothing else is charged: no page faults, no second copy."""
    flops = {
        n: roofline.prefill(config, hardware.get("H100-SXM"), 1, n).flops
        for n in (timing.prompt_len, timing.prompt_len // 2)
    }
    rate = flops[timing.prompt_len // 2] / timing.half_prefill_s
    return ReloadPrediction(
        recompute_s=flops[timing.prompt_len] / rate,
        reload_s=timing.read_s + timing.saved.nbytes / timing.copy_bytes_per_s,
    )


# How closely the prediction is claimed: measured / predicted within [1 / RELOAD_BAND, RELOAD_BAND] for the
# recompute and for the reload. Below sqrt(2), no measurement passes both a prediction and one twice or half as
# large; and recompute / reload, measured over predicted, stays within RELOAD_BAND ** 2 = 1.96, under 2.
RELOAD_BAND = 1.4


def check_reload(
    timing: ReloadTiming, predicted: ReloadPrediction, band: float = RELOAD_BAND
) -> list[claims.Check]:
    """The claim on one `time_reload`: the recompute and the reload each measured within a factor `band` of
    `predict_reload`'s, either way (so their ratio within `band` squared), and the model picks the stopwatch's
    winner."""
    if isinstance(band, bool) or not isinstance(band, (int, float)) or not band > 1:
        raise ValueError(f"band must be a factor above 1, got {band!r}")
    checks = [
        claims.between(f"{name}: measured / predicted", measured / guess, 1 / band, band)
        for name, measured, guess in (
            ("recompute", timing.recompute_s, predicted.recompute_s),
            ("reload", timing.reload_s, predicted.reload_s),
        )
    ]
    checks.append(
        claims.Check(
            "the model picks the same winner as the stopwatch",
            (predicted.speedup > 1) == (timing.speedup > 1),
            f"recompute / reload predicted {predicted.speedup:.2f}x, measured {timing.speedup:.2f}x",
        )
    )
    return checks
