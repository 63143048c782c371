"""What passes between the scheduler and a runner in one step: the batch, the runner's output, the runner's face.

The scheduler fills a `ScheduledBatch` (vLLM v1's `SchedulerOutput`): each scheduled request with its new tokens,
its context once the step has run and its block tables. A runner runs it and answers a `RunnerOutput`
(vLLM's `ModelRunnerOutput`): the requests that sampled a token, and the tokens. `Runner` is what the engine asks
of a runner, the model (`kvlab.engine.model_runner`) or a step cost (`kvlab.engine.cost_runner`).

Keeping these in a module of their own lets the runners and the scheduler meet without importing each other.

Chapters 7-9 and 14.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvlab.engine.kv_pool import KVPool
    from kvlab.engine.request import Request

BlockTables = list[list[int]]  # one block table per KV-cache group


@dataclass
class ScheduledBatch:
    """The requests one step runs, in the order the scheduler chose them (running first, then new admissions)."""

    seqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Each request's context once the step has run, recorded as it is scheduled: runners and the clock read it
    # before `Scheduler.update_from_output` advances the requests.
    contexts: list[int] = field(default_factory=list)
    # Each request's block tables, the KV-cache manager's own lists (read, never written, by the runner).
    block_tables: list[BlockTables] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests whose scheduled tokens stop short of their last token (a prompt chunk): they sample nothing.
    num_partial: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def context_lens(self) -> list[int]:
        return self.contexts

    def add(self, seq: Request, num_new_tokens: int, block_tables: BlockTables) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.block_tables.append(block_tables)
        end = seq.num_computed_tokens + num_new_tokens
        self.contexts.append(end)
        if end < len(seq.token_ids):
            self.num_partial += 1

    def sampled(self) -> list[Request]:
        """The requests whose scheduled tokens reach their last token: each samples one, in batch order."""
        if not self.num_partial:
            return list(self.seqs)
        return [seq for seq, end in zip(self.seqs, self.contexts, strict=True) if end == len(seq.token_ids)]

    def chunks(self) -> list[tuple[Request, int]]:
        """The requests scheduled short of their last token (prompt chunks), each with its context after."""
        if not self.num_partial:
            return []
        return [
            (seq, end) for seq, end in zip(self.seqs, self.contexts, strict=True) if end < len(seq.token_ids)
        ]


# vLLM v1's name for the same thing
SchedulerOutput = ScheduledBatch


@dataclass
class RunnerOutput:
    """The requests that sampled a token this step, in batch order, and their tokens; per request its
    `params.logprobs` best token ids (None when it asked for none; the list is None when no request did); the
    step's modelled seconds where the runner models time (a cost runner; None: the step took real time)."""

    seqs: list[Request]
    token_ids: list[int]
    top_token_ids: list[list[int] | None] | None = None
    seconds: float | None = None


class Runner(Protocol):
    """What the engine runs its batches on, and what it learns of it at startup."""

    @property
    def num_blocks(self) -> int: ...  # blocks of the KV pool

    @property
    def windows(self) -> list[int | None]: ...  # per KV-cache group: None (full attention) or its window

    @property
    def max_model_len(self) -> int | None: ...  # the model's context limit (None: only the pool bounds it)

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def pool(self) -> KVPool | None: ...

    def run(self, batch: ScheduledBatch) -> RunnerOutput: ...

    def release(self, seq: Request) -> None: ...
