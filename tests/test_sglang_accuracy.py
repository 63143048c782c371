"""The SGLang section of the accuracy appendix (kvlab.planning.sglang_accuracy): every record of
tests/data/sglang_logs parsed, its cell size exact, its pool recomputed, and the page's block recomputed."""

from __future__ import annotations

import json

import pytest

from kvlab.planning import accuracy, sglang_accuracy
from kvlab.units import GiB

RECORDS = sglang_accuracy.records()
ROWS = sglang_accuracy.rows()


def test_every_record_is_a_row():
    # no record is dropped: one row a JSON file, each with a cited source
    assert len(RECORDS) == len(ROWS) >= 6
    assert [r.slug for r in ROWS] == [slug for slug, _ in RECORDS]
    for _, entry in RECORDS:
        assert entry["source"].startswith("https://github.com/")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.slug)
def test_bytes_per_token_are_exact(row):
    # K and V are printed to 0.01 GiB each, and cover the pool plus one page
    assert row.printed_bytes_per_token == pytest.approx(row.bytes_per_token, abs=0.01 * GiB / row.tokens)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.slug)
def test_every_row_is_predicted_or_says_why_in_one_line(row):
    for value, why in ((row.from_memory, row.memory_why), (row.whole, row.whole_why)):
        assert (value is not None) != bool(why), row.slug
        assert "\n" not in why


def test_the_pool_from_printed_memory():
    # SGLang's step 3 from the printed free memory: within the rounding of two printed decimals of GiB
    predicted = [r for r in ROWS if r.from_memory is not None]
    assert len(predicted) >= 3
    for row in predicted:
        rounding = 0.015 * GiB / row.bytes_per_token + row.page_size
        assert abs(row.from_memory - row.tokens) <= rounding, row.slug
    s = sglang_accuracy.summary([r.memory_error for r in predicted])
    assert s.n == len(predicted) and s.mae < 0.001


def test_the_pool_from_gpu_and_model():
    whole = {r.slug: r for r in ROWS if r.whole is not None}
    # SGLang's own reference log (B200, its defaults) against kvlab's 0.5.23 choice of fraction
    assert whole["sglang_skill_qwen3_8b_b200"].whole_error == pytest.approx(0.005, abs=0.002)
    # a March 2025 log ran 0.88 (SGLang 0.4's rule by TP size); 0.5.23 picks 0.830 on an H100
    llama = whole["sglang_4760_llama31_8b_h100"]
    assert llama.auto_printed == 0.88 and llama.auto_kvlab == 0.83 and llama.whole_error < -0.05


def test_a_record_without_memory_lines_says_so(tmp_path):
    entry = dict(
        RECORDS[0][1],
        sglang_lines=[line for line in RECORDS[0][1]["sglang_lines"] if "Load weight" not in line],
    )
    entry.pop("not_stock", None)
    (tmp_path / "x.json").write_text(json.dumps(entry))
    (row,) = sglang_accuracy.rows(tmp_path)
    assert row.from_memory is None and "no free memory printed" in row.memory_why


@pytest.mark.parametrize("page", accuracy.PAGES, ids=lambda p: p.name)
def test_the_page_block_is_recomputed_from_the_logs(page):
    text = page.read_text()
    assert text == sglang_accuracy.render(text, ROWS), (
        f"{page}: its SGLang block is not the logs' numbers; run python -m kvlab.planning.sglang_accuracy --write"
    )
    # the vLLM renderer leaves the SGLang block alone
    assert "<!-- accuracy:sglang -->" in accuracy.render(text, accuracy.rows())


def test_a_page_without_the_block_is_an_error():
    with pytest.raises(ValueError, match="accuracy:sglang"):
        sglang_accuracy.render("# no tables\n", ROWS)


def test_the_prose_quotes_the_summary():
    # the section's sentences name n and the errors the block computes
    section = accuracy.PAGES[0].read_text().split("## SGLang")[1].split("<!-- accuracy:sglang -->")[0]
    memory = sglang_accuracy.summary([r.memory_error for r in ROWS if r.from_memory is not None])
    whole = sglang_accuracy.summary([r.whole_error for r in ROWS if r.whole is not None])
    assert memory.mae == pytest.approx(memory.median_abs, abs=5e-5)
    assert f"within {memory.mae:.2%} of SGLang's on {memory.n} logs".replace("%", " %") in section
    assert whole.mae == pytest.approx(whole.median_abs, abs=5e-5)
    assert f"{whole.mae:.2%} off on {whole.n} logs".replace("%", " %") in section
