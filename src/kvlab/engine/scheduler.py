"""Which requests run at each step, with how many tokens, and each request's progress.

Continuous batching (Yu et al., 2022, Orca, OSDI): every step, running requests first get their next tokens (one
for a decode, a chunk for an unfinished prefill), then arrived waiting requests join while the step stays within
`max_num_seqs` requests and `max_num_batched_tokens` tokens. Static batching admits a new batch only when the
whole previous one has finished, as `model.generate` on a padded batch does. When the pool has no block for a
running request, the last admitted one is preempted by recompute: its blocks are freed, its tokens kept, and it
waits at the front of the queue. The scheduler alone assigns `num_computed_tokens`, the preemption count and the
shared-prefix boundary; the block manager answers with blocks. A request that can never be admitted, or a
schedule that makes no progress within `SchedulerConfig.max_idle_steps`, raises `SchedulerStalled`.
Chapter 8.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.config import SchedulerConfig
from kvlab.engine.metrics import StepStats
from kvlab.engine.outputs import RunnerOutput, ScheduledBatch
from kvlab.engine.request import Request, RequestStatus

__all__ = ["RunnerOutput", "ScheduledBatch", "Scheduler", "SchedulerConfig", "SchedulerStalled"]

logger = logging.getLogger(__name__)


class SchedulerStalled(RuntimeError):
    """The scheduler can make no progress: the pool can never admit the request at the head of the queue, or
    `SchedulerConfig.max_idle_steps` steps passed with work waiting and no request computing a new token."""


class Scheduler:
    """The waiting queue, the running list, and each request's progress (`num_computed_tokens`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        log_stats: bool = True,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()  # arrival order; preempted requests go to the front
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.static_batch: set[int] = set()  # static mode: seq ids of the batch being run
        self.num_preemptions = 0
        self.num_idle_steps = 0  # consecutive steps without progress while work has arrived
        # One row per step that ran; `log_stats=False` skips them (the slot count is costly on long traces).
        self.log_stats = log_stats
        self.step_stats: list[StepStats] = []
        self.on_step: list[Callable[[ScheduledBatch], None]] = []
        self.on_finish: list[Callable[[Request], None]] = []

    def add_request(self, seq: Request) -> None:
        """Queue a request, in arrival order even when a trace adds requests out of order."""
        assert seq.request_id is not None
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already queued or running")
        self.requests[seq.request_id] = seq
        index = len(self.waiting)
        while index and self.waiting[index - 1].arrival_time > seq.arrival_time:
            index -= 1
        self.waiting.insert(index, seq)

    # nano-vllm's name
    add = add_request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)

    def _preempt_request(self, seq: Request) -> None:
        """Preemption by recompute: its blocks go back, its progress restarts, its tokens stay."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.WAITING
        seq.num_preemptions += 1
        seq.metrics.num_preemptions = seq.num_preemptions
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s at %d tokens (recompute)", seq.request_id, seq.num_tokens)

    def schedule(self, now: float) -> ScheduledBatch:
        """The requests to run at clock time `now`: running ones first, then arrived waiting ones."""
        batch = self.new_batch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if batch.preempted:
            if not batch.seqs:
                self._count_idle_step()
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
            n = self._admit(seq, budget)
            if n is None:
                break
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            batch.add(seq, n, self.block_manager.get_block_ids(seq.request_id))
            budget -= n
        if not batch.seqs and (self.running or any(s.arrival_time <= now for s in self.waiting)):
            self._count_idle_step()
        return batch

    def new_batch(self) -> ScheduledBatch:
        return ScheduledBatch()

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Schedule the running requests, in admission order, preempting from the end where blocks run out;
        returns the token budget left."""
        bm, running = self.block_manager, self.running
        # Preemption pops victims off `running` while this iterates it, so the iterator stops before them
        for seq in running:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate_slots(seq, n):
                victim = running.pop()
                self._preempt_request(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is RequestStatus.WAITING:
                break
            batch.add(seq, n, bm.get_block_ids(seq.request_id))
            budget -= n
        return budget

    def _admit(self, seq: Request, budget: int) -> int | None:
        """Give a waiting request its cached prefix and blocks for up to `budget` more tokens; the tokens it
        computes this step, or None when the pool is short (raising if even an idle pool is)."""
        bm = self.block_manager
        hit = bm.get_computed_blocks(seq)
        computed = hit.num_computed_tokens
        # Tokens whose K/V another engine computed count as computed beyond the hit; after a preemption they
        # are recomputed here, as in vLLM.
        external = seq.external if seq.external is not None and not seq.num_preemptions else None
        if external is not None:
            computed = max(computed, external.num_tokens)
        n = min(budget, seq.num_tokens - computed)
        reserve = seq.num_tokens if self.config.reserve_full_prompt else 0
        # Set before the blocks are published: a sliding group keeps its window at the junction
        seq.shared_prefix_boundary = hit.shared_prefix_boundary
        if not bm.allocate_slots(seq, n, computed, hit, reserve):
            if not self.running:
                self._raise_unadmittable(seq, bm.get_num_blocks_to_admit(hit, computed + n, reserve), reserve)
            return None
        seq.num_computed_tokens = computed
        if external is not None:
            external.start = min(hit.num_computed_tokens, external.num_tokens)
        return n

    def _raise_unadmittable(self, seq: Request, needed: int, reserve: int) -> None:
        """Nothing runs, so every block is free or cached-free: a request refused now is refused forever."""
        bm = self.block_manager
        what = "its whole prompt reserved (scheduler_reserve_full_isl)" if reserve else "its first chunk"
        raise SchedulerStalled(
            f"request {seq.request_id} of {seq.num_tokens} tokens can never be admitted: with {what} it needs"
            f" {needed} free blocks and the idle pool has {bm.num_free_blocks} of {bm.num_blocks}"
        )

    def _count_idle_step(self) -> None:
        self.num_idle_steps += 1
        if self.num_idle_steps > self.config.max_idle_steps:
            bm = self.block_manager
            raise SchedulerStalled(
                f"the scheduler made no progress in {self.num_idle_steps} steps (bound {self.config.max_idle_steps}):"
                f" {len(self.running)} running, {len(self.waiting)} waiting,"
                f" {bm.num_free_blocks} of {bm.num_blocks} blocks free"
            )

    def update_from_output(self, batch: ScheduledBatch, output: RunnerOutput, now: float) -> list[Request]:
        """Account for a batch the runner has run, at clock time `now`; returns the requests it finished."""
        for hook in self.on_step:
            hook(batch)
        progressed = False
        # Prompt chunks sample nothing: only their computed tokens advance
        if batch.num_partial:
            for seq, end in batch.chunks():
                progressed = self._advance(seq, end) or progressed
        finished = []
        eos, max_model_len = self.eos_token_ids, self.config.max_model_len
        # Once per sampled token (the planner's hot loop): `_advance` written out
        for seq, token in zip(output.seqs, output.token_ids, strict=True):
            # A request samples once all its tokens are in
            token_ids = seq.token_ids
            end = len(token_ids)
            seq.num_computed_tokens = end
            if end > seq.max_computed_tokens:
                seq.max_computed_tokens = end
                progressed = True
            token_ids.append(token)
            metrics = seq.metrics
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            params = seq.params
            if eos and not params.ignore_eos and token in eos:
                reason = "stop"
            elif end + 1 - seq.num_prompt_tokens >= params.max_tokens or end + 1 >= max_model_len:
                reason = "length"
            else:
                continue
            metrics.finish_time = now
            self.finish(seq, reason)
            finished.append(seq)
        if output.top_token_ids is not None:
            for seq, top in zip(output.seqs, output.top_token_ids, strict=True):
                if top is not None:
                    seq.top_token_ids.append(top)
        if progressed:
            self.num_idle_steps = 0
        else:
            self._count_idle_step()
        if self.log_stats:
            self._record(batch, now)
        return finished

    @staticmethod
    def _advance(seq: Request, end: int) -> bool:
        """Count the request's first `end` tokens computed; whether that passes the most it ever had."""
        seq.num_computed_tokens = end
        if end > seq.max_computed_tokens:
            seq.max_computed_tokens = end
            return True
        return False

    def _record(self, batch: ScheduledBatch, now: float) -> None:
        bm = self.block_manager
        self.step_stats.append(
            StepStats(
                step=len(self.step_stats),
                time=now,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                num_batched_tokens=batch.num_batched_tokens,
                num_prefill_tokens=sum(n for n in batch.num_new_tokens if n > 1),
                num_decode_seqs=sum(n == 1 for n in batch.num_new_tokens),
                num_preempted=len(batch.preempted),
                blocks_used=bm.num_used_blocks,
                used_token_slots=bm.used_token_slots(self.running),
                reserved_token_slots=bm.num_used_blocks * bm.block_size,
            )
        )

    def finish(self, seq: Request, reason: str) -> None:
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.requests.pop(str(seq.request_id), None)
        if seq in self.running:
            self.running.remove(seq)
        for hook in self.on_finish:
            hook(seq)
