"""The cheat sheet's lookup table (kvlab.planning.lookup), recomputed from the budget and checked against the page."""

import json
from pathlib import Path

from kvlab.costs import budget
from kvlab.costs.budget import BudgetSettings
from kvlab.planning import lookup

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "book" / "appendix_cheat_sheet" / "lab.ipynb"


def test_a_row_worked_by_hand():
    # Llama-3.1-70B on H100s: the row's TP is the smallest whose pool holds one 32k request.
    model, gpu = "meta-llama/Llama-3.1-70B", "H100-SXM"
    row = lookup.lookup_row(model, gpu)
    assert row.tp is not None and row.tp > 1, "one H100 does not hold the 70B model's weights and a request"
    smaller = budget.memory_budget(model, gpu, tp=row.tp // 2)
    assert not smaller.fits or smaller.max_sequences(lookup.SERVED_LEN) < 1
    mine = budget.memory_budget(model, gpu, tp=row.tp)
    assert row.budget == mine and row.pool_tokens == mine.max_tokens() >= lookup.SERVED_LEN
    max_num_seqs = BudgetSettings(tp=row.tp).batch_limits(gpu, model)[1]
    for context, n in row.sequences.items():
        assert n == min(mine.max_sequences(context), max_num_seqs)
    # more tokens, fewer sequences
    counts = list(row.sequences.values())
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


def test_a_context_past_the_models_limit_has_no_count():
    # Gemma 2's max_position_embeddings is 8,192: 32k and 128k are not served at all.
    row = lookup.lookup_row("google/gemma-2-9b", "H100-SXM")
    assert row.sequences[8192] is not None and row.sequences[32768] is None and row.sequences[131072] is None
    assert row.cells()[-2:] == ("-", "-")


def test_no_tp_up_to_8_that_holds_a_request():
    # 8 T4s hold 120 GiB, less than the 70B's 131 GiB of bf16 weights (on 8 L4s one 32k request fits since the
    # non-torch estimate without NVLS, kvlab.costs.budget)
    row = lookup.lookup_row("meta-llama/Llama-3.1-70B", "T4")
    assert row.tp is None and row.budget is None and set(row.sequences.values()) == {0}
    assert row.cells()[2:4] == ("> 8", "0")
    # the smallest TP is the one that fits: one size less leaves no 32k request
    tp, found = lookup.smallest_tp("meta-llama/Llama-3.1-70B", "H200")
    smaller = budget.memory_budget("meta-llama/Llama-3.1-70B", "H200", tp=tp // 2) if tp > 1 else None
    assert found.max_sequences(lookup.SERVED_LEN) >= 1
    assert smaller is None or not smaller.fits or smaller.max_sequences(lookup.SERVED_LEN) < 1


def test_the_cheat_sheet_prints_the_table_kvlab_computes_now():
    """The stored lab output equals a fresh computation: a budget change that moves a number fails here until the
    lab is re-executed."""
    nb = json.loads(LAB.read_text())
    printed = [
        "".join(out["data"]["text/plain"])
        for cell in nb["cells"]
        if cell["cell_type"] == "code" and "lookup.lookup_rows" in "".join(cell["source"])
        for out in cell["outputs"]
        if "text/plain" in out.get("data", {})
    ]
    assert printed, "the cheat sheet's lab prints the lookup table"
    rows = lookup.lookup_rows()
    assert len(rows) == len(lookup.LOOKUP_MODELS) * len(lookup.LOOKUP_GPUS) >= 60
    for row in rows:
        line = "  ".join(row.cells())
        assert any(" ".join(line.split()) in " ".join(text.split()) for text in printed), line
