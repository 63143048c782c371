"""How `kvlab plan` scales with `--requests`: seconds, peak memory and requests simulated per CPU-second.

Each size runs in a fresh process, so that its peak resident memory is its own: Llama-3.1-8B on one H100 SXM
at 20 requests/s, vLLM's defaults (the issue's case). A plan runs several simulations (the replica search, the
chosen count, the goodput bisection); the rate counts every request of every one of them.

    .venv/bin/python benchmarks/bench_planner.py                 # 200 and 2,000 requests
    .venv/bin/python benchmarks/bench_planner.py --requests 200 2000 20000

`--baseline DIR` runs each size under another checkout's `src/` as well, alternately with this one, and prints
the speed-up: before and after in one run, on one machine (`git worktree add /tmp/base COMMIT`, then
`--baseline /tmp/base`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kvlab.book.report import Table

CHILD = r"""
import json, resource, sys, time
from kvlab.costs.workloads import Workload
from kvlab.planning import plan

simulated = 0
inner = plan.simulate

def counting(trace, *args, **kwargs):
    global simulated
    trace = list(trace)
    simulated += len(trace)
    return inner(trace, *args, **kwargs)

plan.simulate = counting
n = int(sys.argv[1])
wall, cpu = time.perf_counter(), time.process_time()
result = plan.plan(
    "meta-llama/Llama-3.1-8B", "H100-SXM", workload=Workload(rate=20.0, num_requests=n),
    targets=plan.Targets(ttft_ms=2000, itl_ms=100),
)
print(json.dumps({
    "requests": n, "dp": result.dp, "simulated": simulated,
    "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def measure(requests: int, src: Path | None = None) -> dict[str, float]:
    """One plan in a fresh process: under this checkout's kvlab, or under `src` (another checkout's src/)."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(requests)], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--baseline", type=Path, help="another checkout, run side by side (its src/)")
    args = parser.parse_args()
    base_src = None
    if args.baseline is not None:
        base_src = args.baseline / "src"
        if not (base_src / "kvlab").is_dir():
            parser.error(f"--baseline {args.baseline}: no src/kvlab there")
    rows = []
    for n in args.requests:
        before = measure(n, base_src) if base_src is not None else None
        r = measure(n)
        row = [
            f"{n:,}",
            r["dp"],
            f"{r['simulated']:,}",
            f"{r['wall_s']:.1f}",
            f"{r['cpu_s']:.1f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['simulated'] / r['cpu_s']:,.0f}",
        ]
        if before is not None:
            row += [
                f"{before['cpu_s']:.1f}",
                f"{before['peak_rss_mib']:.0f}",
                f"{before['simulated'] / before['cpu_s']:,.0f}",
                f"{before['cpu_s'] / r['cpu_s']:.2f}x",
            ]
        rows.append(row)
    header = ["--requests", "dp", "requests simulated", "wall s", "CPU s", "peak RSS MiB", "requests / CPU-s"]
    if base_src is not None:
        header += ["baseline CPU s", "baseline MiB", "baseline req / CPU-s", "speed-up"]
    print(repr(Table(header, rows, caption="kvlab plan Llama-3.1-8B, H100 SXM, 20 req/s")))


if __name__ == "__main__":
    main()
