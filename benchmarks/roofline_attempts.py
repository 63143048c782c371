"""Chapter 4's roofline claim, one attempt after another: how close each check comes to missing, quiet and
beside a CPU-bound load.

    .venv/bin/python benchmarks/roofline_attempts.py --runs 10 --json _build/roofline-quiet.json
    .venv/bin/python benchmarks/roofline_attempts.py --runs 10 --load --json _build/roofline-loaded.json

Each run is one `timing.sweep_decode` of the lab's CPU model and points (book/04_bandwidth_bound/lab.ipynb's
parameters) checked by `timing.check_roofline`, one attempt with no retry. It prints, per attempt, the checks
that missed, batch-1 measured/predicted beside the lowest allowed, and the batch below the critical batch
beside its bound (`timing.batch_cost`): the margins a lab's three attempts have. `flakiness.py` runs whole labs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from kvlab import models
from kvlab.env import env_report
from kvlab.experiments import timing

CONTEXTS, BATCHES, BATCH_CONTEXT = [16, 64, 256], [1, 4, 16, 64], 16


def attempt(model: torch.nn.Module) -> dict[str, object]:
    sweep = timing.sweep_decode(
        model, timing.decode_points(CONTEXTS, BATCHES, BATCH_CONTEXT), repeat=3, rounds=5
    )
    checks = timing.check_roofline(sweep, CONTEXTS, BATCHES, BATCH_CONTEXT, dominance=3, ratio_high=2)
    single = sweep.at_contexts(CONTEXTS)
    batched = [c for c in checks if c.name.endswith("in batch-1 steps")]
    return {
        "misses": [c.name for c in checks if not c.holds],
        "ratios": [r.best_ratio for r in single],
        "floors": [timing.prediction_floor(r, sweep.on_cpu) for r in single],
        "ratio_over_floor": min(r.best_ratio / timing.prediction_floor(r, sweep.on_cpu) for r in single),
        "batch_check": batched[0].detail if batched else None,
        "read_cost": {str(b): k for b, k in sweep.read_cost.items()},
        "weight_read_bytes_per_s": sweep.hw.weight_read_bytes_per_s,
        "copy_bytes_per_s": sweep.hw.bandwidth_bytes_per_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--load", action="store_true", help="beside one process spinning on the CPU")
    parser.add_argument("--json", type=Path, help="write every attempt here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = models.tiny_model("llama", layers=8, hidden=1024, heads=16, kv_heads=8, vocab=1024, seed=0)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    runs = []
    try:
        for number in range(1, args.runs + 1):
            runs.append(attempt(model))
            r = runs[-1]
            print(
                f"{number:>3} misses {r['misses'] or 'none'}; ratio/floor at least {r['ratio_over_floor']:.2f}; {r['batch_check']}"
            )
    finally:
        if spin is not None:
            spin.kill()
    if args.json:
        report = {"env": env_report("cpu"), "load": args.load, "runs": runs}
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
