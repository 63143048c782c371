"""Chapter 11's long accuracy run: every KV-cache variant against the fp32 cache on >= 20k tokens of real English.

The text is this book's own prose, shipped with kvlab (`kvlab/data/book_prose.txt`, `kvlab.experiments.quant.evaluation_text`).
`kvlab.experiments.quant.accuracy` scores it in segments of `--segment` tokens, each fed `--chunk` tokens at a time into a fresh
cache (the first chunk of a segment is its unscored prefix). The result, with its provenance (command, commit,
versions, device, CPU and wall seconds), goes to a JSON file that lab 11 shows when it is present:

    .venv/bin/python benchmarks/kv_quant_perplexity.py --out book/11_kv_quantization/full_run.json

On a 2-core CPU this takes many minutes (about 230 tokens per CPU-second per variant, six passes); lab 11 computes
the same numbers itself at `ppl_tokens` of its choosing, and at >= 20k tokens on a GPU (book/gpu_params.yaml).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path

import torch

from kvlab import models
from kvlab.env import env_report, pick_device
from kvlab.experiments import quant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("book/11_kv_quantization/full_run.json"))
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens of the text fed (default: all of it)"
    )
    parser.add_argument("--segment", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--kivi-residual", type=int, default=128)
    parser.add_argument("--kivi-group", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--methods", nargs="+", default=["fp8", "int8", "int4", "kivi2", "hf-fp8"])
    args = parser.parse_args()
    device = pick_device()
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    model, tokenizer = models.real_model(device=device)
    text = quant.evaluation_text()
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    used = ids if args.tokens is None else ids[: args.tokens]
    options = {"kivi2": dict(residual_length=args.kivi_residual, group_size=args.kivi_group)}
    wall, cpu = time.perf_counter(), time.process_time()
    acc = quant.accuracy(model, used, args.methods, segment=args.segment, chunk=args.chunk, options=options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    record: dict[str, object] = {
        m: {
            **dataclasses.asdict(a),
            "perplexity": a.perplexity,
            "reference_perplexity": a.reference_perplexity,
        }
        for m, a in acc.items()
    }
    data = (files("kvlab") / "data" / "book_prose.txt").read_bytes()
    record["_meta"] = {
        "tokens_total": len(ids),
        "tokens_used": len(used),
        "tokens_scored": acc[args.methods[0]].tokens,
        "segment": args.segment,
        "chunk": args.chunk,
        "kivi_residual": args.kivi_residual,
        "kivi_group": args.kivi_group,
        "threads": torch.get_num_threads(),
        "seconds": round(wall),
        "cpu_seconds": round(cpu),
        "text": "kvlab/data/book_prose.txt (this book's introduction and chapters 1-9)",
        "text_sha256": hashlib.sha256(data).hexdigest(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "made_by": f"kvlab.experiments.quant.accuracy(model, ids, methods, segment={args.segment}, chunk={args.chunk})",
        **env_report(device),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{acc[args.methods[0]].tokens:,} tokens scored in {wall:.0f} s ({cpu:.0f} CPU s): {args.out}")
    for m, a in acc.items():
        print(f"  {m:7s} ppl {a.perplexity:.3f} (fp32 {a.reference_perplexity:.3f})  KL {a.kl:.3g}  "
              f"top-1 {100 * a.top1_agreement:.1f} %")  # fmt: skip


if __name__ == "__main__":
    main()
