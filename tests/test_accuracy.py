"""The accuracy appendix (book/appendix_accuracy): every number on it recomputed from tests/data/vllm_logs, the
fixed calibration split, the fit, and the floor's bound on the held-out half."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.costs import budget
from kvlab.planning import accuracy

ROWS = accuracy.rows()


def test_the_split_is_fixed_by_name():
    # sha256("c") ends in ...c6 (even), sha256("a") in ...bb (odd): a record keeps its half whatever is added
    assert (accuracy.half("c"), accuracy.half("a")) == ("calibration", "held-out")
    slugs = [r.slug for r in ROWS]
    assert {accuracy.half(s) for s in slugs} == set(accuracy.HALVES)


@pytest.mark.parametrize("page", accuracy.PAGES, ids=lambda p: p.name)
def test_the_page_is_recomputed_from_the_logs(page):
    text = page.read_text()
    assert text == accuracy.render(text, ROWS), (
        f"{page}: its tables are not the logs' numbers; run python -m kvlab.planning.accuracy --write"
    )


def test_a_page_without_its_blocks_is_an_error():
    with pytest.raises(ValueError, match="accuracy:summary"):
        accuracy.render("# no tables\n", ROWS)


def test_every_log_is_predicted_or_says_why_in_one_line():
    assert sum(r.predicted for r in ROWS) >= 10
    for row in ROWS:
        assert row.predicted or (row.why and "\n" not in row.why), row.slug


def test_the_floor_never_exceeds_vllms_pool_by_more_than_2_percent():
    for row in ROWS:
        if row.predicted:
            assert row.floor_error <= accuracy.FLOOR_ABOVE, f"{row.slug}: floor {row.floor_error:+.1%}"
            assert row.floor is not None and row.expected is not None and row.floor <= row.expected


def test_the_central_estimates_are_the_fit_on_the_calibration_half():
    # each fitted estimate one grid step either way fits the calibration half no better (a coordinate-wise optimum)
    base = accuracy.objective(budget.CENTRAL)
    for name, values in accuracy.GRID.items():
        value = getattr(budget.CENTRAL, name)
        assert value in values, name
        at = values.index(value)
        for other in values[max(at - 1, 0) : at + 2]:
            trial = dataclasses.replace(budget.CENTRAL, **{name: other})
            assert accuracy.objective(trial) >= base - 1e-6, f"{name}={other} fits better than {value}"


def _entry(**changes):
    entry = {
        "slug": "synthetic-h100-llama31-8b",
        "vllm_version": "0.34.0",
        "format": "v1",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": "H100-SXM",
        "tp": 1,
        "printed": {"available_kv_bytes": 60 * 2**30},
    }
    return entry | changes


def test_a_034_log_is_held_against_its_measured_pool():
    missing = accuracy.predict(_entry())
    assert missing is not None and not missing.predicted and "Extended KV cache" in missing.why
    found = accuracy.predict(
        _entry(printed={"available_kv_bytes": 60 * 2**30, "extended_kv_bytes": 58 * 2**30})
    )
    assert found is not None and found.predicted and found.vllm_pool == 58 * 2**30
    assert found.rule.startswith("vLLM 0.34.0")


@pytest.mark.parametrize(
    ("entry", "version"),
    [
        (dict(format="v0", vllm_version=None), "v0"),
        (dict(format="v0", vllm_version="0.10.1"), "v0"),
        (dict(format="v0", vllm_version="0.6.3"), "0.6.3"),
        (dict(format="v1", vllm_version=None), "v1"),
        (dict(format="v1", vllm_version="0.27.1"), "0.27.1"),
    ],
)
def test_a_log_is_sized_by_its_release_or_its_engine(entry, version):
    assert accuracy._version(entry) == version
