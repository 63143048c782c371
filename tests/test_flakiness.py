"""benchmarks/flakiness.py's report: failures per lab and per assert, and per-claim attempt miss rates."""

import importlib.util
import sys
from pathlib import Path

from kvlab import claims

spec = importlib.util.spec_from_file_location(
    "flakiness", Path(__file__).resolve().parents[1] / "benchmarks" / "flakiness.py"
)
flakiness = importlib.util.module_from_spec(spec)
sys.modules["flakiness"] = flakiness
spec.loader.exec_module(flakiness)


def test_report_counts_failures_and_attempt_misses():
    miss, hold = claims.AttemptLine("ITL", 1, 3, False), claims.AttemptLine("ITL", 2, 3, True)
    runs = [
        flakiness.Run("book/08_x", 1, 10.0, 1.0, "", [miss, hold]),
        flakiness.Run("book/08_x", 2, 12.0, 1.0, "AssertionError: ITL: missed all 3 attempts", [miss] * 3),
    ]
    text = flakiness.report(runs, load=1)
    assert "beside 1 CPU-bound" in text
    assert "book/08_x                           2      1" in text
    assert "1x AssertionError: ITL: missed all 3 attempts" in text
    row = next(line for line in text.splitlines() if line.startswith("08_x: ITL"))
    assert row.split()[-5:] == ["5", "4", "0.80", "3", "5.1e-01"]


def test_report_files_adds_up_sweeps_of_one_load(tmp_path):
    hold = claims.AttemptLine("ITL", 1, 3, True)
    for name, number in (("a", 1), ("b", 2)):
        run = flakiness.Run("book/08_x", number, 10.0, 1.0, "", [hold], 1.2)
        flakiness._write(tmp_path / f"{name}.json", [run], 0)
    text = flakiness.report_files([tmp_path / "a.json", tmp_path / "b.json"])
    assert text.startswith("flakiness, quiet:")
    assert "book/08_x                           2      0" in text
