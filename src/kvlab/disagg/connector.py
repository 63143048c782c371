"""Moving a prompt's K/V from a prefill engine to a decode engine, in one process: the two halves of a KV connector.

A prefill instance runs each request to its first token (`max_tokens=1`). `KVCapture` hooks its scheduler and,
at the step that completes a prompt, copies the prompt's K/V out of the pool (`KVPool.read_tokens`), before the
request finishes and its blocks return to the free queue. `Prefilled` is what travels: the prompt, the token the
prefill sampled, and that K/V. On the decode instance, `Request.prefilled` turns it into a request whose prompt
tokens count as computed once admitted; the runner writes the K/V into the blocks the block manager gave them
(past any prefix the decode instance had cached), and the first step computes the prefill's token. Greedy tokens
then equal one engine's (`tests/test_disagg.py`).

What differs from vLLM 0.33's NIXL connector: it moves whole blocks and the decode side pulls them, while this
sends exactly the prompt's tokens, so the bytes per request equal `kvlab.specs.sizing.kv_cache_bytes` for the
prompt. And vLLM's decode instance computes the prompt's last token again for its logits
(`Scheduler._update_waiting_for_remote_kv` steps back one token when the loaded blocks hold them all), so the
user's first token comes from the decode instance and the prefill's is dropped; here the prefill's token travels
with the K/V, and the decode instance's first step computes the second. The tokens are the same either way.
`kvlab.disagg.pd` runs the two engines as two processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.engine.llm_engine import LLMEngine, RequestOutput
from kvlab.engine.outputs import ScheduledBatch
from kvlab.engine.request import Request, SamplingParams


@dataclass
class Prefilled:
    """One request after prefill: its prompt, the first token, why prefill alone finished it ("stop" for eos,
    "length" when one token was all it asked for; None when decode goes on), and the prompt's K/V
    `(layers, 2, prompt tokens, kv_heads, head_dim)` (None when finished)."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    finish_reason: str | None
    kv: torch.Tensor | None

    @property
    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


class KVCapture:
    """Keeps, per request id, a copy of each prompt's K/V from `engine`'s pool at the step that completes it."""

    def __init__(self, engine: LLMEngine) -> None:
        if engine.pool is None:
            raise ValueError("a prefill engine needs a model runner with a KV pool")
        self.pool = engine.pool
        self.kv: dict[str, torch.Tensor] = {}
        engine.scheduler.on_step.append(self._on_step)

    def _on_step(self, batch: ScheduledBatch) -> None:
        # Runs after the forward wrote the step's K/V and before update_from_output frees finished requests' blocks.
        for seq, end, tables in zip(batch.seqs, batch.contexts, batch.block_tables, strict=True):
            if end == seq.num_prompt_tokens == len(seq.token_ids):
                self.kv[str(seq.request_id)] = self.pool.read_tokens(tables[0], 0, end)

    def take(self, out: RequestOutput, params: SamplingParams) -> Prefilled:
        """A request the prefill engine has finished, as it travels: with its prompt's K/V (handed over, not
        kept here) unless prefill alone finished it (eos, or one token asked for)."""
        if out.finish_reason == "error":
            raise ValueError(f"prefill of {out.request_id} failed: {out.error}")
        done = out.finish_reason if out.finish_reason == "stop" or params.max_tokens == 1 else None
        kv = None if done else self.kv.pop(out.request_id)
        return Prefilled(out.request_id, out.prompt_token_ids, out.token_ids[0], done, kv)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What the prefill instance runs a request with: greedy, one token (vLLM's P/D proxy sends max_tokens=1)."""
    if params.temperature != 0:
        raise ValueError("disaggregated runs are greedy here (temperature 0): sampled tokens would not match")
    return dataclasses.replace(params, max_tokens=1)


def to_decode_request(item: Prefilled, params: SamplingParams, arrival_time: float) -> Request:
    """The decode instance's request for a prefilled one (not for one that prefill finished)."""
    if item.kv is None or item.finish_reason is not None:
        raise ValueError(f"request {item.request_id} finished at prefill; nothing to decode")
    return Request.prefilled(
        item.prompt_token_ids,
        item.first_token,
        item.kv,
        params,
        arrival_time=arrival_time,
        request_id=item.request_id,
    )


def prefill_all(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[Prefilled]:
    """Prefill every prompt on `engine` (continuous batching, its own settings); results in prompt order."""
    capture = KVCapture(engine)
    first = prefill_params(params)
    seqs = [engine.add_request(list(p), first, request_id=f"req-{i}") for i, p in enumerate(prompts)]
    return [capture.take(out, params) for out in engine.run_until_done(seqs)]


def decode_all(engine: LLMEngine, items: Sequence[Prefilled], params: SamplingParams) -> list[list[int]]:
    """Decode every prefilled request on `engine`; each request's generated tokens (the prefill's first)."""
    seqs = {
        item.request_id: engine.enqueue(to_decode_request(item, params, engine.clock.now()))
        for item in items
        if item.finish_reason is None
    }
    outputs = {out.request_id: out for out in engine.run_until_done(list(seqs.values()))}
    return [outputs[i.request_id].token_ids if i.request_id in outputs else [i.first_token] for i in items]
