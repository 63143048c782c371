"""Sentences that quote committed data state what the data says, in both editions."""

import glob
import json
import math
import re
import statistics
from pathlib import Path

from kvlab.experiments.timing import WORK_BAND
from kvlab.units import format_ceil, format_floor

ROOT = Path(__file__).resolve().parents[1]


def counts(quiet: bool) -> tuple[int, int, int, int]:
    """Runs, failed runs, attempts and missed attempts of lab 14 in the committed flakiness sweeps."""
    runs = failed = attempts = missed = 0
    for path in sorted(glob.glob(str(ROOT / "benchmarks/results/flakiness-2026-12-01-*.json"))):
        data = json.loads(Path(path).read_text())
        if (data["load"] == 0) != quiet:
            continue
        for run in data["runs"]:
            if "14_capacity_planning" in run["lab"]:
                runs += 1
                failed += bool(run["failed_at"])
                attempts += len(run["attempts"])
                missed += sum(not a["holds"] for a in run["attempts"])
    return runs, failed, attempts, missed


def test_chapter_14_states_the_sweeps_counts():
    q_runs, q_failed, q_attempts, q_missed = counts(quiet=True)
    l_runs, l_failed, l_attempts, l_missed = counts(quiet=False)
    en = " ".join((ROOT / "book/14_capacity_planning/index.md").read_text().split())
    assert f"In {q_runs} quiet runs, {q_missed} of {q_attempts} attempts missed" in en
    assert q_failed == 0 and "and no run failed" in en
    assert f"{l_missed} of {l_attempts} attempts missed and {l_failed} run in {l_runs} failed" in en
    zh = (ROOT / "book/zh/14_capacity_planning.md").read_text()
    assert f"安静时 {q_runs} 次运行中，{q_attempts} 次尝试有 {q_missed} 次未通过" in zh
    assert f"{l_attempts} 次尝试有 {l_missed} 次未通过，{l_runs} 次运行中有 {l_failed} 次失败" in zh
    assert not re.search(r"4,000", en + zh)


def test_chapter_4_states_the_floor_margin_rounded_down():
    margins = [
        run["ratio_over_floor"]
        for path in sorted(glob.glob(str(ROOT / "benchmarks/results/roofline-attempts-2026-12-03-*.json")))
        for run in json.loads(Path(path).read_text())["runs"]
    ]
    # A lower bound is rounded down, never up.
    low = f"{math.floor(min(margins) * 100) / 100:.2f}"
    assert f"at least {low}× its floor" in (ROOT / "book/04_bandwidth_bound/index.md").read_text()
    assert f"至少是其下限的 {low}×" in (ROOT / "book/zh/04_bandwidth_bound.md").read_text()


def test_chapter_17_names_the_statistic_the_link_fit_uses():
    from kvlab.disagg import pd

    assert "np.median" in Path(pd.__file__).read_text()
    assert "fastest sample" not in (ROOT / "book/17_cluster/index.md").read_text()
    assert "最快的一次" not in (ROOT / "book/zh/17_cluster.md").read_text()


def paired_medians(pattern: str) -> list[float]:
    """The paired median work ratio of every attempt in the committed decode-band sweeps matching `pattern`."""
    return [
        statistics.median(run["paired_work_ratios"])
        for path in sorted(glob.glob(str(ROOT / f"benchmarks/results/{pattern}")))
        for run in json.loads(Path(path).read_text())["runs"]
    ]


def span(values: list[float]) -> str:
    """A range rounded outwards, as the pages quote it."""
    return f"{format_floor(min(values), 2)}–{format_ceil(max(values), 2)}"


def test_chapters_3_and_4_state_the_paired_work_medians():
    ch3 = paired_medians("decode-band-2026-12-08-ch3-quiet.json")
    ch4 = paired_medians("decode-band-2026-12-08-ch4-*.json")
    assert len(ch3) == 20 and len(ch4) == 40
    en3 = " ".join((ROOT / "book/03_prefill_decode/index.md").read_text().split())
    assert f"20 attempts ran {span(ch3)}" in en3
    assert f"20 次尝试落在 {span(ch3)}" in (ROOT / "book/zh/03_prefill_decode.md").read_text()
    en4 = " ".join((ROOT / "book/04_bandwidth_bound/index.md").read_text().split())
    assert f"the median work ratio ran {span(ch4)}" in en4 and "none of the 40 would have passed" in en4
    zh4 = (ROOT / "book/zh/04_bandwidth_bound.md").read_text()
    assert f"计算时间比值的中位数在 {span(ch4)} 之间" in zh4
    # none of them a 2x wrong roofline could pass: doubled above the band, halved below it
    low, high = WORK_BAND
    assert all(2 * m > high and m / 2 < low and low <= m <= high for m in ch3 + ch4)
