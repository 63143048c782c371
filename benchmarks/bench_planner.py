"""How `kvlab plan` scales with `--requests`: seconds, peak memory and requests simulated per CPU-second.

Each size runs in a fresh process, so that its peak resident memory is its own: Llama-3.1-8B on one H100 SXM
at 20 requests/s, vLLM's defaults (the issue's case). A plan runs several simulations (the replica search, the
chosen count, the goodput bisection); the rate counts every request of every one of them.

    .venv/bin/python benchmarks/bench_planner.py                 # 200 and 2,000 requests
    .venv/bin/python benchmarks/bench_planner.py --requests 200 2000 20000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

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


def measure(requests: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(requests)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[200, 2000])
    args = parser.parse_args()
    rows = []
    for n in args.requests:
        r = measure(n)
        rows.append(
            [
                f"{n:,}",
                r["dp"],
                f"{r['simulated']:,}",
                f"{r['wall_s']:.1f}",
                f"{r['cpu_s']:.1f}",
                f"{r['peak_rss_mib']:.0f}",
                f"{r['simulated'] / r['cpu_s']:,.0f}",
            ]
        )
    header = ["--requests", "dp", "requests simulated", "wall s", "CPU s", "peak RSS MiB", "requests / CPU-s"]
    print(repr(Table(header, rows, caption="kvlab plan Llama-3.1-8B, H100 SXM, 20 req/s")))


if __name__ == "__main__":
    main()
