"""The decode claims of chapters 3 and 4, one attempt after another: where a true prediction's work lands in
its band, and where a prediction with its bandwidth 2x wrong would land, quiet and beside a CPU-bound load.

    .venv/bin/python benchmarks/decode_band_attempts.py --chapter 4 --runs 20 --json _build/ch4-quiet.json
    .venv/bin/python benchmarks/decode_band_attempts.py --chapter 3 --runs 20 --load --json _build/ch3-loaded.json
    .venv/bin/python benchmarks/decode_band_attempts.py --report benchmarks/results/decode-band-*.json

Each run is one `timing.sweep_decode` of the lab's CPU model and points (the lab's `parameters` cell), checked
by the lab's check (`timing.check_context_growth` or `timing.check_roofline`), one attempt with no retry. Per
batch-1 context it records the work ratio, (fastest step - overhead) / predicted work, over the whole sweep;
and per round and context the paired one, each round's steps against its own ceilings and hollow steps
(`DecodeSweep.paired_rows`): what the band (`timing.WORK_BAND`) bounds in their median. A prediction with
the bandwidth 2x too high doubles every work ratio; 2x too low halves it, so the printed margins say how far each mutation lands outside the band, and the
true one inside.
`flakiness.py` runs whole labs; this isolates one claim's measurement, 20 attempts in minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvlab import models
from kvlab.env import env_report
from kvlab.experiments import timing

# The labs' CPU parameters (book/03_prefill_decode and book/04_bandwidth_bound, `parameters` cells)
LABS = {
    3: dict(
        model=dict(layers=4, hidden=256, heads=4, kv_heads=4, vocab=1024),
        contexts=[16, 256, 1024, 4096],
        batches=[1, 4, 16, 64],
        batch_context=128,
        band=timing.WORK_BAND,
    ),
    4: dict(
        model=dict(layers=8, hidden=1024, heads=16, kv_heads=8, vocab=1024),
        contexts=[16, 64, 256],
        batches=[1, 4, 16, 64],
        batch_context=16,
        band=timing.WORK_BAND,
    ),
}


def attempt(chapter: int, model: torch.nn.Module) -> dict[str, object]:
    lab = LABS[chapter]
    contexts, batches, at = lab["contexts"], lab["batches"], lab["batch_context"]
    start = time.perf_counter()
    sweep = timing.sweep_decode(model, timing.decode_points(contexts, batches, at), repeat=3, rounds=5)
    if chapter == 3:
        checks = timing.check_context_growth(
            sweep, contexts, batches, at, min_predicted_growth=1.5, ratio_high=2, band=lab["band"]
        )
    else:
        checks = timing.check_roofline(
            sweep, contexts, batches, at, dominance=3, ratio_high=2, band=lab["band"]
        )
    single = sweep.at_contexts(contexts)
    work = [timing.work_ratio(r) for r in single]
    # what the band bounds: the median over every round and context, each round against its own ceilings
    paired = [timing.work_ratio(r) for r in sweep.paired_rows(contexts)]
    median = statistics.median(paired)
    low, high = lab["band"]
    return {
        "seconds": time.perf_counter() - start,
        "misses": [c.name for c in checks if not c.holds],
        "work_ratios": work,
        "paired_work_ratios": paired,
        "best_ratios": [r.best_ratio for r in single],
        "overhead_share": [r.overhead_s / r.prediction_s for r in single],
        "median_work_ratio": median,
        # > 1: inside the band by that factor; the mutations' margins: > 1 outside it by that factor
        "true_margin": min(median / low, high / median),
        "bandwidth_doubled_margin": 2 * median / high,
        "bandwidth_halved_margin": low / (median / 2),
        "load_average": os.getloadavg()[0],
    }


def sweep_table(paths: list[Path]) -> str:
    """Per sweep file, at the lab's band as it is now (a file records the band it ran under): the attempts,
    the range of their median work ratios, how many a true prediction misses, and how many a prediction with
    its bandwidth doubled or halved would pass (the median check alone; a halved one also meets the floors)."""
    lines = [
        f"{'file':44} {'ratios':>6} {'runs':>4} {'medians':>11} {'band':>12} {'true missed':>11} {'x2 held':>7} {'/2 held':>7}"
    ]
    for path in paths:
        data = json.loads(path.read_text())
        low, high = LABS[data["chapter"]]["band"]
        # sweeps before the rounds were paired (2026-12-07) hold only the whole-sweep ratios
        key = "paired_work_ratios" if "paired_work_ratios" in data["runs"][0] else "work_ratios"
        medians = [statistics.median(r[key]) for r in data["runs"]]
        missed = sum(not low <= m <= high for m in medians)
        doubled = sum(low <= 2 * m <= high for m in medians)
        halved = sum(low <= m / 2 <= high for m in medians)
        lines.append(
            f"{path.name:44} {key[:6]:>6} {len(medians):>4} {min(medians):>5.2f}-{max(medians):<5.2f} "
            f"{f'{low:g}-{high:g}':>12} {missed:>11} {doubled:>7} {halved:>7}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--report", nargs="+", type=Path, metavar="JSON", help="print earlier sweeps, run nothing"
    )
    parser.add_argument("--chapter", type=int, choices=sorted(LABS))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", action="store_true", help="beside one process spinning on the CPU")
    parser.add_argument("--json", type=Path, help="write every attempt here")
    args = parser.parse_args()
    if args.report:
        print(sweep_table(args.report))
        return
    if args.chapter is None:
        parser.error("name --chapter 3 or 4, or --report JSON files")
    torch.set_num_threads(1)
    model = models.tiny_model("llama", **LABS[args.chapter]["model"], seed=0)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    runs = []
    try:
        for number in range(1, args.runs + 1):
            runs.append(attempt(args.chapter, model))
            r = runs[-1]
            work = ", ".join(f"{w:.2f}" for w in r["work_ratios"])
            print(
                f"{number:>3} work ratios {work} (median {r['median_work_ratio']:.2f}); misses {r['misses'] or 'none'}; margins: true "
                f"{r['true_margin']:.2f}, bandwidth x2 {r['bandwidth_doubled_margin']:.2f}, "
                f"/2 {r['bandwidth_halved_margin']:.2f} ({r['seconds']:.0f} s, load {r['load_average']:.1f})",
                flush=True,
            )
            if args.json:
                report = {
                    "chapter": args.chapter,
                    "env": env_report("cpu"),
                    "load": args.load,
                    "band": LABS[args.chapter]["band"],
                    "runs": runs,
                }
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    finally:
        if spin is not None:
            spin.kill()
    held = sum(not r["misses"] for r in runs)
    print(f"chapter {args.chapter}: {held} of {len(runs)} attempts held; band {LABS[args.chapter]['band']}")


if __name__ == "__main__":
    main()
