"""Papermill smoke sweep: run labs with non-default parameters and check what they computed.

This is what a reader does with `kvlab sweep` (or `papermill -p ...`); the checks read the values each lab glued,
from the sweep's rows (the CSV it writes). Run by `make test` (and `make smoke`).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from kvlab.book.sweep import Sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]


def run(lab: str, out_dir: Path, grid: dict[str, list[Any]], **fixed: Any) -> list[dict[str, Any]]:
    """One row per grid point: its parameters and the lab's glued scalars; any failed point fails the smoke."""
    plan = Sweep(ROOT / lab, grid, fixed, out_dir / Path(lab).parent.name)
    rows = run_sweep(plan, progress=False).rows
    failed = [row["error"] for row in rows if row["status"] != "ok"]
    assert not failed, f"{lab}: {failed}"
    return rows


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        # Sweep chapter 1 over KV heads: per-token bytes must scale with them (layers x 2 x kv x head_dim x 4 B).
        rows = run(
            "book/01_cache_contents/lab.ipynb",
            out_dir,
            {"kv_heads": [1, 4]},
            layers=2,
            hidden=128,  # head_dim 16; recomputing 1024 tokens outweighs the per-step overhead the lab asserts on
            heads=8,
            new_tokens=4,
            history_lengths=[16, 1024],
            repeat=2,
            seed=1,
        )
        for g in rows:
            kv_heads = g["kv_heads"]
            expected = 2 * 2 * kv_heads * 16 * 4
            assert g["ch1_bytes_per_token"] == expected, (kv_heads, g["ch1_bytes_per_token"], expected)
            assert g["ch1_kv_heads"] == kv_heads and g["ch1_layers"] == 2
            print(f"chapter 1, kv_heads={kv_heads}: {expected} B per token, as predicted")
        # Chapter 2 at fp8 KV on two models: Falcon-7B (MQA) is the smaller, 32 layers x 2 x 1 x 64 x 1 B.
        (g,) = run(
            "book/02_sizing/lab.ipynb",
            out_dir,
            {"kv_dtype": ["fp8"]},
            models_to_size=["meta-llama/Llama-3.1-8B", "tiiuae/falcon-7b", "deepseek-ai/DeepSeek-V3"],
            seq_lens=[1, 9, 20],
            tiny_window=8,
            contexts=[1024, 8192],
            equal_param_hidden=64,
        )
        assert g["ch2_min_model"] == "tiiuae/falcon-7b", g["ch2_min_model"]
        assert g["ch2_min_bytes"] == "4 KiB", g["ch2_min_bytes"]
        assert g["ch2_llama8b_bytes"] == "64 KiB", g["ch2_llama8b_bytes"]
        print("chapter 2 at fp8: Falcon-7B 4 KiB/token, Llama 3.1 8B 64 KiB/token, as predicted")
    print("smoke sweep: 3 passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
