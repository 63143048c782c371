"""Extract BLIS's published vLLM runs into benchmarks/data/measured/blis-*.json (run once, by hand).

BLIS (llm-d's simulator, github.com/inference-sim/inference-sim, Apache-2.0) committed, in its January 2026
history under eval/ground_truth/, GuideLLM sweeps against vLLM 0.11.0 with vLLM's own OpenTelemetry request
spans (traces.json): each request's arrival, prompt and output tokens, time to first token and end-to-end
latency, as the server measured them. This script reads those files from a git mirror of that repository
(`--repo`, e.g. the one the `fetch` tool makes) at COMMIT and writes, per experiment, one small JSON: the
engine's settings from vllm.log and exp-config.yaml, the workload from profile.yaml, every request, and the
sweep's benchmarks (synchronous, throughput, constant rates) as index ranges. benchmarks/planner_vs_measured.py
replays them. Not run in CI: the stored JSONs are the data.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import yaml

COMMIT = "e7a4aa3715982f089bddd0441e85e0a7d1690ec2"  # "Add eval/ground_truth yaml and json files", 2026-01-29
REPO_URL = "https://github.com/inference-sim/inference-sim"
EXPERIMENTS = (
    "jan20-codellama-prefill-1",
    "jan20-codellama-train-1",
    "jan20-prefill-llama7b-tp1-1",
    "jan21-llama7b-train-1",
)
OUT = Path(__file__).resolve().parent / "data" / "measured"
# BLIS's evaluator replays these runs with `--hardware H100` (python_scripts/evaluator.py at d9f61a2d, the
# commit after COMMIT), whose hardware_config.json entry is the SXM part's 989.5 TFLOP/s and 3.35 TB/s.
GPU = "H100-SXM"
GPU_SOURCE = (
    f"{REPO_URL}/blob/d9f61a2d47496c5642395e8795e61e80001a2ab9/python_scripts/evaluator.py (--hardware H100) "
    "and hardware_config.json (989.5 TFLOP/s, 3.35 TB/s: the SXM datasheet)"
)


# CodeLlama-34B is not in kvlab's registry: its config.json as BLIS stores it (the Hugging Face model card's).
CONFIGS = {
    "codellama/CodeLlama-34b-Instruct-hf": (
        "77abe3fba0b52f9d477c7d27e20dce921c3a4c11",
        "model_configs/codellama-34b-instruct-hf/config.json",
    )
}


def show(repo: Path, path: str, commit: str = COMMIT) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def request_spans(text: str) -> list[dict[str, float]]:
    """vLLM's llm_request spans (one OTLP JSON document a line), sorted by arrival."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    attrs = {kv["key"]: next(iter(kv["value"].values())) for kv in sp["attributes"]}
                    out.append(
                        {
                            "start": int(sp["startTimeUnixNano"]) / 1e9,
                            "end": int(sp["endTimeUnixNano"]) / 1e9,
                            "prompt": int(attrs["gen_ai.usage.prompt_tokens"]),
                            "output": int(attrs["gen_ai.usage.completion_tokens"]),
                            "ttft": float(attrs["gen_ai.latency.time_to_first_token"]),
                            "e2e": float(attrs["gen_ai.latency.e2e"]),
                        }
                    )
    return sorted(out, key=lambda r: r["start"])


def segment(start: np.ndarray, per_benchmark: int) -> list[tuple[str, int, int]]:
    """GuideLLM's sweep as (kind, first, end) index ranges: a synchronous benchmark (one request at a time),
    a throughput burst, then constant-rate benchmarks, each a lattice of arrivals 1/rate apart (some spans
    missing: a gap of 2-4 periods continues the lattice). A fragment of under 10 requests (a client catching
    up after a stall) joins the benchmark after it; a benchmark holds at most `per_benchmark` requests."""
    n = len(start)
    gap = np.diff(start, prepend=start[0])
    burst = next(i for i in range(n - 4) if start[i + 4] - start[i] < 0.5)
    pieces: list[tuple[float | None, int, int]] = [(None, 0, burst)]
    end = burst + 1
    while end < n and gap[end] < 1.0:
        end += 1
    pieces.append((0.0, burst, end))
    first = end
    while first < n:
        period = float(np.median(gap[first + 1 : first + 7])) if first + 1 < n else 1.0
        j = first + 1
        while j < n:
            ratio = gap[j] / period
            if (j == first + 1 and ratio < 1.05) or (
                abs(ratio - round(ratio)) < 0.04 and 1 <= round(ratio) <= 4
            ):
                j += 1
            else:
                break
        pieces.append((period, first, j))
        first = j
    runs: list[tuple[str, int, int]] = []
    pending = None
    for period, a, b in pieces:
        if b - a < 10 and b < n:
            pending = a if pending is None else pending
            continue
        a, pending = (a if pending is None else pending), None
        kind = (
            "synchronous"
            if period is None
            else "throughput"
            if period == 0.0
            else f"constant {1 / period:.3g}/s"
        )
        runs.append((kind, a, b))
    # A benchmark that took the next one's first request(s) gives them back.
    fixed: list[tuple[str, int, int]] = []
    for i, (kind, a, b) in enumerate(runs):
        if fixed and fixed[-1][2] != a:
            a = fixed[-1][2]
        if b - a > per_benchmark and i + 1 < len(runs):
            b = a + per_benchmark
        fixed.append((kind, a, b))
    return fixed


def log_settings(log: str) -> dict[str, object]:
    """vLLM's version, the pool's block count and its KV cache size, as vllm.log states them."""

    def last(pattern: str) -> str:
        found = re.findall(pattern, log)
        if not found:
            raise ValueError(f"vllm.log has no line matching {pattern!r}")
        return found[-1]

    return {
        "version": last(r"API server version ([0-9.]+)"),
        "num_gpu_blocks": int(last(r"num_gpu_blocks is: ([0-9]+)")),
        "kv_cache_tokens": int(last(r"GPU KV cache size: ([0-9,]+) tokens").replace(",", "")),
        "enable_prefix_caching": last(r"enable_prefix_caching=(\w+)") == "True",
        "dtype": {"torch.bfloat16": "bf16", "torch.float16": "fp16"}[last(r"dtype=(torch\.\w+)")],
    }


def extract(repo: Path, name: str) -> dict[str, object]:
    base = f"eval/ground_truth/{name}"
    config = yaml.safe_load(show(repo, f"{base}/exp-config.yaml"))
    profile = yaml.safe_load(show(repo, f"{base}/profile.yaml"))
    settings = log_settings(show(repo, f"{base}/vllm.log"))
    spans = request_spans(show(repo, f"{base}/traces.json"))
    t0 = spans[0]["start"]
    start = np.array([s["start"] - t0 for s in spans])
    runs = segment(start, int(profile["max-requests"]))
    extra: dict[str, object] = {}
    if config["model"] in CONFIGS:
        commit, path = CONFIGS[config["model"]]
        extra["model_config"] = json.loads(show(repo, path, commit))
        extra["model_config_source"] = f"{REPO_URL}/blob/{commit}/{path}"
    return extra | {
        "source": "BLIS ground truth",
        "url": f"{REPO_URL}/tree/{COMMIT}/{base}",
        "commit": COMMIT,
        "licence": "Apache-2.0 (the repository's LICENSE)",
        "files": ["exp-config.yaml", "profile.yaml", "vllm.log", "traces.json"],
        "measured_by": "vLLM's OpenTelemetry llm_request spans (server side): arrival, TTFT, end-to-end",
        "engine": "vLLM",
        "version": settings["version"],
        "model": config["model"],
        "gpu": GPU,
        "gpu_source": GPU_SOURCE,
        "tp": int(config["tensor_parallelism"]),
        "dtype": settings["dtype"],
        "max_model_len": int(config["max_model_len"]),
        "max_num_seqs": int(config["max_num_seqs"]),
        "max_num_batched_tokens": int(config["max_num_batched_tokens"]),
        "block_size": 16,
        "enable_prefix_caching": settings["enable_prefix_caching"],
        "num_gpu_blocks": settings["num_gpu_blocks"],
        "kv_cache_tokens": settings["kv_cache_tokens"],
        "workload": {
            "generator": "GuideLLM sweep (synchronous, throughput, then constant rates)",
            "max_requests_per_benchmark": int(profile["max-requests"]),
            "shared_prefix_tokens": int(profile["data"]["prefix_tokens"]),
            "prompt_tokens": {
                k.removeprefix("prompt_tokens_") or "mean": v
                for k, v in profile["data"].items()
                if k.startswith("prompt")
            },
            "output_tokens": {
                k.removeprefix("output_tokens_") or "mean": v
                for k, v in profile["data"].items()
                if k.startswith("output")
            },
        },
        "request_fields": ["arrival_s", "prompt_tokens", "output_tokens", "ttft_s", "e2e_s"],
        "requests": [
            [round(s["start"] - t0, 4), s["prompt"], s["output"], round(s["ttft"], 5), round(s["e2e"], 5)]
            for s in spans
        ],
        "runs": [{"name": kind, "first": a, "end": b} for kind, a, b in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo", type=Path, required=True, help="a git mirror of inference-sim/inference-sim"
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in EXPERIMENTS:
        record = extract(args.repo, name)
        path = OUT / f"blis-{name}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(
            path.name,
            len(record["requests"]),
            "requests,",
            [(r["name"], r["end"] - r["first"]) for r in record["runs"]],
        )


if __name__ == "__main__":
    main()
