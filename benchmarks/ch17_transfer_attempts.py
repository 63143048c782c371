"""Chapter 17's transfer claim, one attempt after another, quiet or beside a CPU-bound load.

    .venv/bin/python benchmarks/ch17_transfer_attempts.py --runs 20 --json benchmarks/results/FILE.json
    .venv/bin/python benchmarks/ch17_transfer_attempts.py --runs 20 --load --json benchmarks/results/FILE.json

Each run is one attempt with no retry: `pd.run_disaggregated` on the lab's model, prompts and probe
(book/17_cluster/lab.ipynb's parameters, `overlap=False`), checked by `DisaggResult.transfer_checks` at the lab's
band. It records both ratios, the checks that missed, the probe's and every request's samples and the load
average, and prints a line per attempt; the JSON is rewritten after each run, so a stopped sweep keeps its runs.
A lab run costs several attempts' imports and the routing and modelled sections; this runs the claim alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvlab import models
from kvlab.costs.workloads import TraceRequest
from kvlab.disagg import pd
from kvlab.engine import SamplingParams
from kvlab.engine.config import EngineConfig
from kvlab.env import env_report
from kvlab.planning import router

# book/17_cluster/lab.ipynb's parameters
KNOBS = dict(layers=4, hidden=256, heads=4, kv_heads=4, vocab=512)
PROMPT_LENS = [128, 256, 384, 512, 768, 1024, 1280, 1536]
PROBE_SIZES = [1 << 20, 1 << 22, 12 << 20]
PROBE_REPEATS = 15
BAND = (0.67, 1.5)


def attempt(run: functools.partial[pd.DisaggResult]) -> dict[str, object]:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = run()
    checks = result.transfer_checks(BAND)
    return {
        "seconds": time.perf_counter() - start,
        "load_average": load,
        "misses": [c.name for c in checks if not c.holds],
        "checks": [str(c) for c in checks],
        "median_ratio": float(np.median(result.transfer_ratios())),
        "latency_s": result.link.latency_s,
        "bytes_per_s": result.link.bytes_per_s,
        "probe": result.link.samples,
        "requests": [(t.kv_bytes, t.transfer_samples) for t in result.traces],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", action="store_true", help="beside one process spinning on the CPU")
    parser.add_argument("--json", type=Path, help="write every attempt here")
    parser.add_argument(
        "--rounds", type=int, default=PROBE_REPEATS, help="probe_repeats (the lab's by default)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    factory = functools.partial(models.tiny_model, "llama", seed=0, dtype=torch.float32, **KNOBS)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, KNOBS["vocab"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    blocks = router.roomy_num_blocks([TraceRequest(0.0, p, 8) for p in prompts], 16)
    run = functools.partial(
        pd.run_disaggregated,
        factory,
        prompts,
        params,
        EngineConfig(block_size=16, num_blocks=blocks, max_num_batched_tokens=512),
        EngineConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=True),
        probe_sizes=PROBE_SIZES,
        probe_repeats=args.rounds,
        overlap=False,
    )
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    runs: list[dict[str, object]] = []
    try:
        for number in range(1, args.runs + 1):
            runs.append(attempt(run))
            r = runs[-1]
            print(f"{number:>3} load {r['load_average']:.1f}: {'; '.join(map(str, r['checks']))}", flush=True)
            if args.json:
                report = {
                    "env": env_report("cpu"),
                    "load": args.load,
                    "band": BAND,
                    "rounds": args.rounds,
                    "runs": runs,
                }
                args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    finally:
        if spin is not None:
            spin.kill()


if __name__ == "__main__":
    main()
