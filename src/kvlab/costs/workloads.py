"""Seeded synthetic request traces: Poisson arrivals, dataset-like lengths, optional shared system prompts.

Length means come from the PagedAttention paper (Kwon et al., 2023, arXiv:2309.06180, §6.1 and Fig. 11), which
samples requests from ShareGPT and Alpaca: ShareGPT averages 161.31 input and 337.99 output tokens, Alpaca 19.31
and 58.45 (the paper's text: ShareGPT has 8.4× longer inputs and 5.8× longer outputs; 161.31 / 19.31 = 8.35 and
337.99 / 58.45 = 5.78 agree). The paper shows the distributions, not their shapes' parameters; we draw lognormal
lengths with those means (long right tails, like Fig. 11) and a spread we chose. `scale` shrinks every length
for CPU-sized runs while keeping the shape. Token ids are random; the engine's work does not depend on which.

`Workload` is what a deployment serves, the one description `kvlab.planning.plan` simulates (`Workload.trace`) and
`kvlab.planning.diagnose` reads in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlab.checks import check_count


@dataclass(frozen=True)
class LengthProfile:
    name: str
    mean_input: float
    mean_output: float
    sigma: float  # of the underlying normal: the spread of the lognormal


SHAREGPT = LengthProfile("sharegpt", 161.31, 337.99, sigma=0.9)
ALPACA = LengthProfile("alpaca", 19.31, 58.45, sigma=0.6)
PROFILES = {p.name: p for p in (SHAREGPT, ALPACA)}


@dataclass(frozen=True)
class TraceRequest:
    arrival_time: float  # seconds after the trace starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # output length the request will generate (eos ignored, as in vLLM's benchmarks)
    shares_prefix: bool = False


class WorkloadError(ValueError):
    """A workload kvlab cannot serve or diagnose (the message names the problem in one line)."""


LONGEST_OVER_MEAN = 4  # the longest prompt or output, when not given, as a multiple of the mean


@dataclass(frozen=True)
class Workload:
    """Mean prompt and output lengths (the longest of each, when known), an arrival rate in requests/s (open
    loop) or a concurrency in requests in flight (closed loop), and a share of requests that start with one
    shared prefix of `prefix_len` tokens.

    `trace` draws `num_requests` seeded requests of it (lognormal lengths of spread `sigma`, capped at
    `max_input`/`max_output`); `mean_resident` reads the output lengths' spread as `output_cv` instead.
    """

    mean_input: float = SHAREGPT.mean_input
    mean_output: float = SHAREGPT.mean_output
    rate: float | None = None
    concurrency: int | None = None
    prefix_fraction: float = 0.0
    prefix_len: int = 0
    max_input: int | None = None  # the longest prompt (P99 or max); default LONGEST_OVER_MEAN × the mean
    max_output: int | None = None  # the longest output; default LONGEST_OVER_MEAN × the mean
    output_cv: float = 0.0  # coefficient of variation of the output length (std / mean); 0: all equal
    sigma: float = SHAREGPT.sigma  # of the lognormal lengths `trace` draws
    num_requests: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("mean_input", "mean_output"):
            if not _number(getattr(self, name)) or not getattr(self, name) >= 1:
                raise WorkloadError(f"{name} must be at least 1 token, got {getattr(self, name)!r}")
        if (self.rate is None) == (self.concurrency is None):
            raise WorkloadError("give exactly one of rate (requests/s) and concurrency (requests in flight)")
        if self.rate is not None and not (_number(self.rate) and 0 < self.rate < math.inf):
            raise WorkloadError(f"rate must be a positive number of requests per second, got {self.rate!r}")
        if not (_number(self.output_cv) and 0 <= self.output_cv < math.inf):
            raise WorkloadError(f"output_cv must be a number >= 0, got {self.output_cv!r}")
        if not (_number(self.prefix_fraction) and 0 <= self.prefix_fraction <= 1):
            raise WorkloadError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction!r}")
        for name in ("max_input", "max_output", "concurrency"):
            if getattr(self, name) is not None:
                check_count(name, getattr(self, name), 1, WorkloadError)
        check_count("prefix_len", self.prefix_len, 0, WorkloadError)
        check_count("num_requests", self.num_requests, 1, WorkloadError)
        if not (_number(self.sigma) and self.sigma >= 0):
            raise WorkloadError(f"sigma must be a number >= 0, got {self.sigma!r}")
        for longest, mean in (("max_input", "mean_input"), ("max_output", "mean_output")):
            if getattr(self, longest) is not None and getattr(self, longest) < getattr(self, mean):
                raise WorkloadError(
                    f"{longest} {getattr(self, longest)} is below {mean} {getattr(self, mean)}"
                )

    @property
    def longest_input(self) -> int:
        return self.max_input or math.ceil(LONGEST_OVER_MEAN * self.mean_input)

    @property
    def longest_output(self) -> int:
        return self.max_output or math.ceil(LONGEST_OVER_MEAN * self.mean_output)

    @property
    def mean_length(self) -> float:
        """Tokens a request holds when it finishes: prompt plus output."""
        return self.mean_input + self.mean_output

    @property
    def mean_resident(self) -> float:
        """Tokens a running request holds, averaged over engine steps: a request generating `n` tokens after a
        `p`-token prompt holds `p, p + 1, ..., p + n - 2` in its `n - 1` decode steps' ends, and requests with
        long outputs occupy more steps, so the average weights each request by `n`:
        `E[p] + (E[n^2] / E[n] - 1) / 2 = mean_input + (mean_output × (1 + output_cv²) - 1) / 2`
        (prompt and output lengths independent). With `output_cv = 0` every output has the mean length."""
        return self.mean_input + max(0.0, self.mean_output * (1 + self.output_cv**2) - 1) / 2

    def trace(
        self, rate: float | None = None, vocab_size: int = 32000, max_model_len: int | None = None
    ) -> list[TraceRequest]:
        """A seeded trace of this workload at `rate` requests/s (None: all at t=0, for a closed loop). With
        `max_model_len`, prompts are capped at half of it and outputs at what the prompt and prefix leave."""
        return self.traces(vocab_size, max_model_len)(rate)

    def traces(
        self, vocab_size: int = 32000, max_model_len: int | None = None
    ) -> Callable[[float | None], list[TraceRequest]]:
        """`trace(rate, vocab_size, max_model_len)` for any rate, each kind of draw made once: a search over
        rates rescales one set of arrivals instead of drawing every prompt again (seconds at 20,000 requests)."""
        draws: dict[bool, TraceDraw] = {}

        def at(rate: float | None) -> list[TraceRequest]:
            rate = math.inf if rate is None else rate
            burst = math.isinf(rate)
            if burst not in draws:
                draws[burst] = self._draw(burst, vocab_size, max_model_len)
            return draws[burst].at(rate)

        return at

    def _draw(self, burst: bool, vocab_size: int, max_model_len: int | None) -> TraceDraw:
        max_input, max_output = self.max_input, self.max_output
        if max_model_len is not None:
            max_input = min(max_input or max_model_len, max_model_len // 2)
            max_output = min(max_output or max_model_len, max_model_len - max_input - self.prefix_len)
            if max_output < 1:
                raise WorkloadError(
                    f"context {max_model_len} leaves no room for output after a {self.prefix_len}-token prefix"
                )
        return draw_trace(
            self.num_requests,
            LengthProfile("workload", self.mean_input, self.mean_output, self.sigma),
            burst=burst,
            vocab_size=vocab_size,
            seed=self.seed,
            shared_prefix_len=self.prefix_len,
            shared_prefix_fraction=self.prefix_fraction,
            max_input_len=max_input,
            max_output_len=max_output,
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """`n` arrival times of a Poisson process of `rate` requests/s; `rate=inf` puts all at t=0."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    return scaled_arrivals(rng.standard_exponential(n), rate)


def scaled_arrivals(gaps: np.ndarray, rate: float) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` from standard exponential `gaps`: bit for bit what numpy's
    `exponential(1 / rate)` gives from the same generator (it scales the same draws)."""
    return np.cumsum((1.0 / rate) * gaps)


def lognormal_lengths(
    n: int, mean: float, sigma: float, rng: np.random.Generator, cap: int | None
) -> np.ndarray:
    """Integer lengths >= 1 from a lognormal with the given mean (before rounding and the cap)."""
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma))] = exp(mu + sigma^2 / 2)
    lengths = np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=n))).astype(int)
    return lengths if cap is None else np.minimum(lengths, cap)


def synthetic_trace(
    num_requests: int,
    dataset: str | LengthProfile = "sharegpt",
    request_rate: float = math.inf,
    scale: float = 1.0,
    vocab_size: int = 256,
    seed: int = 0,
    shared_prefix_len: int = 0,
    shared_prefix_fraction: float = 0.0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
) -> list[TraceRequest]:
    """A seeded trace. A `shared_prefix_fraction` of the requests start with one common system prompt of
    `shared_prefix_len` tokens, put before their own prompt (so their input is that much longer)."""
    return draw_trace(
        num_requests,
        dataset,
        math.isinf(request_rate),
        scale,
        vocab_size,
        seed,
        shared_prefix_len,
        shared_prefix_fraction,
        max_input_len,
        max_output_len,
    ).at(request_rate)


@dataclass(frozen=True)
class TraceDraw:
    """A seeded trace's requests at t=0 and, for an open loop, the standard exponential gaps between arrivals:
    `at(rate)` scales them into a Poisson process, exactly what `numpy`'s `exponential(1 / rate)` would have
    drawn from the same generator. A burst's draw (`gaps` None) takes no gaps, so its requests differ."""

    requests: list[TraceRequest]
    gaps: np.ndarray | None

    def at(self, rate: float) -> list[TraceRequest]:
        if rate <= 0:
            raise ValueError(f"request rate must be positive, got {rate}")
        if (self.gaps is None) != math.isinf(rate):
            raise ValueError("a burst's draw serves rate=inf only, and an open loop's a finite rate only")
        if self.gaps is None:
            return self.requests
        arrivals = scaled_arrivals(self.gaps, rate).tolist()
        return [
            TraceRequest(t, r.prompt_token_ids, r.max_tokens, r.shares_prefix)
            for t, r in zip(arrivals, self.requests, strict=True)
        ]


def draw_trace(
    num_requests: int,
    dataset: str | LengthProfile = "sharegpt",
    burst: bool = True,
    scale: float = 1.0,
    vocab_size: int = 256,
    seed: int = 0,
    shared_prefix_len: int = 0,
    shared_prefix_fraction: float = 0.0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
) -> TraceDraw:
    """`synthetic_trace`'s requests, drawn once for every rate of an open loop (`burst=False`) or for a burst."""
    profile = PROFILES[dataset] if isinstance(dataset, str) else dataset
    if not 0.0 <= shared_prefix_fraction <= 1.0 or scale <= 0 or num_requests < 1:
        raise ValueError("need num_requests >= 1, scale > 0 and 0 <= shared_prefix_fraction <= 1")
    rng = np.random.default_rng(seed)
    gaps = None if burst else rng.standard_exponential(num_requests)
    inputs = lognormal_lengths(num_requests, profile.mean_input * scale, profile.sigma, rng, max_input_len)
    outputs = lognormal_lengths(num_requests, profile.mean_output * scale, profile.sigma, rng, max_output_len)
    # Ids from 2 up: tiny models use 0 and 1 as bos and eos. Every prompt refers to one int object per id (a
    # fresh int per token costs 28 bytes more, about 0.7 GB over a 20,000-request trace of long prompts).
    ids = list(range(vocab_size))
    prefix = tuple(map(ids.__getitem__, rng.integers(2, vocab_size, size=shared_prefix_len).tolist()))
    sharing = rng.random(num_requests) < shared_prefix_fraction
    trace = []
    for n_in, n_out, shares in zip(inputs, outputs, sharing, strict=True):
        own = tuple(map(ids.__getitem__, rng.integers(2, vocab_size, size=n_in).tolist()))
        trace.append(TraceRequest(0.0, (prefix if shares else ()) + own, int(n_out), bool(shares)))
    return TraceDraw(trace, gaps)


def resident_lengths(trace: Iterable[TraceRequest]) -> list[int]:
    """Tokens each request holds in the cache at the end of each engine step it runs, one per (request, step).

    The prefill step leaves the prompt's `p` tokens; each decode step computes one more; the step that samples
    the last of `n` output tokens retires the request. So `p, p + 1, ..., p + n - 2`. Preemption by recompute
    leaves the same list, spread over more steps, as long as every (re-)prefill fits one step's token budget.
    """
    return [
        length
        for r in trace
        for length in range(len(r.prompt_token_ids), len(r.prompt_token_ids) + r.max_tokens - 1)
    ]


def predicted_prefix_hit_tokens(
    trace: Iterable[TraceRequest], shared_prefix_len: int, block_size: int
) -> int:
    """Prompt tokens a prefix cache serves on a trace whose sharing requests start with one common prefix.

    Only whole blocks are cached, and a request must still compute at least its last prompt token, so a sharing
    request can reuse `min(P // B, (p - 1) // B)` blocks of `B` tokens; the first sharing request finds nothing.
    Assumes nothing is evicted or preempted and the requests' own tokens never repeat a block.
    """
    sharing = [len(r.prompt_token_ids) for r in trace if r.shares_prefix]
    per_request = [min(shared_prefix_len // block_size, (p - 1) // block_size) * block_size for p in sharing]
    return sum(per_request[1:])
