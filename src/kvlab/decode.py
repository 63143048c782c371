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
