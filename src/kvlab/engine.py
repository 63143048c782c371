"""`LLMEngine`: a small vLLM on a transformers model, for measuring paging, batching and prefix caching.

Split the way nano-vllm and vLLM are: an `EngineConfig` (`kvlab.config`) holds the knobs; the `Scheduler` decides
which sequences run and with how many tokens; the `ModelRunner` (`kvlab.model_runner`) owns the KV pool, runs the
model through the paged attention (`kvlab.paging`) and samples; `LLMEngine` is the loop between them. Each `step()`
schedules a batch, runs it, appends the sampled tokens, and retires finished requests. Greedy outputs equal
`model.generate`'s in fp32 (the tests prove it, with preemption and prefix caching too). `step_stats` keeps one
`kvlab.metrics.StepStats` row per step (running sequences, blocks in use, batched tokens, KV utilisation) for the
book's occupancy plots; each output carries its request's latency metrics. Read-only properties report what the
scheduler and the block manager count (`num_preemptions`, `num_recomputed_tokens`, `prefix_cache_stats`, blocks in
use, per KV-cache group and cached).

Prompts are token-id lists or vLLM's form `{"prompt_token_ids": [...], "cache_salt": "..."}`: a salt is mixed
into the first block's hash, so requests with different salts never share cached blocks. At startup the engine
logs its memory budget (`kvlab.budget.MemoryBudget`, when it sizes the pool) and its effective configuration beside
vLLM v1's defaults (`EngineConfig.table()`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
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

Prompt = Sequence[int] | Mapping[str, Any]  # token ids, or {"prompt_token_ids": [...], "cache_salt": "..."}


def _parse_prompt(prompt: Prompt) -> tuple[list[int], str | None]:
    """Token ids and cache salt of a prompt in either form; a one-line error for anything else."""
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt_token_ids", "cache_salt"}
        if "prompt_token_ids" not in prompt or unknown:
            raise ValueError(
                f"a prompt dict needs 'prompt_token_ids' and may have 'cache_salt', got keys {sorted(prompt)}"
            )
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return list(prompt["prompt_token_ids"]), salt
    if isinstance(prompt, (str, bytes)):
        raise ValueError("prompts are token ids (or a dict with 'prompt_token_ids'), not text")
    return list(prompt), None


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
        capacity = self._capacity_tokens(num_blocks, limit)
        max_model_len = min(limit, capacity) if max_model_len is None else max_model_len
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the pool ({num_blocks} blocks × {block_size} tokens"
                f" over {len(self.model_runner.groups)} KV-cache groups)"
            )
        self.max_model_len = max_model_len
        windows = [g.window for g in self.model_runner.groups]
        if config.kv_layout == "contiguous":
            if len(windows) > 1:
                raise ValueError("the contiguous baseline supports one KV-cache group (not hybrid models)")
            self.block_manager: BlockManager = ContiguousBlockManager(num_blocks, block_size, max_model_len)
        else:
            self.block_manager = BlockManager(
                num_blocks, block_size, bool(config.enable_prefix_caching), windows
            )
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
        logger.info("effective configuration beside vLLM v1's defaults:\n%s", self.config_table())

    def config_table(self) -> str:
        """This engine's knobs beside vLLM 0.33.0's defaults, as printable text (logged at startup)."""
        rows = [("knob", "kvlab", "vLLM v1 default"), *self.config.table()]
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        return "\n".join(f"  {a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)

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
    def kv_cache_groups(self) -> list[Any]:
        """The model's KV-cache groups (`kvlab.paging.KVCacheGroup`: window, layers), one block table each."""
        return list(self.model_runner.groups)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the pool (all layers it spans, K and V)."""
        return self.block_size * self.kv_bytes_per_token

    def num_used_blocks_by_group(self) -> list[int]:
        """Blocks in use per KV-cache group: a sliding group's stop growing at its window."""
        return self.block_manager.num_used_blocks_by_group()

    @property
    def num_recomputed_tokens(self) -> int:
        """Prompt and output tokens prefilled again after preemptions (prefix-cache hits are not recomputed)."""
        return self.block_manager.num_recomputed_tokens

    @property
    def num_preemptions(self) -> int:
        """Preemptions by recompute since the engine started."""
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups so far, each request counted once (all zero without prefix caching)."""
        return self.block_manager.prefix_cache_stats

    def _blocks_per_request(self, context_len: int) -> int:
        """Most blocks one request of `context_len` tokens holds over all groups: a sliding group at most
        cdiv(window - 1 + max_num_batched_tokens, block_size) + 1 (vLLM 0.33.0 `SlidingWindowSpec.
        max_memory_usage_bytes`, `vllm/v1/kv_cache_interface.py`)."""
        bs, chunk = self.config.block_size, self.config.max_num_batched_tokens
        return sum(
            blocks_for(context_len, bs)
            if g.window is None
            else blocks_for(min(g.window - 1 + chunk, context_len), bs) + 1
            for g in self.model_runner.groups
        )

    def _capacity_tokens(self, num_blocks: int, limit: int) -> int:
        """The longest sequence the pool holds alone (the model's limit if only sliding groups hold it)."""
        bs = self.config.block_size
        if self._blocks_per_request(limit) <= num_blocks:
            return limit
        k = 0
        while self._blocks_per_request((k + 1) * bs) <= num_blocks:
            k += 1
        return k * bs

    def max_concurrency(self, context_len: int) -> float:
        """How many requests of `context_len` tokens the pool holds at once (vLLM's startup figure)."""
        return self.block_manager.num_blocks / self._blocks_per_request(context_len)

    # --- requests -----------------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        request_id: str | None = None,
    ) -> Seq:
        """Queue a request; `arrival_time` (clock seconds) may lie in the future, for trace replay.

        `prompt` is token ids or `{"prompt_token_ids": [...], "cache_salt": "..."}`. A prompt that can never fit
        (not shorter than `max_model_len`, which the pool bounds) finishes at once with `finish_reason="error"`
        instead of waiting forever.
        """
        token_ids, salt = _parse_prompt(prompt)
        now = self.clock.now()
        seq = Seq(
            token_ids,
            params or SamplingParams(),
            now if arrival_time is None else arrival_time,
            request_id,
            cache_salt=salt,
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
        sampled, tokens, top_ids = self.model_runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        self.clock.step_done(batch.num_batched_tokens, sum(s.num_computed_tokens for s in batch.seqs))
        now = self.clock.now()
        for seq, token, top in zip(sampled, tokens, top_ids, strict=True):
            seq.token_ids.append(token)
            if top is not None:
                seq.top_token_ids.append(top)
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
            str(seq.request_id),
            seq.prompt_token_ids,
            seq.output_token_ids,
            seq.finish_reason,
            seq.metrics,
            seq.error,
            None if seq.params.logprobs is None else [list(t) for t in seq.top_token_ids],
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
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for a list of prompts (token ids, or dicts with `prompt_token_ids` and `cache_salt`), in
        prompt order."""
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        return self.run_until_done(seqs)

    def replay(self, trace: Iterable[TraceRequest], logprobs: int | None = None) -> list[RequestOutput]:
        """Replay a trace: each request arrives at its `arrival_time` after now; outputs in trace order (with
        each position's `logprobs` best token ids in `top_token_ids` when given)."""
        start = self.clock.now()
        seqs = [
            self.add_request(
                r.prompt_token_ids,
                SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, logprobs=logprobs),
                arrival_time=start + r.arrival_time,
            )
            for r in trace
        ]
        return self.run_until_done(seqs)
