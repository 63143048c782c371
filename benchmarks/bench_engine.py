"""Engine throughput vs `model.generate` on static padded batches: same tiny model, same trace, one run.

The trace is seeded, Alpaca-like (scaled), all requests present at t=0 (offline throughput). Three ways to serve it:

- `generate`: `model.generate` on static batches of `--batch` prompts, left-padded, each batch decoding until
  its longest request is done (eos ignored, as in vLLM's benchmarks); only requested tokens count as output.
- `engine static`: `LLMEngine(scheduling="static")`, the same batches on the paged cache.
- `engine continuous`: `LLMEngine` with continuous batching and up to `--batch` running sequences.

Wall seconds are measured around each run. The three run in `--repeat` rounds, one of each per round, in an order
that rotates from round to round: a machine whose speed drifts over the minutes slows all three alike, and the
speed-up over `generate` is the median of the rounds' own ratios (the min and max are printed too). On cores
shared with other work, two
torch threads stall on each other and `generate`'s many small steps suffer most: `--threads 1` is steadier. The
engines also run on `VirtualClock`, whose toy cost model charges every step a fixed cost (a GPU reading the weights
once per step); their virtual throughput shows the regime where continuous batching pays. On a CPU with a tiny
model, a step's cost is nearly proportional to its tokens, so the engine's wall-time gain over `generate` comes
from not computing padding, not from batching.

`--breakdown` splits every run into the seconds outside the model's forward (the serving loop: kvlab's scheduler
and runner, or `generate`'s own), inside its attention calls, and in the model's other ops, and prints what the
speed-up would be with parts of the engine's cost taken away: the ceilings of any engine that runs this model's
own code.

    .venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvlab.costs.workloads import TraceRequest, synthetic_trace
from kvlab.engine import LLMEngine
from kvlab.engine.attention import ATTN_IMPLEMENTATION, enable_paged_attention, paged_attention_forward
from kvlab.engine.metrics import mean_kv_utilisation, summarize
from kvlab.env import env_report
from kvlab.models import tiny_model

PAD = 0


@torch.inference_mode()
def run_generate(model, trace: list[TraceRequest], batch: int) -> float:
    """Seconds to serve the trace with padded static batches of `model.generate`."""
    # the inputs go where the model is: tiny_model puts it on cuda when there is one
    device = model.device
    start = time.perf_counter()
    for i in range(0, len(trace), batch):
        group = trace[i : i + batch]
        width = max(len(r.prompt_token_ids) for r in group)
        ids = torch.tensor(
            [[PAD] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in group],
            device=device,
        )
        mask = (
            torch.arange(width, device=device)[None]
            >= torch.tensor([width - len(r.prompt_token_ids) for r in group], device=device)[:, None]
        ).long()
        longest = max(r.max_tokens for r in group)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,  # eos ignored: every row decodes the batch's longest output
            do_sample=False,
            pad_token_id=PAD,
        )
    return time.perf_counter() - start


def run_engine(model, trace: list[TraceRequest], batch: int, scheduling: str, num_blocks: int):
    engine = LLMEngine(
        model, block_size=16, num_blocks=num_blocks, max_num_seqs=batch, max_num_batched_tokens=1024,
        scheduling=scheduling, clock="virtual",
    )  # fmt: skip
    start = time.perf_counter()
    outputs = engine.replay(trace)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [r.max_tokens for r in trace]
    return elapsed, (engine, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of one run of each method (default 3)")
    parser.add_argument(
        "--breakdown", action="store_true", help="split each run into loop, attention and other ops"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = tiny_model("llama", layers=4, hidden=256, heads=8, kv_heads=4, vocab=1024)
    print(env_report(model.device))
    trace = synthetic_trace(
        args.requests, "alpaca", scale=args.scale, vocab_size=1024, seed=args.seed, max_input_len=256,
        max_output_len=256,
    )  # fmt: skip
    useful = sum(r.max_tokens for r in trace)
    print(
        f"tiny llama (4 layers, hidden 256), {len(trace)} Alpaca-like requests (scale {args.scale}), "
        f"batch {args.batch}; {useful} output tokens, mean prompt "
        f"{sum(len(r.prompt_token_ids) for r in trace) / len(trace):.1f}"
    )
    methods = {
        "generate (static, padded)": lambda: (run_generate(model, trace, args.batch), None),
        **{
            f"engine {scheduling}": functools.partial(run_engine, model, trace, args.batch, scheduling, 2048)
            for scheduling in ("static", "continuous")
        },
    }
    names = list(methods)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    splits: dict[str, list[Split]] = {name: [] for name in names}
    timers = Timers(model) if args.breakdown else None
    virtual = {}
    for round_ in range(args.repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            if timers is not None:
                timers.split = Split()
                splits[name].append(timers.split)
            elapsed, run = methods[name]()
            seconds[name].append(elapsed)
            if timers is not None:
                timers.split.total = elapsed
            # The same seeded replay every round: only the wall time differs, so the first round describes all
            if run is not None and round_ == 0:
                virtual[name] = describe(name, *run)
    base = seconds["generate (static, padded)"]
    print(f"{'method':<28} {'median s':>9} {'out tok/s':>10} {'vs generate, median (min-max) of rounds':>40}")
    for name, runs in seconds.items():
        ratios = [b / s for b, s in zip(base, runs, strict=True)]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(
            f"{name:<28} {statistics.median(runs):>9.2f} {useful / statistics.median(runs):>10.1f} {spread:>40}"
        )
    print(
        "virtual clock, continuous / static output throughput: "
        f"{virtual['engine continuous'] / virtual['engine static']:.2f}x"
    )
    if timers is not None:
        timers.remove()
        print_breakdown(splits["generate (static, padded)"], splits["engine continuous"])


@dataclass
class Split:
    """Wall seconds of one run: in all, inside the model's forward calls, inside its attention calls."""

    total: float = 0.0
    forward: float = 0.0
    attention: float = 0.0
    attention_calls: int = 0

    @property
    def loop(self) -> float:
        """Outside the forward: the serving loop (scheduling, batch building, sampling)."""
        return self.total - self.forward

    @property
    def other_ops(self) -> float:
        """Inside the forward, outside attention: the model's own ops (linears, norms, RoPE, MLP)."""
        return self.forward - self.attention


class Timers:
    """Hooks around the model's forward and a wrapper around its attention function, adding to `split`.

    Both methods call that function (`generate` without a `PagedContext`, so transformers' SDPA runs). The timers
    cost a few microseconds a step, under 0.1 % of a run."""

    def __init__(self, model) -> None:
        enable_paged_attention(model)
        self.split = Split()
        self._started = 0.0
        AttentionInterface.register(ATTN_IMPLEMENTATION, self._attention)
        self._hooks = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _attention(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return paged_attention_forward(*args, **kwargs)
        finally:
            self.split.attention += time.perf_counter() - start
            self.split.attention_calls += 1

    def _before(self, *_) -> None:
        self._started = time.perf_counter()

    def _after(self, *_) -> None:
        self.split.forward += time.perf_counter() - self._started

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def print_breakdown(generate: list[Split], engine: list[Split]) -> None:
    """Medians over the rounds of each part, and of each round's speed-up with a part of the engine's cost
    taken away: the ceilings of any engine that runs this model's own code."""
    print(
        f"{'median of rounds':<20} {'total s':>8} {'loop s':>7} {'attention s':>12} {'calls':>6} {'other ops s':>12}"
    )
    for name, runs in (("generate", generate), ("engine continuous", engine)):
        med = {
            part: statistics.median(getattr(r, part) for r in runs)
            for part in ("total", "loop", "attention", "other_ops")
        }
        print(
            f"{name:<20} {med['total']:>8.3f} {med['loop']:>7.3f} {med['attention']:>12.3f} "
            f"{runs[0].attention_calls:>6} {med['other_ops']:>12.3f}"
        )
    ceilings = {
        "measured": lambda g, e: e.total,
        "if the engine's loop cost nothing": lambda g, e: e.forward,
        "if, also, each attention call cost what generate's does on average": lambda g, e: (
            e.other_ops + e.attention_calls * g.attention / g.attention_calls
        ),
        "if the engine ran only the model's other ops (no loop, no attention)": lambda g, e: e.other_ops,
    }
    print("speed-up over generate, median of rounds:")
    for label, seconds in ceilings.items():
        ratios = [g.total / seconds(g, e) for g, e in zip(generate, engine, strict=True)]
        print(f"  {statistics.median(ratios):.2f}x {label}")


def describe(name: str, engine: LLMEngine, outputs: list) -> float:
    """Print one engine run's steps, occupancy and virtual-clock latencies; its virtual output throughput."""
    summary = summarize([o.metrics for o in outputs])
    stats = engine.step_stats
    print(
        f"  {name}: {len(stats)} steps, mean running {sum(s.num_running for s in stats) / len(stats):.1f}, "
        f"KV utilisation {mean_kv_utilisation(stats):.3f}; virtual clock: {summary['output_throughput']:.0f} "
        f"out tok/s, mean TTFT {summary['mean_ttft_ms']:.0f} ms, p99 ITL {summary['p99_itl_ms']:.1f} ms"
    )
    return summary["output_throughput"]


if __name__ == "__main__":
    main()
