"""Which sequences run at each step, and with how many tokens.

Continuous batching (Yu et al., 2022, Orca, OSDI): every step, running sequences first get their next tokens
(one for decode, a chunk for an unfinished prefill), then waiting requests that have arrived join while the step
stays within `max_num_seqs` sequences and `max_num_batched_tokens` tokens. Prompts longer than the token budget are
prefilled in chunks across steps (chunked prefill). Static batching runs the same loop but admits a new batch
only when the whole previous batch has finished, as `model.generate` on a padded batch does.

When the pool has no block for a running sequence, the most recently admitted running sequence is preempted by
recompute, the only preemption mode of vLLM v1 (vLLM 0.33.0 `vllm/v1/core/sched/scheduler.py`; swapping to CPU
and `--swap-space` are gone): its blocks are freed, its tokens kept, and it goes back to the front of the queue,
to be prefilled again, prompt plus output so far, when memory allows. With prefix caching on, its freed full
blocks keep their hashes, so on re-admission it takes back those not evicted meanwhile and recomputes only the
rest (`BlockManager.num_recomputed_tokens` counts what is prefilled again).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kvlab.block_manager import BlockManager
from kvlab.sequence import Sequence, Status

logger = logging.getLogger(__name__)

Scheduling = Literal["continuous", "static"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    scheduling: Scheduling = "continuous"
    enable_chunked_prefill: bool = True
    reserve_full_prompt: bool = False  # vLLM's scheduler_reserve_full_isl

    def __post_init__(self) -> None:
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()  # arrival order; preempted sequences go to the front
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.static_batch: set[int] = set()  # static mode: seq ids of the batch being run
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        # Keep the queue in arrival order even when a trace adds requests out of order.
        index = len(self.waiting)
        while index and self.waiting[index - 1].arrival_time > seq.arrival_time:
            index -= 1
        self.waiting.insert(index, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s at %d tokens (recompute)", seq.request_id, seq.num_tokens)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # Running sequences first, in admission order; victims come off the end.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.append_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                index += 1
                continue
            break
        if batch.preempted:
            return batch  # memory is short: admit nobody this step
        if self.config.scheduling == "static":
            if not self.running and not (self.static_batch & {s.seq_id for s in self.waiting}):
                arrived = [s for s in self.waiting if s.arrival_time <= now]
                self.static_batch = {s.seq_id for s in arrived[: self.config.max_num_seqs]}
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.arrival_time > now:
                break
            if self.config.scheduling == "static" and seq.seq_id not in self.static_batch:
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            reserve = seq.num_tokens if self.config.reserve_full_prompt else 0
            admitted = self.block_manager.allocate(seq, budget, reserve)
            if admitted is None:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(admitted)
            budget -= admitted
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
