"""The cheat sheet's lookup table: popular models on common GPUs, the KV pool and the sequences that run at once.

Each row is one model on one GPU at the smallest tensor-parallel size whose pool holds one request of
`SERVED_LEN` tokens (or of the model's limit, if lower), so that `vllm serve --max-model-len 32k` starts; at
vLLM's defaults (`BudgetSettings()`, `kvlab.specs.vllm_defaults`). The sequences at a context are what the pool holds
in whole blocks, capped by `max_num_seqs`; a context above the model's own limit has none.
Appendix: *Cheat sheet* (book/appendix_cheat_sheet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.costs.budget import BudgetSettings, MemoryBudget
from kvlab.specs import sizing
from kvlab.specs.shape import shape

# Open models deployers serve: dense, MoE, sliding-window and MLA (all in the registry, configs cited there).
LOOKUP_MODELS = (
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-70B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen2.5-72B",
    "Qwen/Qwen3-30B-A3B",
    "deepseek-ai/DeepSeek-V2-Lite",
    "mistralai/Mistral-7B-v0.1",
    "mistralai/Mixtral-8x7B-v0.1",
    "google/gemma-2-9b",
    "google/gemma-3-27b-it",
)
LOOKUP_GPUS = ("L4", "L40S", "A100-80GB", "H100-SXM", "H200", "H20", "MI300X")
LOOKUP_CONTEXTS = (4096, 8192, 32768, 131072)
# Tensor-parallel sizes a node offers, smallest first
TP_SIZES = (1, 2, 4, 8)
# The max_model_len a row's TP must start with
SERVED_LEN = 32768
# vLLM's defaults, every setting left as `BudgetSettings` has it
DEFAULTS = BudgetSettings()


@dataclass(frozen=True)
class LookupRow:
    """One model on one GPU: the TP it needs (None: no size up to 8 fits) and what its pool holds."""

    model: str
    gpu: str
    tp: int | None
    budget: MemoryBudget | None
    # context -> sequences running at once; None where the context exceeds the model's limit
    sequences: dict[int, int | None]

    @property
    def pool_tokens(self) -> int:
        return self.budget.max_tokens() if self.budget is not None else 0

    def cells(self) -> tuple[str, ...]:
        """The row as the cheat sheet prints it: '-' where a context exceeds the model's limit."""
        tp = str(self.tp) if self.tp is not None else f"> {TP_SIZES[-1]}"
        counts = tuple("-" if n is None else f"{n:,}" for n in self.sequences.values())
        return (self.model.split("/")[-1], self.gpu, tp, f"{self.pool_tokens:,}", *counts)


def smallest_tp(model: str, gpu: str, settings: BudgetSettings = DEFAULTS) -> tuple[int, MemoryBudget] | None:
    """The smallest TP in `TP_SIZES` that the model's heads allow and whose pool holds one request of
    `SERVED_LEN` tokens (or of the model's limit, if lower), with its budget."""
    spec, limit = shape(model).spec, shape(model).max_context
    served = min(SERVED_LEN, limit) if limit else SERVED_LEN
    for tp in TP_SIZES:
        try:
            sizing.check_parallel(spec, tp, 1)
        except ValueError:
            continue
        budget = dataclasses.replace(settings, tp=tp).memory_budget(model, gpu)
        if budget.fits and budget.max_sequences(served) >= 1:
            return tp, budget
    return None


def lookup_row(
    model: str,
    gpu: str,
    contexts: Sequence[int] = LOOKUP_CONTEXTS,
    settings: BudgetSettings = DEFAULTS,
) -> LookupRow:
    found = smallest_tp(model, gpu, settings)
    limit = shape(model).max_context
    sequences: dict[int, int | None] = {}
    for context in contexts:
        if limit is not None and context > limit:
            sequences[context] = None
        elif found is None:
            sequences[context] = 0
        else:
            tp, budget = found
            max_num_seqs = dataclasses.replace(settings, tp=tp).batch_limits(gpu, model)[1]
            sequences[context] = min(budget.max_sequences(context), max_num_seqs)
    if found is None:
        return LookupRow(model, gpu, None, None, sequences)
    return LookupRow(model, gpu, found[0], found[1], sequences)


def lookup_rows(
    models: Sequence[str] = LOOKUP_MODELS,
    gpus: Sequence[str] = LOOKUP_GPUS,
    contexts: Sequence[int] = LOOKUP_CONTEXTS,
    settings: BudgetSettings = DEFAULTS,
) -> list[LookupRow]:
    """The lookup table, model by model, GPU by GPU."""
    return [lookup_row(model, gpu, contexts, settings) for model in models for gpu in gpus]
