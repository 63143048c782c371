"""`LLMEngine`: a small vLLM on a transformers model, for measuring paging, batching and prefix caching.

Split the way nano-vllm and vLLM are: an `EngineConfig` (`kvlab.config`) holds the knobs; the `Scheduler` decides
which sequences run and with how many tokens; the `ModelRunner` (`kvlab.model_runner`) owns the KV pool, runs the
model through the paged attention (`kvlab.paging`) and samples; `LLMEngine` is the loop between them. Each `step()`
schedules a batch, runs it, appends the sampled tokens, and retires finished requests. Greedy outputs equal
`model.generate`'s in fp32 (the tests prove it, with preemption and prefix caching too). `step_stats` keeps one
`kvlab.metrics.StepStats` row per step (running sequences, blocks in use, batched tokens, KV utilisation) for the
book's occupancy plots; each output carries its request's latency metrics. Read-only properties report what the
scheduler and the block manager count (`num_preemptions`, `prefix_cache_stats`, blocks in use and cached).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedModel

from kvlab.block_manager import BlockManager, ContiguousBlockManager
from kvlab.clock import Clock, VirtualClock, WallClock
from kvlab.config import EngineConfig
from kvlab.metrics import (
    PrefixCacheStats,
    RequestMetrics,
    StepStats,
    blocks_for,
    mean_batch_occupancy,
    mean_kv_utilisation,
    measured_fragmentation,
)
from kvlab.model_runner import ModelRunner
from kvlab.paging import KVPool
from kvlab.scheduler import ScheduledBatch, Scheduler
from kvlab.sequence import SamplingParams
from kvlab.sequence import Sequence as Seq
from kvlab.units import format_bytes
from kvlab.workloads import TraceRequest

# The step statistics moved to kvlab.metrics; importing them from here keeps working.
__all__ = [
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "StepStats",
    "mean_batch_occupancy",
    "mean_kv_utilisation",
    "measured_fragmentation",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids
    finish_reason: str | None  # "stop", "length" or "error"
    metrics: RequestMetrics
    error: str | None = None


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.get_text_config().eos_token_id if eos is None else eos
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class LLMEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig | None = None,
        *,
        clock: Literal["wall", "virtual"] | Clock = "wall",
        **knobs: Any,
    ) -> None:
        """`LLMEngine(model, block_size=16, num_blocks=..., ...)` with any `EngineConfig` field as a keyword, or
        `LLMEngine(model, EngineConfig(...))`; keywords given with a config override its fields."""
        config = EngineConfig(**knobs) if config is None else dataclasses.replace(config, **knobs)
        self.config = config
        self.model = model
        self.model_runner = ModelRunner(model, config)
        num_blocks, block_size = self.model_runner.pool.num_blocks, config.block_size
        limit = model.config.get_text_config().max_position_embeddings
        max_model_len = config.max_model_len
        max_model_len = min(limit, num_blocks * block_size) if max_model_len is None else max_model_len
        if max_model_len > num_blocks * block_size:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the pool ({num_blocks} blocks × {block_size} tokens)"
            )
        self.max_model_len = max_model_len
        if config.kv_layout == "contiguous":
            self.block_manager: BlockManager = ContiguousBlockManager(num_blocks, block_size, max_model_len)
        else:
            self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(max_model_len), self.block_manager)
        self.clock: Clock = (
            {"wall": WallClock, "virtual": VirtualClock}[clock]() if isinstance(clock, str) else clock
        )
        self.eos_token_ids = _eos_ids(model)
        self.step_stats: list[StepStats] = []
        self._rejected: list[Seq] = []  # reported by the next step()
        logger.info(
            "KV cache: %d blocks × %d tokens = %d tokens (%s, %s per token); layout %s",
            num_blocks,
            block_size,
            num_blocks * block_size,
            format_bytes(self.kv_cache_bytes),
            format_bytes(self.kv_bytes_per_token),
            config.kv_layout,
        )
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx",
            max_model_len,
            self.max_concurrency(max_model_len),
        )

    # --- what the engine holds, read-only -----------------------------------------------------------------------

    @property
    def pool(self) -> KVPool:
        return self.model_runner.pool

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model_runner.kv_bytes_per_token

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the preallocated KV pool."""
        return self.model_runner.pool.nbytes

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix, in use or free but not yet evicted."""
        return self.block_manager.num_cached_blocks

    @property
    def num_preemptions(self) -> int:
        """Preemptions by recompute since the engine started."""
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups so far, each request counted once (all zero without prefix caching)."""
        return self.block_manager.prefix_cache_stats

    def max_concurrency(self, context_len: int) -> float:
        """How many requests of `context_len` tokens the pool holds at once (vLLM's startup figure)."""
        return self.block_manager.num_blocks / blocks_for(context_len, self.block_size)

    # --- requests -----------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        request_id: str | None = None,
    ) -> Seq:
        """Queue a request; `arrival_time` (clock seconds) may lie in the future, for trace replay.

        A prompt that can never fit (not shorter than `max_model_len`, which the pool bounds) finishes at once with
        `finish_reason="error"` instead of waiting forever.
        """
        now = self.clock.now()
        seq = Seq(
            list(prompt_token_ids),
            params or SamplingParams(),
            now if arrival_time is None else arrival_time,
            request_id,
        )
        if seq.num_tokens >= self.max_model_len:
            seq.error = (
                f"prompt of {seq.num_tokens} tokens does not fit: max_model_len is {self.max_model_len} "
                f"(pool {self.block_manager.capacity_tokens} tokens)"
            )
            logger.warning("request %s rejected: %s", seq.request_id, seq.error)
            seq.metrics.finish_time = seq.arrival_time
            self.scheduler.finish(seq, "error")
            self._rejected.append(seq)
        else:
            self.scheduler.add(seq)
        return seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests that finished in it (or were rejected since)."""
        finished = [self._output(s) for s in self._rejected]
        self._rejected.clear()
        now = self.clock.now()
        batch = self.scheduler.schedule(now)
        if not batch.seqs:
            upcoming = self.scheduler.next_arrival()
            if upcoming is not None and upcoming > now:
                self.clock.wait_until(upcoming)
            return finished
        sampled, tokens = self.model_runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        self.clock.step_done(batch.num_batched_tokens, sum(s.num_computed_tokens for s in batch.seqs))
        now = self.clock.now()
        for seq, token in zip(sampled, tokens, strict=True):
            seq.token_ids.append(token)
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            reason = self._finish_reason(seq, token)
            if reason:
                seq.metrics.finish_time = now
                self.scheduler.finish(seq, reason)
                finished.append(self._output(seq))
        self._record(batch, now)
        return finished

    def _finish_reason(self, seq: Seq, token: int) -> str | None:
        if not seq.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Seq) -> RequestOutput:
        self.model_runner.release(seq)
        return RequestOutput(
            seq.request_id,
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.finish_reason,
            seq.metrics,
            seq.error,
        )

    def _record(self, batch: ScheduledBatch, now: float) -> None:
        bm = self.block_manager
        prefill = sum(n for n in batch.num_new_tokens if n > 1)
        self.step_stats.append(
            StepStats(
                step=len(self.step_stats),
                time=now,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_batched_tokens=batch.num_batched_tokens,
                num_prefill_tokens=prefill,
                num_decode_seqs=sum(n == 1 for n in batch.num_new_tokens),
                num_preempted=len(batch.preempted),
                blocks_used=bm.num_used_blocks,
                used_token_slots=bm.used_token_slots(self.scheduler.running),
                reserved_token_slots=bm.num_used_blocks * self.block_size,
            )
        )

    # --- whole workloads ----------------------------------------------------------------------------------------

    def run_until_done(self, requests: Iterable[Seq] | None = None) -> list[RequestOutput]:
        """Step until `requests` (default: everything queued) have finished; their outputs in the order given."""
        seqs = list(requests) if requests is not None else [*self.scheduler.waiting, *self.scheduler.running]
        while not all(s.is_finished for s in seqs):
            self.step()
        return [self._output(s) for s in seqs]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for a list of token-id prompts, in prompt order."""
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        return self.run_until_done(seqs)

    def replay(self, trace: Iterable[TraceRequest]) -> list[RequestOutput]:
        """Replay a trace: each request arrives at its `arrival_time` after now; outputs in trace order."""
        start = self.clock.now()
        seqs = [
            self.add_request(
                r.prompt_token_ids,
                SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                arrival_time=start + r.arrival_time,
            )
            for r in trace
        ]
        return self.run_until_done(seqs)
