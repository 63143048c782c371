"""Wall time of `kvlab --help`, `kvlab size` on a registry model and an unknown model, each in a fresh process.

Goals (on a quiet machine): `kvlab --help` under 1 s, `kvlab size` of a registry model under 2 s, an unknown
model's one-line error under 2 s. Each figure is the median of `--repeat` runs of `python -m kvlab.cli ...`
in a subprocess (interpreter start-up included, as a user sees it); HF_HUB_OFFLINE is not set, so the unknown
model asks the Hub once.

    .venv/bin/python benchmarks/bench_cli_startup.py              # 7 runs each
    .venv/bin/python benchmarks/bench_cli_startup.py --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "kvlab --help": (["--help"], 1.0),
    "kvlab size (registry)": (
        ["size", "meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--context", "8k"],
        2.0,
    ),
    "kvlab size (unknown model)": (["size", "no-such-org/no-such-model"], 2.0),
}


def seconds(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvlab.cli", *argv], capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per command (the median is printed)")
    args = parser.parse_args()
    for name, (argv, goal) in COMMANDS.items():
        seconds(argv)  # warm the file cache: the first run also reads every .pyc from disk
        median = statistics.median(seconds(argv) for _ in range(args.repeat))
        verdict = "meets" if median < goal else "MISSES"
        print(f"{name:<28} median {median:6.2f} s of {args.repeat}   goal < {goal:g} s: {verdict}")


if __name__ == "__main__":
    main()
