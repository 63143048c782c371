"""`LLMEngine`: a small vLLM on a transformers model, for measuring paging, batching and prefix caching.

Each `step()` asks the scheduler which sequences run and with how many tokens, flattens those tokens into one
batch row with their positions and pool slots, runs the model once through the paged attention
(`kvlab.paging`), samples one token for every sequence whose scheduled tokens reach its end, and retires
finished requests. Greedy outputs equal `model.generate`'s in fp32 (the tests prove it, with preemption and
prefix caching too). `step_stats` keeps one row per step (running sequences, blocks in use, batched tokens,
KV utilisation) for the book's occupancy plots; each output carries its request's latency metrics.

Sizing with `num_blocks=None` follows vLLM's startup: from a memory budget, take away the weights and the peak
activation of a profiled forward over `max_num_batched_tokens` tokens; the rest holds KV blocks. On CPU the budget
is a parameter (`memory_budget_bytes`); on a GPU it defaults to the free device memory times 0.9.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from kvlab.block_manager import BlockManager, ContiguousBlockManager, Fragmentation, blocks_for
from kvlab.clock import Clock, VirtualClock, WallClock
from kvlab.measure import MemoryTracker
from kvlab.metrics import RequestMetrics
from kvlab.paging import KVPool, KVShape, PagedContext, slots_for, use_paged_attention
from kvlab.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, Scheduling
from kvlab.sequence import SamplingParams
from kvlab.sequence import Sequence as Seq
from kvlab.units import format_bytes
from kvlab.workloads import TraceRequest

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 256 * 2**20  # bytes of "device" memory the engine may use on CPU
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids
    finish_reason: str | None  # "stop", "length" or "error"
    metrics: RequestMetrics
    error: str | None = None


@dataclass(frozen=True)
class StepStats:
    step: int
    time: float  # clock time at the end of the step
    num_running: int
    num_waiting: int  # arrived or not
    num_batched_tokens: int
    num_prefill_tokens: int  # tokens of sequences computing more than one token this step
    num_decode_seqs: int
    num_preempted: int
    blocks_used: int
    used_token_slots: int  # pool slots holding a computed token
    reserved_token_slots: int  # slots of the blocks in use

    @property
    def kv_utilisation(self) -> float:
        """Bytes holding real token states / bytes reserved."""
        return self.used_token_slots / self.reserved_token_slots if self.reserved_token_slots else 1.0


def mean_kv_utilisation(stats: Sequence[StepStats]) -> float:
    """Utilisation over a run: slots holding tokens / slots reserved, summed over steps."""
    reserved = sum(s.reserved_token_slots for s in stats)
    return sum(s.used_token_slots for s in stats) / reserved if reserved else 1.0


def measured_fragmentation(stats: Sequence[StepStats]) -> Fragmentation:
    """Per running sequence and step: empty slots of blocks in use, and blocks in use (no prefix sharing)."""
    seq_steps = sum(s.num_running for s in stats)
    if not seq_steps:
        raise ValueError("no step ran a sequence")
    waste = sum(s.reserved_token_slots - s.used_token_slots for s in stats)
    return Fragmentation(waste / seq_steps, sum(s.blocks_used for s in stats) / seq_steps)


def mean_batch_occupancy(stats: Sequence[StepStats]) -> float:
    """Sequences in the running batch after each step, averaged over steps."""
    return sum(s.num_running for s in stats) / len(stats) if stats else 0.0


def _eos_ids(model: PreTrainedModel) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.get_text_config().eos_token_id if eos is None else eos
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


class LLMEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        enable_prefix_caching: bool = False,
        scheduling: Scheduling = "continuous",
        max_model_len: int | None = None,
        memory_budget_bytes: int | None = None,
        kv_layout: Literal["paged", "contiguous"] = "paged",
        clock: Literal["wall", "virtual"] | Clock = "wall",
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shape = KVShape.from_config(model.config)
        self.block_size = block_size
        self.kv_bytes_per_token = KVPool.bytes_per_token(self.shape, self.dtype)
        if num_blocks is None:
            num_blocks = self._profile_num_blocks(memory_budget_bytes, max_num_batched_tokens)
        limit = model.config.get_text_config().max_position_embeddings
        max_model_len = min(limit, num_blocks * block_size) if max_model_len is None else max_model_len
        if max_model_len > num_blocks * block_size:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the pool ({num_blocks} blocks × {block_size} tokens)"
            )
        self.max_model_len = max_model_len
        if kv_layout == "contiguous":
            if enable_prefix_caching:
                raise ValueError("the contiguous baseline has no prefix caching")
            self.block_manager: BlockManager = ContiguousBlockManager(num_blocks, block_size, max_model_len)
        elif kv_layout == "paged":
            self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        else:
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {kv_layout!r}")
        self.pool = KVPool(self.shape, num_blocks, block_size, self.dtype, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                scheduling=scheduling,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self.clock: Clock = (
            {"wall": WallClock, "virtual": VirtualClock}[clock]() if isinstance(clock, str) else clock
        )
        self.eos_token_ids = _eos_ids(model)
        self.step_stats: list[StepStats] = []
        self._generators: dict[int, torch.Generator] = {}
        self._rejected: list[Seq] = []  # reported by the next step()
        logger.info(
            "KV cache: %d blocks × %d tokens = %d tokens (%s, %s per token); layout %s",
            num_blocks,
            block_size,
            num_blocks * block_size,
            format_bytes(self.pool.nbytes),
            format_bytes(self.kv_bytes_per_token),
            kv_layout,
        )
        logger.info(
            "Maximum concurrency for %d tokens per request: %.2fx",
            max_model_len,
            self.max_concurrency(max_model_len),
        )

    # --- sizing -------------------------------------------------------------------------------------------------

    def max_concurrency(self, context_len: int) -> float:
        """How many requests of `context_len` tokens the pool holds at once (vLLM's startup figure)."""
        return self.block_manager.num_blocks / blocks_for(context_len, self.block_size)

    @torch.inference_mode()
    def _profile_num_blocks(self, budget: int | None, tokens: int) -> int:
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int((free + torch.cuda.memory_allocated(self.device)) * GPU_MEMORY_UTILIZATION)
            else:
                budget = DEFAULT_CPU_BUDGET
        weights = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        # A dummy prefill of a full token budget, on a scratch pool made outside the tracker so it is not counted.
        scratch = KVPool(
            self.shape, blocks_for(tokens, self.block_size), self.block_size, self.dtype, self.device
        )
        table = list(range(scratch.num_blocks))
        ctx = PagedContext(
            scratch, torch.tensor(slots_for(table, 0, tokens, self.block_size), device=self.device), [tokens],
            [tokens], [table],
        )  # fmt: skip
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        with MemoryTracker(self.device) as mem, use_paged_attention(self.model):
            self.model(input_ids=ids, position_ids=torch.arange(tokens, device=self.device)[None],
                       use_cache=False, paged_context=ctx, logits_to_keep=1)  # fmt: skip
        per_block = self.block_size * self.kv_bytes_per_token
        num_blocks = (budget - weights - mem.peak_bytes) // per_block
        logger.info(
            "memory budget %s: weights %s, peak activation %s (%d-token forward), KV cache %s",
            format_bytes(budget),
            format_bytes(weights),
            format_bytes(mem.peak_bytes),
            tokens,
            format_bytes(max(0, num_blocks) * per_block),
        )
        if num_blocks < 1:
            raise ValueError(
                f"memory budget {format_bytes(budget)} leaves no room for KV blocks after weights "
                f"({format_bytes(weights)}) and activations ({format_bytes(mem.peak_bytes)})"
            )
        return int(num_blocks)

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
        sampled, logits = self._forward(batch)
        self.clock.step_done(batch.num_batched_tokens, sum(s.num_computed_tokens for s in batch.seqs))
        now = self.clock.now()
        for seq, token in zip(sampled, self._sample(sampled, logits), strict=True):
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

    def _forward(self, batch: ScheduledBatch) -> tuple[list[Seq], torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Seq] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += slots_for(seq.block_table, start, end, self.block_size)
            tables.append(seq.block_table[: blocks_for(end, self.block_size)])
            context_lens.append(end)
            if end == seq.num_tokens:  # the last known token: its logits give the next one
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        device = self.device
        ctx = PagedContext(
            self.pool, torch.tensor(slots, device=device), list(batch.num_new_tokens), context_lens, tables
        )
        with torch.inference_mode(), use_paged_attention(self.model):
            out = self.model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                paged_context=ctx,
                logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=device),
            )
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        return sampled, out.logits[0].float()

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            temperature = seq.params.temperature
            if temperature > 0:
                gen = self._generators.get(seq.seq_id)
                if gen is None:
                    seed = seq.params.seed if seq.params.seed is not None else seq.seq_id
                    gen = self._generators[seq.seq_id] = torch.Generator().manual_seed(seed)
                probs = torch.softmax(logits[i].cpu() / temperature, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens

    def _finish_reason(self, seq: Seq, token: int) -> str | None:
        if not seq.params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Seq) -> RequestOutput:
        self._generators.pop(seq.seq_id, None)
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
