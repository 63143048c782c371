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
blocks of full-attention groups keep their hashes, so on re-admission it takes back those not evicted meanwhile
and recomputes only the rest (`BlockManager.num_recomputed_tokens` counts what is prefilled again). Sliding-window
groups keep only the blocks `BlockManager.prefix_cache_retention_interval` retains (by vLLM's default, those
before the prompt's last token), so a model with sliding layers recomputes more.

With `reserve_full_prompt` (vLLM's `scheduler_reserve_full_isl`), a waiting request is admitted only when blocks
for its whole prompt are free, a sliding group counted at most at the window plus the tokens in flight
(`kvlab.engine.block_manager.max_admission_blocks`), as vLLM 0.33.0's `KVCacheManager.allocate_slots` does.

A scheduler that cannot make progress says so instead of spinning. A request that an idle pool (nothing
running) still cannot admit never will be: `schedule` raises `SchedulerStalled` at once, naming the blocks it
needs. As a backstop, `SchedulerConfig.max_idle_steps` bounds the consecutive steps in which no sequence computes
a token beyond the most it had computed before (recomputation after preemption does not count) while work has
arrived; one more raises `SchedulerStalled` too.

After the runner has run a batch, `postprocess` (nano-vllm's) advances each sequence's computed tokens, appends
the sampled tokens, retires sequences that hit eos, `max_tokens` or `max_model_len`, and records the step's
`kvlab.engine.metrics.StepStats`. Whatever runs the batch, a model (`kvlab.engine.model_runner.ModelRunner`) or a step cost
(`kvlab.engine.cost_runner.CostRunner`, the simulator), this one loop decides what happens next. Observers register
callbacks: `on_step` sees every batch that ran, before its tokens are appended; `on_finish` every sequence that
finishes, at that moment (a closed-loop load lets the next request in there).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.metrics import StepStats
from kvlab.engine.request import Request, RequestStatus
from kvlab.units import cdiv

logger = logging.getLogger(__name__)

Scheduling = Literal["continuous", "static"]


class SchedulerStalled(RuntimeError):
    """The scheduler can make no progress: the pool can never admit the request at the head of the queue, or
    `SchedulerConfig.max_idle_steps` steps passed with work waiting and no sequence computing a new token."""


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

    @property
    def max_idle_steps(self) -> int:
        """Steps without progress that a live schedule can need: one preemption-only step per running sequence,
        then the oldest re-admitted sequence recomputing, the whole token budget a step, up to `max_model_len`."""
        return self.max_num_seqs + cdiv(self.max_model_len, self.max_num_batched_tokens) + 2


@dataclass
class ScheduledBatch:
    seqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Each sequence's context once the step has run, recorded as it is scheduled (runners and the clock read it
    # before `Scheduler.postprocess` advances the sequences).
    contexts: list[int] = field(default_factory=list)
    # Sequences whose scheduled tokens stop short of their last token (a prompt chunk): they sample nothing.
    num_partial: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def context_lens(self) -> list[int]:
        """Each sequence's context once the step has run (read before `Scheduler.postprocess` advances it)."""
        return self.contexts

    def _only_last_cut(self) -> bool:
        """Whether the one sequence scheduled short is the batch's last: a token budget cuts at most the last
        sequence it schedules (the usual chunked step), so that needs no scan."""
        return self.num_partial == 1 and self.contexts[-1] < len(self.seqs[-1].token_ids)

    def sampled(self) -> list[Request]:
        """The sequences whose scheduled tokens reach their last token: each samples one, in batch order."""
        if not self.num_partial:
            return list(self.seqs)
        if self._only_last_cut():
            return self.seqs[:-1]
        return [seq for seq, end in zip(self.seqs, self.contexts, strict=True) if end == len(seq.token_ids)]

    def chunks(self) -> list[tuple[Request, int]]:
        """The sequences scheduled short of their last token (prompt chunks: they sample nothing), each with its
        context once the step has run."""
        if not self.num_partial:
            return []
        if self._only_last_cut():
            return [(self.seqs[-1], self.contexts[-1])]
        return [
            (seq, end) for seq, end in zip(self.seqs, self.contexts, strict=True) if end < len(seq.token_ids)
        ]

    def add(self, seq: Request, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        end = seq.num_computed_tokens + num_new_tokens
        self.contexts.append(end)
        if end < len(seq.token_ids):
            self.num_partial += 1

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class RunnerOutput:
    """What a runner returns for a batch: the sequences that sampled a token (each had all its tokens computed by
    the step), their tokens, per sequence its `params.logprobs` best token ids (None when it asked for none;
    the list is None when no sequence did), and the step's modelled seconds where the runner models time (a cost
    runner; None: the step took real time)."""

    seqs: list[Request]
    token_ids: list[int]
    top_token_ids: list[list[int] | None] | None = None
    seconds: float | None = None


class Scheduler:
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
        self.waiting: deque[Request] = deque()  # arrival order; preempted sequences go to the front
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.static_batch: set[int] = set()  # static mode: seq ids of the batch being run
        self.num_preemptions = 0
        self.num_idle_steps = 0  # consecutive steps without progress while work has arrived
        # One row per step that ran; `log_stats=False` skips them (the slot count is costly on long traces).
        self.log_stats = log_stats
        self.step_stats: list[StepStats] = []
        self.on_step: list[Callable[[ScheduledBatch], None]] = []
        self.on_finish: list[Callable[[Request], None]] = []

    def add(self, seq: Request) -> None:
        # Keep the queue in arrival order even when a trace adds requests out of order.
        index = len(self.waiting)
        while index and self.waiting[index - 1].arrival_time > seq.arrival_time:
            index -= 1
        self.waiting.insert(index, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        return min((s.arrival_time for s in self.waiting), default=None)

    def _preempt(self, seq: Request) -> None:
        self.block_manager.free(seq)
        seq.status = RequestStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s at %d tokens (recompute)", seq.request_id, seq.num_tokens)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # Running sequences first, in admission order; victims come off the end.
        # The loop runs once per running sequence per step (the simulator's hot path): names are bound locally.
        running, append_slots = self.running, self.block_manager.append_slots
        num_new_tokens, contexts = batch.num_new_tokens, batch.contexts
        # Preemption pops victims off the end of `running` while this iterates it: the iterator stops before
        # them, as a loop over indices would. What it schedules is a prefix of `running`.
        for seq in running:
            if budget <= 0:
                break
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > budget:
                n = budget
            end = computed + n
            # Below its slot limit a sequence needs no block work (the block manager keeps the limit).
            if end > seq.slot_limit:
                while not append_slots(seq, n):
                    victim = running.pop()
                    self._preempt(victim)
                    batch.preempted.append(victim)
                    if victim is seq:
                        break
                else:
                    victim = None
                if victim is seq:
                    break
            num_new_tokens.append(n)
            contexts.append(end)
            budget -= n
        batch.seqs.extend(running[: len(num_new_tokens)])
        # A sequence cut short by the budget ends the loop: only the last can be a prompt chunk.
        if num_new_tokens and contexts[-1] < len(batch.seqs[-1].token_ids):
            batch.num_partial = 1
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
            reserve = seq.num_tokens if self.config.reserve_full_prompt else 0
            admitted = self.block_manager.allocate(seq, budget, reserve)
            if admitted is None:
                if not self.running:
                    self._raise_unadmittable(seq, budget, reserve)
                break
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            batch.add(seq, admitted)
            budget -= admitted
        if not batch.seqs and (self.running or any(s.arrival_time <= now for s in self.waiting)):
            self._count_idle_step()
        return batch

    def _raise_unadmittable(self, seq: Request, budget: int, reserve: int) -> None:
        """Nothing runs, so every block is free or cached-free: a request refused now is refused forever."""
        bm = self.block_manager
        needed = bm.blocks_to_admit(seq, budget, reserve)
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

    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput, now: float) -> list[Request]:
        """Account for a batch the runner has run, at clock time `now`; returns the sequences it finished."""
        for hook in self.on_step:
            hook(batch)
        progressed = False
        if batch.num_partial:
            # Prompt chunks sample nothing: only their computed tokens advance (the loop below does the rest).
            for seq, end in batch.chunks():
                seq.num_computed_tokens = end
                if end > seq.max_computed_tokens:
                    seq.max_computed_tokens = end
                    progressed = True
        finished = []
        eos, max_model_len = self.eos_token_ids, self.config.max_model_len
        # One pass per sampled token (the simulator's hot path): a sequence samples once all its tokens are in.
        for seq, token in zip(output.seqs, output.token_ids, strict=True):
            token_ids, metrics = seq.token_ids, seq.metrics
            end = len(token_ids)
            seq.num_computed_tokens = end
            if end > seq.max_computed_tokens:
                seq.max_computed_tokens = end
                progressed = True
            token_ids.append(token)
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            # Why it stops, if it does
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
        if seq in self.running:
            self.running.remove(seq)
        for hook in self.on_finish:
            hook(seq)
