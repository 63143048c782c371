"""Decoding with and without the cache: same tokens, very different work.

`greedy_decode` runs the plain generation loop by hand (no `generate` helpers) so the lab can show both
paths: with a `DynamicCache`, each step feeds only the new token; without, each step re-feeds the whole
history and recomputes every layer's K and V. `step_cost` measures one step of each at a given history length,
in FLOPs (counted by `torch.utils.flop_counter`) and in seconds.
Chapter: *What the KV cache holds* (book/01_cache_contents).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache, PreTrainedModel

from kvlab.agreement import top_k_ids
from kvlab.measure import cache_tensor_bytes, time_call
from kvlab.timing import measure_decode_step, random_ids
from kvlab.units import format_bytes


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated ids per sequence
    logits: torch.Tensor  # (batch, new_tokens, vocab): the logits each step sampled from
    cache: DynamicCache | None = None
    cache_bytes_per_step: list[int] = field(default_factory=list)

    def top_token_ids(self, k: int) -> list[list[list[int]]]:
        """Per sequence and step, the ids of the `k` largest logits, the greedy token first
        (`kvlab.agreement.top_k_ids`): one side of a `check_tokens_close`."""
        return [
            top_k_ids(step_logits, k, first=tokens)
            for step_logits, tokens in zip(self.logits, self.tokens, strict=True)
        ]


@torch.inference_mode()
def greedy_decode(
    model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True
) -> DecodeResult:
    """Greedy generation of `max_new_tokens` for a (batch, prompt_len) tensor of ids, with or without cache."""

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not use_cache:  # the last step recomputes the prompt and every token but the newest
        check_uncached_step_fits(model, input_ids.shape[1] + max_new_tokens - 2, input_ids.shape[0])
    ids = input_ids.to(model.device)
    cache = DynamicCache(config=model.config) if use_cache else None
    step_input, history = ids, ids
    steps_logits, cache_bytes = [], []
    for _ in range(max_new_tokens):
        if use_cache:
            out = model(step_input, cache=cache, use_cache=True)
            cache_bytes.append(cache_tensor_bytes(cache))
        else:
            out = model(history, use_cache=False)
        logits = out.logits[:, -1, :].float()
        next_token = logits.argmax(dim=-1, keepdim=True)
        steps_logits.append(logits)
        history = torch.cat([history, next_token], dim=1)
        step_input = next_token
    generated = history[:, ids.shape[1] :]
    return DecodeResult(generated.tolist(), torch.stack(steps_logits, dim=1).cpu(), cache, cache_bytes)


EAGER_SCORE_COPIES = (
    2  # eager attention holds a layer's scores and their softmax at once (peak ≈ 2.2× on CPU)
)
MEMORY_HEADROOM = (
    0.8  # share of the free memory a planned forward may take; the rest is activations and logits
)


def eager_scores_bytes(model: PreTrainedModel, tokens: int, batch_size: int = 1) -> int:
    """Bytes eager attention holds at once in one layer of a `tokens`-token forward without a cache: the
    (batch, heads, tokens, tokens) scores and their softmax, fp32 (transformers' eager softmax runs in fp32)."""
    heads = int(model.config.get_text_config().num_attention_heads)
    return EAGER_SCORE_COPIES * batch_size * heads * tokens * tokens * 4


def free_memory_bytes(device: torch.device) -> int | None:
    """Free bytes on `device`: the CUDA driver's figure, or Linux's MemAvailable on CPU (None if unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_uncached_step_fits(model: PreTrainedModel, history: int, batch_size: int = 1) -> None:
    """Raise a clear MemoryError, before running anything, when recomputing `history + 1` positions with eager
    attention would not fit the device's free memory (its score matrices grow with the square of the history)."""
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return  # fused attention (sdpa, flash) never holds the whole score matrix
    device = next(model.parameters()).device
    free = free_memory_bytes(device)
    need = eager_scores_bytes(model, history + 1, batch_size)
    if free is not None and need > MEMORY_HEADROOM * free:
        heads = model.config.get_text_config().num_attention_heads
        raise MemoryError(
            f"an uncached step at history {history} needs about {format_bytes(need)} of eager attention scores "
            f"({EAGER_SCORE_COPIES} copies × batch {batch_size} × {heads} heads × {history + 1}² × 4 B) and "
            f"{device} has {format_bytes(free)} free: lower the history (memory grows with its square) or "
            f"the heads, or build the model with attn_implementation='sdpa'"
        )


@dataclass(frozen=True)
class StepCost:
    history: int  # tokens already in the context before this step
    cached_flops: int
    uncached_flops: int
    cached_seconds: float  # fastest of the repeats: least disturbed by other work on the machine
    uncached_seconds: float


@torch.inference_mode()
def step_cost(
    model: PreTrainedModel, history: int, batch_size: int = 1, repeat: int = 5, seed: int = 0
) -> StepCost:
    """Cost of producing token `history + 1`: from a cache of `history` tokens, or from scratch."""
    if history < 1:
        raise ValueError(f"history must be >= 1, got {history}")
    check_uncached_step_fits(model, history, batch_size)
    # The same seeded ids as the timed cached step below, so FLOPs and time describe one computation.
    ids = random_ids(model, batch_size, history + 1, seed)
    device = ids.device
    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], cache=cache, use_cache=True)
    flops = []
    for step in (
        lambda: model(ids[:, -1:], cache=cache, use_cache=True),
        lambda: model(ids, use_cache=False),
    ):
        with FlopCounterMode(display=False) as counter:
            step()
        flops.append(counter.get_total_flops())
    # The cached step's time is the decode step `kvlab.timing` measures; the uncached one re-runs everything.
    cached = measure_decode_step(model, batch_size, history + 1, repeat=repeat, warmup=1, seed=seed).best_s
    uncached = min(time_call(lambda: model(ids, use_cache=False), device, repeat=repeat, warmup=1))
    return StepCost(history, flops[0], flops[1], cached, uncached)


WORK_DOMINATES = 4  # a step taking this many times the fixed per-step overhead is at least 3/4 work


def work_dominated(costs: list[StepCost], overhead_s: float) -> list[StepCost]:
    """The measured steps whose uncached (recomputing) time is at least `WORK_DOMINATES` × the device's fixed
    per-step overhead (`kvlab.timing.measure_step_overhead`): where recomputation's work, not launches and
    dispatch, sets the time, so the cache's saving can show in seconds."""
    if overhead_s < 0:
        raise ValueError(f"overhead_s must be >= 0, got {overhead_s}")
    return [c for c in costs if c.uncached_seconds >= WORK_DOMINATES * overhead_s]
