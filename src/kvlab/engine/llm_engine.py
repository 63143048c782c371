"""`LLMEngine`: the one step loop of a small vLLM on a transformers model, or on a step cost.

Each `step` asks the `Scheduler` for a batch, runs it on a runner (`ModelRunner`: the model through the paged
attention; `CostRunner`: a modelled step, the simulator), lets the scheduler account for the output, and returns
the requests that finished. Greedy outputs equal `model.generate`'s in fp32, with preemption, prefix caching,
sliding windows and hybrids (tests/test_engine.py). The parts report what they count:
`engine.scheduler.num_preemptions`, `engine.block_manager.prefix_cache_stats`, `engine.pool` (the KV pool).
At startup it logs its memory budget and its knobs beside vLLM v1's defaults (`EngineConfig.table()`).
Chapters 5-9 and 14.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedModel

from kvlab.costs.workloads import TraceRequest
from kvlab.engine.block_manager import BlockManager, ContiguousBlockManager, longest_request
from kvlab.engine.clock import Clock, VirtualClock, WallClock
from kvlab.engine.config import EngineConfig
from kvlab.engine.metrics import RequestMetrics
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.outputs import Runner
from kvlab.engine.request import Prompt, Request, SamplingParams, parse_prompt
from kvlab.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids
    finish_reason: str | None  # "stop", "length" or "error"
    metrics: RequestMetrics
    error: str | None = None
    # vLLM's `SamplingParams(logprobs=k)`: per generated token, the ids of the k most likely tokens at that
    # position, the sampled one first (`ModelRunner.sample`); None when the request asked for none.
    top_token_ids: list[list[int]] | None = None


class LLMEngine:
    """The step loop between a `Scheduler` and a runner (vLLM's `LLMEngine`, nano-vllm's `LLMEngine`)."""

    # What it builds its parts from; the planner's simulator swaps in its faster ones (kvlab.planning.fast_engine)
    block_manager_cls: type[BlockManager] = BlockManager
    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(
        self,
        model: PreTrainedModel | None = None,
        config: EngineConfig | None = None,
        *,
        runner: Runner | None = None,
        clock: Literal["wall", "virtual"] | Clock = "wall",
        log_stats: bool = True,
        **knobs: Any,
    ) -> None:
        """`LLMEngine(model, block_size=16, num_blocks=..., ...)` with any `EngineConfig` field as a keyword, or
        `LLMEngine(model, EngineConfig(...))`; keywords given with a config override its fields. `runner`
        replaces the model runner (`LLMEngine(runner=CostRunner(...), clock=VirtualClock())` is the simulator);
        `log_stats=False` records no `step_stats`."""
        config = EngineConfig(**knobs) if config is None else dataclasses.replace(config, **knobs)
        if runner is None:
            if model is None:
                raise ValueError("LLMEngine needs a model or a runner")
            runner = ModelRunner(model, config)
        self.config, self.runner = config, runner
        self.pool = runner.pool
        num_blocks, bs, windows = runner.num_blocks, config.block_size, runner.windows
        limit = runner.max_model_len or num_blocks * bs
        capacity = longest_request(windows, num_blocks, bs, config.max_num_batched_tokens, limit)
        self.max_model_len = min(limit, capacity) if config.max_model_len is None else config.max_model_len
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the pool ({num_blocks} blocks × {bs} tokens"
                f" over {len(windows)} KV-cache groups)"
            )
        if config.kv_layout == "contiguous":
            if len(windows) > 1:
                raise ValueError("the contiguous baseline supports one KV-cache group (not hybrid models)")
            self.block_manager: BlockManager = ContiguousBlockManager(num_blocks, bs, self.max_model_len)
        else:
            self.block_manager = self.block_manager_cls(
                num_blocks,
                bs,
                bool(config.enable_prefix_caching),
                windows,
                config.prefix_cache_retention_interval,
                max_in_flight_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            )
        limits = config.scheduler_config(self.max_model_len)
        self.scheduler = self.scheduler_cls(limits, self.block_manager, runner.eos_token_ids, log_stats)
        self.step_stats = self.scheduler.step_stats
        self.clock: Clock = (
            {"wall": WallClock, "virtual": VirtualClock}[clock]() if isinstance(clock, str) else clock
        )
        self._rejected: list[Request] = []  # reported by the next step()
        concurrency = self.block_manager.max_concurrency(self.max_model_len, config.max_num_batched_tokens)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", self.max_model_len, concurrency)
        logger.info("effective configuration beside vLLM v1's defaults:\n%s", self.config_table())

    def config_table(self) -> str:
        """This engine's knobs beside vLLM's defaults, as printable text (logged at startup)."""
        rows = [("knob", "kvlab", "vLLM v1 default"), *self.config.table()]
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        return "\n".join(f"  {a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request; `arrival_time` (clock seconds) may lie in the future, for trace replay. A prompt
        that can never fit (not shorter than `max_model_len`, which the pool bounds) finishes at once with
        `finish_reason="error"` instead of waiting forever."""
        token_ids, salt = parse_prompt(prompt)
        arrival = self.clock.now() if arrival_time is None else arrival_time
        return self.enqueue(
            Request(token_ids, params or SamplingParams(), arrival, request_id, cache_salt=salt)
        )

    def enqueue(self, seq: Request) -> Request:
        """Queue a built `Request` (one that carries K/V computed elsewhere: `Request.prefilled`), or finish it
        at once with an error if it can never fit."""
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
            self.scheduler.add_request(seq)
        return seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests that finished in it (or were rejected since)."""
        finished = [self._output(s) for s in self._rejected]
        self._rejected.clear()
        now = self.clock.now()
        batch = self.scheduler.schedule(now)
        if not batch.seqs:
            upcoming = self.scheduler.next_arrival()
            # Nothing ran: wait for the next arrival, if that is why (the scheduler raises if it cannot progress).
            if upcoming is not None and upcoming > now:
                self.clock.wait_until(upcoming)
            return finished
        output = self.runner.run(batch)
        self.clock.step_done(batch.num_batched_tokens, sum(batch.context_lens()), output.seconds)
        done = self.scheduler.update_from_output(batch, output, self.clock.now())
        return finished + [self._output(s) for s in done]

    def _output(self, seq: Request) -> RequestOutput:
        self.runner.release(seq)
        return RequestOutput(
            str(seq.request_id),
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.finish_reason,
            seq.metrics,
            seq.error,
            None if seq.params.logprobs is None else [list(t) for t in seq.top_token_ids],
        )

    def run_until_done(self, requests: Iterable[Request] | None = None) -> list[RequestOutput]:
        """Step until `requests` (default: everything queued) have finished; their outputs in the order given."""
        seqs = list(requests) if requests is not None else [*self.scheduler.waiting, *self.scheduler.running]
        while not all(s.is_finished for s in seqs):
            self.step()
        return [self._output(s) for s in seqs]

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for a list of prompts (token ids, or dicts with `prompt_token_ids` and `cache_salt`), in
        prompt order."""
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        return self.run_until_done(seqs)

    def add_trace(
        self, trace: Iterable[TraceRequest], logprobs: int | None = None, start: float | None = None
    ) -> list[Request]:
        """Queue a trace: each request arrives at its `arrival_time` after `start` (default: now), ignores eos
        and keeps each position's `logprobs` best token ids when given."""
        start = self.clock.now() if start is None else start
        return [
            self.add_request(
                r.prompt_token_ids,
                SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, logprobs=logprobs),
                arrival_time=start + r.arrival_time,
            )
            for r in trace
        ]

    def replay(self, trace: Iterable[TraceRequest], logprobs: int | None = None) -> list[RequestOutput]:
        """Replay a trace from now (`add_trace`); outputs in trace order."""
        return self.run_until_done(self.add_trace(trace, logprobs))
