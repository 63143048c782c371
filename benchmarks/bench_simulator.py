"""The serving simulator against the real engine on this machine: errors per metric, CPU-time vs wall clock.

Calibrates `kvlab.simulate`'s step cost on calibration traces, predicts other traces at three loads (below, near
and past saturation) and prints, for the engine timed on its process CPU time and on the wall clock side by side,
the relative error of each latency percentile and of throughput, and the per-step ratio of measured to predicted
seconds (where an error comes from: a ratio far above 1 at P99 is another process's time slice).

    .venv/bin/python benchmarks/bench_simulator.py               # 3 rounds per clock
    .venv/bin/python benchmarks/bench_simulator.py --repeats 5
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from kvlab import simulate as sim
from kvlab.models import tiny_model
from kvlab.report import Table
from kvlab.workloads import synthetic_trace

KNOBS = dict(
    num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=False
)


def _trace(n: int, rate: float, seed: int) -> list[sim.TraceRequest]:
    return synthetic_trace(
        n, "sharegpt", request_rate=rate, scale=0.1, seed=seed, max_input_len=60, max_output_len=40
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of calibration + validation replays")
    args = parser.parse_args()
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")
    calibration_traces = [_trace(40, math.inf, 11), _trace(20, 10.0, 12)]
    loads = {"6/s": _trace(30, 6.0, 2), "20/s": _trace(40, 20.0, 2), "saturated": _trace(40, math.inf, 2)}
    keys = [k.removesuffix("_ms") for k in sim.VALIDATION_KEYS]
    errors, ratios = [], []
    for clock in ("cpu", "wall"):
        _, rows = sim.validate(
            model, calibration_traces, loads, clock=clock, repeats=args.repeats, resample=True, **KNOBS
        )
        for row in rows:
            errors.append((clock, row.label, *[f"{row.errors[k]:+.0%}" for k in sim.VALIDATION_KEYS]))
            q = np.percentile(row.step_ratio, (1, 50, 90, 99))
            ratios.append((clock, row.label, *[f"{x:.2f}" for x in q]))
    print(Table(["clock", "load", *keys], errors))
    print()
    print(Table(["clock", "load", "P1", "P50", "P90", "P99 measured/predicted step"], ratios))


if __name__ == "__main__":
    main()
