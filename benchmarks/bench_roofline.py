"""Measured decode step time beside the roofline, on the machine this runs on.

Measures the device's ceilings (`kvlab.specs.hardware.measure`), then times single-token decode steps of a tiny
random Llama with a real `DynamicCache` at several batch sizes and contexts, and prints measured vs predicted.

    .venv/bin/python benchmarks/bench_roofline.py                  # defaults: CPU-sized
    .venv/bin/python benchmarks/bench_roofline.py --threads 2 --batches 1 --contexts 16,256
"""

from __future__ import annotations

import argparse

import torch

from kvlab.book.report import Table
from kvlab.env import compute_dtype, env_report, pick_device
from kvlab.experiments.timing import compare_decode
from kvlab.models import tiny_model
from kvlab.specs import hardware, sizing
from kvlab.units import format_bytes


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads; 1 (default) keeps timings stable when other work shares the cores, where two "
        "threads stall on each other and run 5-40x slower than the roofline",
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 2 × hidden)")
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16])
    parser.add_argument("--contexts", type=_ints, default=[16, 256, 1024])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--dtype", default=None, help="model dtype (default: kvlab.env.compute_dtype)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    # the book's dtype for the device: fp32 on CPU, bf16 where the GPU has bf16 tensor cores, else fp16 (a T4)
    dtype = getattr(torch, args.dtype) if args.dtype else compute_dtype(device)

    hw = hardware.measure(device, dtype=dtype)
    model = tiny_model(
        "llama",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.hidden // 64,
        kv_heads=args.hidden // 128,
        intermediate=args.intermediate,
        vocab=1024,
        device=device,
        dtype=dtype,
    )
    print(env_report(device))
    print(
        f"{hw.name}: copy {hw.bandwidth_bytes_per_s / 1e9:.1f} GB/s, {hw.flops_dtype} matmul "
        f"{hw.flops / 1e9:.0f} GFLOP/s, ridge {hw.ridge_flops_per_byte:.1f} FLOP/B"
    )
    print(f"model: {format_bytes(sizing.weight_bytes(model.config, dtype))} of {dtype} weights")
    rows = compare_decode(model, hw, args.batches, args.contexts, repeat=args.repeat)
    print(
        Table(
            ["batch", "context", "KV", "measured ms", "best ms", "predicted ms", "bound", "ratio"],
            [
                [
                    r.measured.batch_size,
                    r.measured.tokens,
                    format_bytes(r.predicted.kv_bytes),
                    round(r.measured.median_s * 1e3, 2),
                    round(r.measured.best_s * 1e3, 2),
                    round(r.predicted.time_s * 1e3, 2),
                    r.predicted.bound,
                    round(r.ratio, 2),
                ]
                for r in rows
            ],
        )
    )
    ratios = [r.ratio for r in rows]
    print(f"measured / predicted: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
