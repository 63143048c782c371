"""The decode loop over an offloaded cache, timed: lockstep decoding, the in-memory reference, the tier re-timed.

`decode_lockstep` decodes one prompt greedily with several caches, their steps interleaved, so that a slow
spell of the machine lands on all of them alike. `time_offload` runs the offloaded loop in lockstep with an
in-memory one (`memory_reference`) and, after every step, repeats alone the two things in which they differ: the
in-memory layers' appends to the histories of the layers that are offloaded (`SyncedLayer.reappend`; an
offloaded layer does not concatenate, and counting that copy in the compute term as well made the prediction
3-6 % high), and the offloaded layers' tier work (`OffloadedCache.reread`): the bandwidth the tier delivers with
the loop's own requests, under the same load, the first copy out of the delivered bytes included. On a CPU,
steps are timed in thread CPU time (`kvlab.measure.step_clock`; disk reads are polled, so the thread runs, and
is charged, while the drive works). transformers' own `DynamicCache(offloading=True)` (GPU only) prefetches the
next layer on a side stream and overlaps; the lab compares against it where a GPU is present.
Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from kvlab.checks import check_count
from kvlab.measure import step_clock
from kvlab.offload.cache import DiskLayer, OffloadedCache, check_layers, device_sync
from kvlab.offload.tiers import TierBandwidth


@dataclass
class DecodeRun:
    # generated ids per sequence
    tokens: list[list[int]]
    # seconds of each decode step (not the prefill)
    step_s: list[float]
    prefill_s: float
    # (batch, steps, vocab), the last position's logits at each step
    logits: torch.Tensor

    @property
    def median_step_s(self) -> float:
        return median(self.step_s)


@torch.inference_mode()
def timed_decode(
    model: Any, input_ids: torch.Tensor, new_tokens: int, cache: Cache | None = None
) -> DecodeRun:
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
    check_count("new_tokens", new_tokens, 1)
    if not caches:
        raise ValueError("decode_lockstep needs at least one cache")
    device = model.device
    sync = device_sync(device)
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
        sync = device_sync(device)
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
    for index in check_layers(offload_layers, count):
        cache.layers[index] = SyncedLayer()
    return cache


@dataclass
class OffloadTiming:
    """One context's offload measurement: the in-memory and offloaded loops in lockstep, and after every step, under
    the same load, the in-memory layers' appends (`SyncedLayer.reappend`) and the offloaded layers' tier work
    (`OffloadedCache.reread`) repeated alone."""

    context: int
    # the in-memory reference (`memory_reference`)
    memory: DecodeRun
    offloaded: DecodeRun
    # bytes each repeated transfer moved
    transfer_bytes: list[int]
    # seconds each took
    transfer_s: list[float]
    # seconds of the reference's appends to the offloaded layers' histories, repeated
    append_s: list[float]
    # bytes of the offloaded layers on disk at the last step (tier "disk"; else 0)
    disk_bytes: int
    # further caches decoded in lockstep
    others: list[DecodeRun] = field(default_factory=list)

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
    GPU none (the host thread does not compute there; it waits on the device). That computing reads once the
    weights of the layer before each offloaded one (`layer_weights`), as the step does there: with a stand-in
    that stayed in the L1 cache, each repeated access found its buffers still cached and ran 50-90 us per layer
    faster than in the step, on the CPU that built this book, and the prediction fell 4-8 % short of the step at
    short contexts.
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
    by_layer = layer_weights(model)
    # before each offloaded layer's access the step has just read the layer before it
    weights = [by_layer.get(index - 1, []) for index in cache.offload_layers] if by_layer else []

    def repeat_transfers(step_s: list[float]) -> None:
        memory_steps.append(step_s[0])
        appends.append(sum(layer.reappend(clock) for layer in synced))
        burst = compute_s
        if burst is None:
            burst = 0.0 if device.type == "cuda" else median(memory_steps) / layers
        nbytes, s = cache.reread(burst, clock, weights)
        moved.append(nbytes)
        seconds.append(s)

    runs = decode_lockstep(
        model, input_ids, new_tokens, [memory, cache, *others], after_step=repeat_transfers, clock=clock
    )
    disk_bytes = sum(layer.disk_bytes for layer in cache.layers if isinstance(layer, DiskLayer))
    return OffloadTiming(input_ids.shape[1], runs[0], runs[1], moved, seconds, appends, disk_bytes, runs[2:])


def layer_weights(model: Any) -> dict[int, list[torch.Tensor]]:
    """Each decoder layer's weights, by layer index: the parameters named `...layers.N...`, as transformers'
    decoders name them (empty for a model that names them otherwise)."""
    layers: dict[int, list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        for before, index in zip(parts, parts[1:], strict=False):
            if before == "layers" and index.isdigit():
                layers.setdefault(int(index), []).append(param.detach())
                break
    return layers


def random_prompt(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """`batch` prompts of `length` ids drawn from [2, vocab_size), seeded by `seed + length`: the same prompt
    at a given length in every run."""
    generator = torch.Generator().manual_seed(seed + length)
    return torch.randint(2, vocab_size, (batch, length), generator=generator)
