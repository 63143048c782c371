"""`CostRunner`: a runner that runs no model, for the simulator: each batch costs what a step cost model says.

`LLMEngine(runner=CostRunner(cost, num_blocks), clock=VirtualClock())` is the serving simulator
(`kvlab.planning.simulate.simulate`): the engine's own scheduler, block manager and step loop, with the forward pass
replaced by `cost(num_new_tokens, context_lens)` seconds (a `kvlab.planning.simulate.StepCost`), which the virtual clock
charges. Each sequence whose scheduled tokens reach its end "samples" a placeholder token, one per sequence, so
that no two requests' outputs look like a shared prefix (a block's hash chains its whole prefix, so a repeated
token within one output shares nothing either); requests are meant to ignore eos and run to their `max_tokens`,
as in vLLM's serving benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.engine.kv_pool import KVPool
from kvlab.engine.request import Request
from kvlab.engine.scheduler import RunnerOutput, ScheduledBatch


class _Placeholders(dict[Request, int]):
    """Each sequence's placeholder token, made on first lookup."""

    def __missing__(self, seq: Request) -> int:
        token = self[seq] = 2 + seq.seq_id % 1_000_003
        return token


class CostRunner:
    """A pool of `num_blocks` blocks with no tensors behind it, one full-attention KV-cache group, no eos, and a
    context limit of `max_model_len` (None: what the pool holds). `step_seconds` keeps each batch's cost."""

    def __init__(
        self,
        cost: Callable[[Sequence[int], Sequence[int]], float],
        num_blocks: int,
        max_model_len: int | None = None,
    ) -> None:
        self.cost = cost
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.windows: list[int | None] = [None]
        self.eos_token_ids: frozenset[int] = frozenset()
        self.pool: KVPool | None = None
        self.step_seconds: list[float] = []
        # Each running sequence's placeholder token: one int object per sequence, not one per output token
        # (20,000 requests of a few hundred tokens would otherwise hold millions of them).
        self._placeholder = _Placeholders()

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        contexts = batch.context_lens()
        seconds = float(self.cost(batch.num_new_tokens, contexts))
        self.step_seconds.append(seconds)
        sampled = batch.sampled()
        # map() over the dict's own lookup runs in C: this is once per sequence per step.
        return RunnerOutput(sampled, list(map(self._placeholder.__getitem__, sampled)), None, seconds)

    def release(self, seq: Request) -> None:
        """Forget the sequence's placeholder token."""
        self._placeholder.pop(seq, None)
