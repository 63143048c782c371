"""The planner against measured serving runs: every stored run replayed through kvlab.planning.simulate.

Reads benchmarks/data/measured/*.json (runs of vLLM and SGLang on H100, A100 and L4 GPUs, each file with its
source, commit or URL and licence), replays each workload on the planner's step cost, and prints per run the
predicted and measured TTFT, ITL and end-to-end latency and the error, then per source and per GPU lines, the
calibration (in-sample) and held-out (out-of-sample) lines, and last

    all: N runs, TTFT MAPE X %, ITL MAPE Y %, E2E MAPE Z %

Two sets of constants: `cited`, what `kvlab plan` runs (kvlab.costs.roofline's cited ceilings and overhead, fitted
to none of these runs), and `fitted`, the same model plus a front-end delay per request, its four constants
tuned on the synchronous benchmark of each BLIS sweep only (kvlab.planning.measured.CALIBRATION). The `all:`
line is the fitted model's. `--fit` tunes the constants again (minutes); otherwise the stored ones are used.
`--write` stores the table (src/kvlab/data/planner_vs_measured.json, which `kvlab plan` quotes) and chapter 14's
figure (book/14_capacity_planning/planner_vs_measured.svg). Chapter: *Capacity planning*.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.book import planner_figure
from kvlab.book.diagrams import save_svg
from kvlab.planning import measured

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "measured"
FIGURE = ROOT / "book" / "14_capacity_planning" / "planner_vs_measured.svg"


def run_lines(rows: list[measured.Row]) -> list[str]:
    """One line per run: predicted / measured (ms) and the error of each metric."""
    lines = []
    for r in rows:
        cells = "  ".join(
            f"{measured.NAMES[m]} {r.predicted[m]:8.1f} / {r.measured[m]:8.1f} {r.error(m):+5.0%}"
            for m in measured.METRICS
        )
        split = "*" if r.split == "calibration" else " "
        lines.append(f"  {split}{r.run:<44} {r.gpu:<9} {r.statistic:<6} {cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="tune the constants on the calibration runs again")
    parser.add_argument("--write", action="store_true", help="store the table and chapter 14's figure")
    args = parser.parse_args(argv)
    records = measured.load(DATA)
    fitted = measured.fit(records) if args.fit else measured.stored().models["fitted"]
    table = measured.Table({"cited": measured.CITED, "fitted": fitted})
    for name, constants in table.models.items():
        rows = measured.replay_all(records, constants)
        table.rows[name] = rows
        values = ", ".join(f"{k} {v:.4g}" for k, v in constants.as_dict().items())
        print(f"== {name} constants: {values}")
        print("  (* calibration run; predicted / measured in ms, error = predicted / measured - 1)")
        print("\n".join(run_lines(rows)))
        worst = ", ".join(
            f"{r.run} ({', '.join(f'{measured.NAMES[m]} {r.error(m):+.0%}' for m in measured.METRICS)})"
            for r in measured.worst(rows)
        )
        print(f"worst ({name}): {worst}")
        lines = measured.summary_lines(rows)
        print("\n".join(f"{name} {line}" for line in lines[:-1]))
    print(f"cited {measured.mape_line('all', table.rows['cited'])}")
    print(measured.mape_line("all", table.rows["fitted"]))
    if args.write:
        measured.STORED.write_text(table.dumps())
        save_svg(planner_figure.planner_vs_measured(table.rows["fitted"]), FIGURE)
        print(f"wrote {measured.STORED.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
