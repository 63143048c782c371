"""`CostRunner`: a runner that runs no model, for the simulator: each batch costs what a step cost model says.

`LLMEngine(runner=CostRunner(cost, num_blocks), clock=VirtualClock())` is the serving simulator
(`kvlab.planning.simulate.simulate`): the engine's own scheduler, KV-cache manager and step loop, with the forward
pass replaced by `cost(num_new_tokens, context_lens)` seconds (a `kvlab.planning.simulate.StepCost`), which the
virtual clock charges. Each request whose scheduled tokens reach its end "samples" a placeholder token of its
own, so that no two requests' outputs look like a shared prefix (a block's hash chains its whole prefix, so a
repeated token within one output shares nothing either). Requests are meant to ignore eos and run to their
`max_tokens`, as in vLLM's serving benchmarks. Chapter 14.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlab.engine.kv_pool import KVPool
from kvlab.engine.outputs import RunnerOutput, ScheduledBatch
from kvlab.engine.request import Request


def placeholder_token(seq: Request) -> int:
    """The token a request "samples" on a cost runner: its own, never 0 or 1."""
    return 2 + seq.seq_id % 1_000_003


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

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        seconds = float(self.cost(batch.num_new_tokens, batch.context_lens()))
        self.step_seconds.append(seconds)
        sampled = batch.sampled()
        return RunnerOutput(sampled, [placeholder_token(seq) for seq in sampled], None, seconds)

    def release(self, seq: Request) -> None:
        """Nothing is kept per request."""
