"""The serving simulator against the real engine on this machine: errors per metric, CPU-time vs wall clock,
and how often chapter 14's claim misses one attempt.

Calibrates `kvlab.planning.simulate`'s step cost on calibration traces, predicts other traces at three loads (below, near
and past saturation) and prints, for the engine timed on its process CPU time and on the wall clock side by side,
the relative error of each latency percentile and of throughput (the median over rounds), and the per-step ratio
of measured to predicted seconds (where an error comes from: a ratio far above 1 at P99 is another process's time
slice). Then, from the CPU-time rounds, the spread of each error over single rounds and the rate at which one
attempt of the lab's claim (`kvlab.planning.simulate.validation_checks`: every error of the median of `val_repeats` rounds
within `kvlab.planning.simulate.VALIDATION_BANDS`) misses, estimated by drawing rounds from those measured (bootstrap).
With a per-attempt miss rate p and k attempts the claim fails about p**k of the runs.

    .venv/bin/python benchmarks/bench_simulator.py                  # 3 rounds per clock
    .venv/bin/python benchmarks/bench_simulator.py --repeats 20     # the spread behind the bands
    .venv/bin/python benchmarks/bench_simulator.py --repeats 20 --load 1   # beside one CPU-bound process
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os

import numpy as np

from kvlab.book.report import Table
from kvlab.costs.workloads import synthetic_trace
from kvlab.models import tiny_model
from kvlab.planning import simulate as sim

# Chapter 14's validation set-up (its lab's parameters cell): the pool preempts past saturation.
KNOBS = dict(
    num_blocks=48, block_size=8, max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=False
)


def _trace(n: int, rate: float, seed: int) -> list[sim.TraceRequest]:
    return synthetic_trace(
        n, "sharegpt", request_rate=rate, scale=0.1, seed=seed, max_input_len=60, max_output_len=40
    )


def _spin() -> None:
    while True:
        pass


def attempt_miss_rate(
    rows: list[sim.ValidationRow], rounds: int, draws: int = 10_000, seed: int = 0
) -> tuple[float, dict[str, float]]:
    """Bootstrap: the share of draws of `rounds` measured rounds whose median errors miss a band, and per key
    the share where that key misses (some load)."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(rows[0].round_errors.values())))
    misses, by_key = 0, dict.fromkeys(sim.VALIDATION_KEYS, 0)
    for _ in range(draws):
        pick = rng.integers(n, size=rounds)
        missed = {
            k
            for row in rows
            for k, errors in row.round_errors.items()
            if abs(float(np.median(np.array(errors)[pick]))) > sim.band_for(k)
        }
        misses += bool(missed)
        for k in missed:
            by_key[k] += 1
    return misses / draws, {k: v / draws for k, v in by_key.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of calibration + validation replays")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes to run beside it")
    parser.add_argument("--val-repeats", type=int, default=3, help="rounds per attempt in the lab")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    try:
        print(f"load average at the start: {os.getloadavg()[0]:.2f}, {args.load} CPU-bound beside")
        model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")
        calibration_traces = [_trace(40, math.inf, 11), _trace(20, 10.0, 12)]
        loads = {"6/s": _trace(30, 6.0, 2), "20/s": _trace(40, 20.0, 2), "saturated": _trace(40, math.inf, 2)}
        keys = [k.removesuffix("_ms") for k in sim.VALIDATION_KEYS]
        errors, ratios, spread = [], [], []
        cpu_rows: list[sim.ValidationRow] = []
        for clock in ("cpu", "wall"):
            _, rows = sim.validate(
                model, calibration_traces, loads, clock=clock, repeats=args.repeats, resample=True, **KNOBS
            )
            cpu_rows = cpu_rows or rows
            for row in rows:
                errors.append((clock, row.label, *[f"{row.errors[k]:+.0%}" for k in sim.VALIDATION_KEYS]))
                q = np.percentile(row.step_ratio, (1, 50, 90, 99))
                ratios.append((clock, row.label, *[f"{x:.2f}" for x in q]))
        for row in cpu_rows:
            spread.append(
                (
                    row.label,
                    *[
                        f"{np.min(v):+.0%}..{np.max(v):+.0%}"
                        for v in (np.array(row.round_errors[k]) for k in sim.VALIDATION_KEYS)
                    ],
                )
            )
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        print(Table(["clock", "load", *keys], errors, caption="median over rounds"))
        print()
        print(Table(["load", *keys], spread, caption=f"cpu clock, single rounds: min..max of {args.repeats}"))
        print()
        print(Table(["clock", "load", "P1", "P50", "P90", "P99 measured/predicted step"], ratios))
        if args.repeats >= 3:
            print()
            for r in sorted({1, 3, 5, args.val_repeats}):
                p, by_key = attempt_miss_rate(cpu_rows, r)
                worst = ", ".join(f"{k} {v:.1%}" for k, v in by_key.items() if v)
                print(
                    f"median of {r} rounds: one attempt misses {p:.1%} ({worst or 'no key'}); "
                    f"3 attempts fail {p**3:.1e}"
                )
    finally:
        for p in spinners:
            p.terminate()


if __name__ == "__main__":
    main()
