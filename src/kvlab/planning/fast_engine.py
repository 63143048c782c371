"""The simulator's engine: `kvlab.engine.LLMEngine` with the shortcuts a 20,000-request plan needs.

A plan replays tens of thousands of requests through the engine's own scheduler on a `CostRunner`, several
times, so the serving loop's per-request work is the planner's whole cost. These subclasses take the same
decisions as the engine the chapters show, with less work per step:

- `FastBlockManager` keeps, for a model of one full-attention group, each request's slot limit (the tokens its
  blocks hold before a step needs new blocks or fills one); `FastScheduler` skips `allocate_slots` below it
  and fills the batch's lists in place.
- `FastBatch` finds the one prompt chunk without a scan (a token budget cuts at most the last request) and keeps
  no block tables, which a cost runner never reads.
- `PlaceholderRunner` keeps one placeholder token object per request, not one per output token.
`FastEngine` is the engine built from them; its results equal the general engine's to the bit
(tests/test_simulate.py). Chapter 14.
"""

from __future__ import annotations

from typing import Any

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.cost_runner import CostRunner, placeholder_token
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.outputs import BlockTables, RunnerOutput, ScheduledBatch
from kvlab.engine.request import Request
from kvlab.engine.scheduler import Scheduler
from kvlab.units import cdiv


class FastBlockManager(BlockManager):
    """`BlockManager` that also keeps each request's slot limit when the model has one full-attention group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.single_full_group = self.windows == [None]
        self.slot_limit: dict[str, int] = {}

    def _grow(self, request: Request, start: int, end: int) -> bool:
        """With one full-attention group: nothing behind a window to free, one table to grow, the blocks it
        fills published, and the request's new slot limit kept."""
        if not self.single_full_group:
            return super()._grow(request, start, end)
        manager, bs, rid = self.managers[0], self.block_size, str(request.request_id)
        table = manager.req_to_blocks[rid]
        missing = cdiv(end, bs) - len(table)
        if missing > 0:
            if missing > self.block_pool.num_free_blocks:
                return False
            table += self.block_pool.get_new_blocks(missing)
        if self.enable_prefix_caching:
            manager.cache_blocks(request, end)
        held = len(table) * bs
        # With caching, a step that fills a block must come back, so that its block is published
        self.slot_limit[rid] = min(held, (end // bs + 1) * bs - 1) if self.enable_prefix_caching else held
        return True

    def free(self, request: Request) -> None:
        super().free(request)
        self.slot_limit.pop(str(request.request_id), None)


class FastBatch(ScheduledBatch):
    """A batch in which only the last request can be a prompt chunk cut by the budget; no block tables."""

    def add(self, seq: Request, num_new_tokens: int, block_tables: BlockTables) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        end = seq.num_computed_tokens + num_new_tokens
        self.contexts.append(end)
        if end < len(seq.token_ids):
            self.num_partial += 1

    def _only_last_cut(self) -> bool:
        return self.num_partial == 1 and self.contexts[-1] < len(self.seqs[-1].token_ids)

    def sampled(self) -> list[Request]:
        if self.num_partial and self._only_last_cut():
            return self.seqs[:-1]
        return super().sampled()

    def chunks(self) -> list[tuple[Request, int]]:
        if self.num_partial and self._only_last_cut():
            return [(self.seqs[-1], self.contexts[-1])]
        return super().chunks()


class FastScheduler(Scheduler):
    """`Scheduler` whose running loop skips the block work a step below a request's slot limit does not need."""

    def new_batch(self) -> ScheduledBatch:
        return FastBatch()

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        if not isinstance(bm, FastBlockManager) or not bm.single_full_group:
            return super()._schedule_running(batch, budget)
        # Once per running request per step: names are bound locally
        running, allocate_slots, limit = self.running, bm.allocate_slots, bm.slot_limit.get
        num_new_tokens, contexts = batch.num_new_tokens, batch.contexts
        for seq in running:
            if budget <= 0:
                break
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > budget:
                n = budget
            end = computed + n
            if end > limit(seq.request_id, 0):  # type: ignore[arg-type]
                while not allocate_slots(seq, n):
                    victim = running.pop()
                    self._preempt_request(victim)
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
        # A request cut short by the budget ends the loop: only the last can be a prompt chunk
        if num_new_tokens and contexts[-1] < len(batch.seqs[-1].token_ids):
            batch.num_partial = 1
        return budget


class _Placeholders(dict[Request, int]):
    """Each request's placeholder token, made on first lookup."""

    def __missing__(self, seq: Request) -> int:
        token = self[seq] = placeholder_token(seq)
        return token


class PlaceholderRunner(CostRunner):
    """`CostRunner` that keeps one placeholder token object per running request: 20,000 requests of a few
    hundred tokens would otherwise hold millions of int objects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._placeholder = _Placeholders()

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        seconds = float(self.cost(batch.num_new_tokens, batch.context_lens()))
        self.step_seconds.append(seconds)
        sampled = batch.sampled()
        # map() over the dict's own lookup runs in C: this is once per request per step
        return RunnerOutput(sampled, list(map(self._placeholder.__getitem__, sampled)), None, seconds)

    def release(self, seq: Request) -> None:
        self._placeholder.pop(seq, None)


class FastEngine(LLMEngine):
    """`LLMEngine` on `FastBlockManager` and `FastScheduler` (give it a `PlaceholderRunner`)."""

    block_manager_cls = FastBlockManager
    scheduler_cls = FastScheduler
