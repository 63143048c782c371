"""`ModelRunner`: the KV pool, its sizing, and one forward pass plus sampling per step (nano-vllm's split).

The engine hands it a `ScheduledBatch`. It sorts the batch once (decodes first, longest context first), flattens
its tokens into one row with their positions and pool slots, builds the step's `PagedContext` (one per KV-cache
group) and runs the model through the paged attention. Every request whose scheduled tokens reach its end samples
one token; the output goes back in batch order. With `num_blocks=None` the pool is sized as vLLM sizes it at
startup, through `kvlab.costs.budget.MemoryBudget`: capacity less the weights and a profiled forward's peak;
on a GPU, the total memory × `gpu_memory_utilization`, refused when other processes hold too much of it.
Chapters 5, 7 and 11.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from kvlab.agreement import top_k_ids
from kvlab.costs.budget import MemoryBudget
from kvlab.engine.attention import enable_paged_attention
from kvlab.engine.config import EngineConfig
from kvlab.engine.context import PagedContext
from kvlab.engine.kv_pool import KVCacheGroup, KVPool, KVShape, kv_cache_groups, slots_for
from kvlab.engine.outputs import RunnerOutput, ScheduledBatch
from kvlab.engine.request import Request
from kvlab.measure import MemoryTracker, cuda_context_bytes
from kvlab.specs import vllm_defaults
from kvlab.units import cdiv, format_bytes

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 256 * 2**20  # bytes of "device" memory the engine may use on CPU
GPU_MEMORY_UTILIZATION = vllm_defaults.GPU_MEMORY_UTILIZATION  # vLLM's default share of GPU memory


def eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = model.config.get_text_config().eos_token_id if eos is None else eos
    return frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)


def cuda_capacity(device: torch.device) -> tuple[int, float, int]:
    """(capacity, utilisation, runtime bytes) of a CUDA budget sized as vLLM sizes it: the device's total memory
    × `GPU_MEMORY_UTILIZATION`, less this process's memory outside PyTorch (`cuda_context_bytes`).

    Refuses, in one line naming `num_blocks` and `memory_budget_bytes`, when other processes hold so much of the
    device that this share no longer fits in what they leave: the memory free now plus what PyTorch already
    holds here (the weights, the profiled forward). vLLM refuses the same way at startup (docs/vllm-fidelity.md)."""
    # Measured first: it synchronises and initialises CUDA, so the readings below are of settled memory.
    runtime = cuda_context_bytes(device)
    free, total = torch.cuda.mem_get_info(device)
    requested = int(total * GPU_MEMORY_UTILIZATION)
    # This process's PyTorch memory counts as its own; whatever else is used belongs to its runtime or to others.
    available = int(free) + int(torch.cuda.memory_reserved(device))
    if available < requested:
        raise ValueError(
            f"{device}: {format_bytes(int(free))} free of {format_bytes(int(total))}, "
            f"{format_bytes(int(total) - available)} held outside this process's PyTorch (other processes, the "
            f"CUDA context): the {GPU_MEMORY_UTILIZATION:.0%} budget ({format_bytes(requested)}) does not fit; "
            "give the engine num_blocks or memory_budget_bytes"
        )
    return int(total), GPU_MEMORY_UTILIZATION, runtime


class ModelRunner:
    def __init__(self, model: PreTrainedModel, config: EngineConfig) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shape = KVShape.from_config(model.config)
        self.groups: list[KVCacheGroup] = kv_cache_groups(model.config)
        self._group_of_layer = [0] * sum(len(g.layers) for g in self.groups)
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self._group_of_layer[layer] = g
        self.block_size = config.block_size
        # Bytes of one token slot of one block: every layer, or one group's layers in a hybrid model.
        # Quantized pools (`config.kv_cache_dtype` "fp8"/"int8") count their codes and scales.
        self.kv_cache_dtype = config.kv_cache_dtype
        self.kv_bytes_per_token = KVPool.bytes_per_token(self.shape, self.dtype, self.kv_cache_dtype)
        self.memory_budget: MemoryBudget | None = None  # set when the pool is sized from memory
        enable_paged_attention(model)
        # transformers passes a prepared 4-D mask through untouched instead of building one over the flat batch;
        # the PagedContext carries the real masks, so this placeholder is all the model needs.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = self.profile_num_blocks(config.memory_budget_bytes, config.max_num_batched_tokens)
        self.pool = KVPool(
            self.shape, num_blocks, self.block_size, self.dtype, self.device, self.kv_cache_dtype
        )
        self._generators: dict[int, torch.Generator] = {}
        self.max_model_len: int | None = model.config.get_text_config().max_position_embeddings
        self.eos_token_ids = eos_token_ids(model)
        logger.info(
            "KV cache: %d blocks × %d tokens = %d tokens (%s, %s per token); layout %s",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            format_bytes(self.pool.nbytes),
            format_bytes(self.kv_bytes_per_token),
            config.kv_layout,
        )

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    @torch.inference_mode()
    def profile_num_blocks(self, budget: int | None, tokens: int) -> int:
        """KV blocks that fit in the memory budget after the weights and a `tokens`-token forward's peak
        activation, computed by `kvlab.costs.budget.MemoryBudget` (kept as `self.memory_budget`, logged line by line).

        `budget=None`: on a GPU, total device memory × vLLM's default gpu_memory_utilization less the CUDA context
        (`cuda_capacity`, which refuses when other processes leave too little free); on CPU, `DEFAULT_CPU_BUDGET`.
        A given `budget` is used whole (utilisation 1.0, no runtime term)."""
        if budget is None and self.device.type == "cuda":
            capacity, utilization, runtime = cuda_capacity(self.device)
            runtime_source = "measured (kvlab.measure.cuda_context_bytes)"
        else:
            capacity = DEFAULT_CPU_BUDGET if budget is None else int(budget)
            utilization, runtime, runtime_source = 1.0, 0, "none counted: the budget is given"
        weights = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        # A dummy prefill of a full token budget, on a scratch pool made outside the tracker so it is not counted.
        blocks = cdiv(tokens, self.block_size)
        scratch = KVPool(
            self.shape,
            blocks * len(self.groups),
            self.block_size,
            self.dtype,
            self.device,
            self.kv_cache_dtype,
        )
        tables = [[list(range(g * blocks, (g + 1) * blocks))] for g in range(len(self.groups))]
        slots = [slots_for(t[0], 0, tokens, self.block_size) for t in tables]
        ctx = self._context(scratch, slots, [tokens], [tokens], tables)
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        with MemoryTracker(self.device) as mem:
            self.forward(ids, torch.arange(tokens, device=self.device)[None], ctx, 1)
        self.memory_budget = MemoryBudget(
            capacity_bytes=capacity,
            gpu_memory_utilization=utilization,
            runtime_bytes=runtime,
            weight_bytes=weights,
            activation_bytes=int(mem.peak_bytes),
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            runtime_source=runtime_source,
            activation_source=f"measured (profiled {tokens}-token forward)",
        )
        logger.info(
            "memory budget (kvlab.costs.budget.MemoryBudget):\n%s", "\n".join(self.memory_budget.lines())
        )
        if not self.memory_budget.fits:
            raise ValueError(
                f"memory budget {format_bytes(capacity)} leaves no room for KV blocks after weights "
                f"({format_bytes(weights)}) and activations ({format_bytes(mem.peak_bytes)})"
            )
        return self.memory_budget.num_blocks

    def _context(
        self,
        pool: KVPool,
        slots: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        tables: list[list[list[int]]],
    ) -> PagedContext:
        """The step's `PagedContext`: one per KV-cache group, each layer pointed at its group's."""
        device = self.device
        ctxs = [
            PagedContext.build(pool, torch.tensor(s, device=device), query_lens, context_lens, t)
            for s, t in zip(slots, tables, strict=True)
        ]
        if len(ctxs) == 1:
            return ctxs[0]
        ctx = ctxs[0]
        ctx.by_layer = [ctxs[g] for g in self._group_of_layer]
        return ctx

    # --- one step -----------------------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        """Forward the batch's scheduled tokens; the requests that get a new token, their tokens, and per
        request its `params.logprobs` best token ids at that position (None when it asked for none).

        The runner only reads the batch: requests' progress is the scheduler's (`Scheduler.update_from_output`).
        """
        ids: list[int] = []
        positions: list[int] = []
        num_groups = len(self.groups)
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        query_lens: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        # Batch index of each request that samples, in flat-batch order
        sampled: list[int] = []
        bs = self.block_size
        # The step's one order: decodes first, longest context first, as `PagedContext.build` takes them, so that
        # each decode group is a slice of the flat batch, read and written without an index
        order = sorted(
            range(len(batch.seqs)),
            key=lambda i: (batch.num_new_tokens[i] != 1, -batch.seqs[i].num_computed_tokens),
        )
        for i in order:
            seq, n, seq_tables = batch.seqs[i], batch.num_new_tokens[i], batch.block_tables[i]
            if seq.external is not None:
                self.load_external(seq, seq_tables[0])
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            num_blocks = cdiv(end, bs)
            for g, table in enumerate(seq_tables):
                slots[g] += slots_for(table, start, end, bs)
                # Entries freed behind a sliding window read block 0: the window's mask hides them (a full
                # group's table has no such entry).
                sliding = self.groups[g].window is not None
                tables[g].append([max(b, 0) for b in table[:num_blocks]] if sliding else table[:num_blocks])
            query_lens.append(n)
            context_lens.append(end)
            # The last known token: its logits give the next one
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(i)
        device = self.device
        ctx = self._context(self.pool, slots, query_lens, context_lens, tables)
        logits = self.forward(
            torch.tensor([ids], device=device),
            torch.tensor([positions], device=device),
            ctx,
            torch.tensor(sample_rows, dtype=torch.long, device=device),
        )
        tokens, top_ids = self.sample([batch.seqs[i] for i in sampled], logits[0].float())
        # Back in the batch's order, in which the scheduler finishes them: each sampled row by its batch index
        row_of: list[int | None] = [None] * len(batch.seqs)
        for row, i in enumerate(sampled):
            row_of[i] = row
        rows = [row for row in row_of if row is not None]
        return RunnerOutput(
            [batch.seqs[sampled[r]] for r in rows], [tokens[r] for r in rows], [top_ids[r] for r in rows]
        )

    def load_external(self, seq: Request, table: list[int]) -> None:
        """Write the K/V another engine computed for `seq` into its blocks (`table`), past what its prefix-cache
        hit already holds (`ExternalKV.start`), then drop it: a preempted request recomputes, as in vLLM."""
        external = seq.external
        assert external is not None
        self.pool.write_tokens(table, external.start, external.kv[:, :, external.start :])
        seq.external = None

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: PagedContext,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        """One forward of a flat batch `(1, tokens)` through the paged attention; logits of the kept rows."""
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=self._no_mask,
            use_cache=False,
            paged_context=ctx,
            logits_to_keep=logits_to_keep,
        )
        return out.logits

    def sample(self, seqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[list[int] | None]]:
        """Greedy for temperature 0; otherwise a multinomial draw from a per-sequence seeded generator.

        Also, for each sequence with `params.logprobs = k`, the ids of its k largest logits, best first; a greedy
        token is always first there (`kvlab.agreement.top_k_ids`, with ties broken as argmax breaks them)."""
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
        top_ids: list[list[int] | None] = [None] * len(seqs)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if wanted:
            k = max(int(seqs[i].params.logprobs or 1) for i in wanted)
            best = top_k_ids(logits[wanted], k, first=[tokens[i] for i in wanted])
            for i, ids in zip(wanted, best, strict=True):
                top_ids[i] = ids[: seqs[i].params.logprobs]
        return tokens, top_ids

    def release(self, seq: Request) -> None:
        """Forget a finished sequence's sampling state."""
        self._generators.pop(seq.seq_id, None)
