"""`ModelRunner`: the KV pool, its sizing, and one forward pass plus sampling per engine step (nano-vllm's split).

The engine hands it a `ScheduledBatch`; it flattens the batch's tokens into one row with their positions and pool
slots, builds the step's `PagedContext` once for all layers, runs the model through the paged attention
(`kvlab.paging`), and samples one token for every sequence whose scheduled tokens reach its end.

Sizing with `num_blocks=None` follows vLLM's startup: from a memory budget, take away the weights and the peak
activation of a profiled forward over `max_num_batched_tokens` tokens; the rest holds KV blocks. On CPU the budget
is a parameter (`memory_budget_bytes`); on a GPU it defaults to the free device memory times 0.9.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from kvlab.config import EngineConfig
from kvlab.measure import MemoryTracker
from kvlab.metrics import blocks_for
from kvlab.paging import KVPool, KVShape, PagedContext, enable_paged_attention, slots_for
from kvlab.scheduler import ScheduledBatch
from kvlab.sequence import Sequence
from kvlab.units import format_bytes

logger = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 256 * 2**20  # bytes of "device" memory the engine may use on CPU
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory


class ModelRunner:
    def __init__(self, model: PreTrainedModel, config: EngineConfig) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.shape = KVShape.from_config(model.config)
        self.block_size = config.block_size
        self.kv_bytes_per_token = KVPool.bytes_per_token(self.shape, self.dtype)
        enable_paged_attention(model)
        # transformers passes a prepared 4-D mask through untouched instead of building one over the flat batch;
        # the PagedContext carries the real masks, so this placeholder is all the model needs.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        num_blocks = config.num_blocks
        if num_blocks is None:
            num_blocks = self.profile_num_blocks(config.memory_budget_bytes, config.max_num_batched_tokens)
        self.pool = KVPool(self.shape, num_blocks, self.block_size, self.dtype, self.device)
        self._generators: dict[int, torch.Generator] = {}

    @torch.inference_mode()
    def profile_num_blocks(self, budget: int | None, tokens: int) -> int:
        """KV blocks that fit in `budget` bytes after the weights and a `tokens`-token forward's peak activation."""
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
        slots = torch.tensor(slots_for(table, 0, tokens, self.block_size), device=self.device)
        ctx = PagedContext.build(scratch, slots, [tokens], [tokens], [table])
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        with MemoryTracker(self.device) as mem:
            self.forward(ids, torch.arange(tokens, device=self.device)[None], ctx, 1)
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

    # --- one step -----------------------------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], list[int]]:
        """Forward the batch's scheduled tokens; the sequences that get a new token, and their tokens.

        Sequences' `num_computed_tokens` are left to the caller: the runner only reads the batch.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
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
        ctx = PagedContext.build(
            self.pool, torch.tensor(slots, device=device), list(batch.num_new_tokens), context_lens, tables
        )
        logits = self.forward(
            torch.tensor([ids], device=device),
            torch.tensor([positions], device=device),
            ctx,
            torch.tensor(sample_rows, dtype=torch.long, device=device),
        )
        return sampled, self.sample(sampled, logits[0].float())

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

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Greedy for temperature 0; otherwise a multinomial draw from a per-sequence seeded generator."""
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

    def release(self, seq: Sequence) -> None:
        """Forget a finished sequence's sampling state."""
        self._generators.pop(seq.seq_id, None)
