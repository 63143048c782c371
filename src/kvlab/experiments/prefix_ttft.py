"""Chapter 9's wall-clock claims: a prefix-cache hit shortens time to first token on a real model, by what a
calibrated prefill cost predicts, and it is visible from outside.

Two measurements, each checked by `kvlab.claims` conditions so that a lab can run them through
`kvlab.claims.measure_claim` (a miss on a shared machine re-measures, a bounded number of times):

- `measure_sharing` serves, at each sharing fraction, `requests` prompts of a shared system prompt (or a random
  one) plus a request's own tokens, one at a time, on fresh engines with prefix caching off and on, and predicts
  every request's TTFT from a per-token prefill cost (`prefill_cost`, a `kvlab.planning.simulate.fit_linear_cost` fit)
  calibrated on OTHER prompts in the same rounds. `check_sharing`: the prefill tokens the scheduler ran equal the
  prompt tokens less the predicted hits exactly (and the engine reports those hits); with caching on, TTFT
  relative to caching off falls at every step up in sharing; and the mean TTFT at every fraction, caching off
  and on, is within a tolerance of the prediction.
- `measure_probes` is the side channel: after a victim's request warmed the cache, an attacker's right and wrong
  guesses of the system prompt, under the victim's salt and under its own. `check_probes`: the right guess hits
  the whole prefix under a shared salt and nothing under its own; the wrong guess hits nothing; the right guess's
  TTFT over the wrong guess's is the ratio the calibrated cost predicts, within the tolerance; and the hit answers
  faster.

Timing the calibration prompts in the same rounds as the measured requests, the fastest round counting on both
sides, keeps a shared machine's drifting speed out of the comparison.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import numpy as np
import torch

from kvlab import claims
from kvlab.costs.workloads import TraceRequest
from kvlab.engine import LLMEngine
from kvlab.engine.request import SamplingParams
from kvlab.planning import simulate as sim

ONE_TOKEN = SamplingParams(max_tokens=1)


class RandomIds:
    """Random token ids from one seeded generator, in [`low`, vocab_size): every call draws new ones."""

    def __init__(self, vocab_size: int, seed: int = 0, low: int = 100) -> None:
        if not 0 <= low < vocab_size:
            raise ValueError(f"need 0 <= low < vocab_size, got {low} and {vocab_size}")
        self.vocab_size, self.low = vocab_size, low
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(self.low, self.vocab_size, (n,), generator=self._generator).tolist()


def engine_knobs(block_size: int, num_blocks: int, prompt_len: int) -> dict[str, Any]:
    """Engine settings of the wall-clock runs: every prompt of up to `prompt_len` tokens prefilled in one step."""
    return dict(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=max(512, 3 * prompt_len))


def calibration_trace(ids: RandomIds, shortest: int, longest: int, count: int = 5) -> list[TraceRequest]:
    """`count` prompts of other tokens, lengths evenly from `shortest` to `longest`, one output token each."""
    if count < 5 or not 0 < shortest < longest:
        raise ValueError("need count >= 5 (a cost fit) and 0 < shortest < longest")
    lengths = np.linspace(shortest, longest, count).astype(int)
    return [TraceRequest(0.0, tuple(ids(int(n))), 1) for n in lengths]


def prefill_cost(steps: Sequence[sim.StepRecord]) -> sim.LinearStepCost:
    """A prefill step's seconds as a fixed part plus a part per token computed (`kvlab.planning.simulate.fit_linear_cost`,
    relative errors), fitted to the fastest of the steps of each length: calibration prompts timed in several
    rounds, the fastest round counting, as for the measured requests. Context, sequences and the host gap are
    left out: one prompt per step, and attending over a cached prefix costs little beside the matrix products of
    the tokens computed."""
    fastest: dict[int, float] = {}
    for step in steps:
        n = step.num_batched_tokens
        fastest[n] = min(step.seconds, fastest.get(n, float("inf")))
    return sim.fit_linear_cost([sim.StepRecord(n, 0, 0, s) for n, s in fastest.items()])


def prefill_ms(cost: sim.LinearStepCost, tokens: int) -> float:
    """Milliseconds `cost` gives a prefill step computing `tokens` tokens."""
    return 1e3 * cost.of(tokens, 0, 0)


def hit_saving(cost: sim.LinearStepCost, prompt_len: int, hit: int) -> float:
    """The share of a `prompt_len`-token request's predicted TTFT that a hit of `hit` tokens saves."""
    return 1 - prefill_ms(cost, prompt_len - hit) / prefill_ms(cost, prompt_len)


@dataclass(frozen=True)
class HitRegime:
    """Whether a prefix hit shows on the wall clock at these sizes: its predicted saving against the tolerance
    the TTFT predictions are held to. A saving inside the tolerance could be an error of the prediction, and
    a launch-bound prefill (a small model on a GPU: the fixed cost of a step outweighs the prefix's work) saves
    little; there the claims that a hit is faster are not held, and the lab says so."""

    saving: float
    tolerance: float
    on_cpu: bool

    @property
    def visible(self) -> bool:
        return self.saving > self.tolerance

    def __str__(self) -> str:
        said = f"a hit is predicted to save {self.saving:.0%} of a request's TTFT"
        if self.visible:
            return f"the hit shows: {said}, more than the {self.tolerance:.0%} tolerance"
        return f"launch-bound at these sizes: {said}, within the {self.tolerance:.0%} tolerance"

    def checks(self) -> list[claims.Check]:
        """On a CPU, the sizes must make a hit visible, or CI would never check that it is faster."""
        if not self.on_cpu:
            return []
        detail = f"saves {self.saving:.0%}, needs more than {self.tolerance:.0%}"
        return [claims.Check("the CPU sizes make a hit visible in TTFT", self.visible, detail)]


def sharing_regime(runs: Sequence[SharingRun], tolerance: float) -> HitRegime:
    """`HitRegime` of a `measure_sharing`: the largest hit of the fullest sharing, at that run's calibrated cost."""
    run = runs[-1]
    hit, length = max(zip(run.hits, run.prompt_lens, strict=True))
    return HitRegime(hit_saving(run.cost, length, hit), tolerance, run.on_cpu)


def probe_regime(run: ProbeRun, prefix_len: int, tolerance: float) -> HitRegime:
    """`HitRegime` of a `measure_probes`: the right guess's hit of the whole prefix."""
    length = run.shared["right guess"].prompt_len
    return HitRegime(hit_saving(run.cost, length, prefix_len), tolerance, run.on_cpu)


def _calibrate(model: Any, cal_trace: Sequence[TraceRequest], knobs: dict[str, Any]) -> list[sim.StepRecord]:
    calibration = sim.calibrate(
        model, [list(cal_trace)], clock="wall", repeats=1, warmup=cal_trace[:1], max_num_seqs=1, **knobs
    )
    return calibration.steps


def sharing_prompts(
    ids: RandomIds, system: Sequence[int], fraction: float, requests: int, own_len: int
) -> list[list[int]]:
    """`requests` prompts: the first round(fraction x requests) start with `system`, the rest with random tokens
    of its length; each ends with `own_len` tokens of its own."""
    sharing = round(fraction * requests)
    return [(list(system) if i < sharing else ids(len(system))) + ids(own_len) for i in range(requests)]


def predicted_hits(fraction: float, requests: int, prefix_len: int, block_size: int) -> list[int]:
    """Cached tokens of each of `sharing_prompts`' requests, served one at a time: every sharing request after
    the first finds the prefix's whole blocks (its own tokens and at least one more are computed)."""
    sharing = round(fraction * requests)
    return [prefix_len // block_size * block_size if 0 < i < sharing else 0 for i in range(requests)]


@dataclass(frozen=True)
class SharingRun:
    """One sharing fraction on the wall clock: counts, each request's TTFT (fastest round) and the cost."""

    fraction: float
    prompt_tokens: int  # all requests' prompt tokens
    hits: tuple[int, ...]  # predicted cached tokens, per request
    prompt_lens: tuple[int, ...]
    scheduled_off: int  # prefill tokens the scheduler ran, caching off
    scheduled_on: int  # and on
    engine_hits: int  # prefix-cache hits the engine reported, caching on
    ttft_off_ms: tuple[float, ...]
    ttft_on_ms: tuple[float, ...]
    cost: sim.LinearStepCost
    on_cpu: bool = True

    def predicted_ms(self, caching: bool) -> list[float]:
        """Each request's TTFT from the calibrated cost: its prompt less, with caching, its predicted hits."""
        return [
            prefill_ms(self.cost, n - (h if caching else 0))
            for n, h in zip(self.prompt_lens, self.hits, strict=True)
        ]

    def mean_ms(self, caching: bool) -> float:
        return fmean(self.ttft_on_ms if caching else self.ttft_off_ms)

    def mean_predicted_ms(self, caching: bool) -> float:
        return fmean(self.predicted_ms(caching))


def _timed_requests(
    model: Any, prompts: Sequence[Sequence[int]], warmup: list[int], caching: bool, knobs: dict[str, Any]
) -> tuple[list[float], int, int]:
    """A fresh engine, one warm-up request, then `prompts` one at a time: (TTFT ms each, prefill tokens
    scheduled, prefix hits reported)."""
    engine = LLMEngine(model, enable_prefix_caching=caching, **knobs)
    engine.generate([warmup], ONE_TOKEN)
    warm_steps, warm_hits = len(engine.step_stats), engine.block_manager.prefix_cache_stats.hits
    ttfts = [1e3 * engine.generate([list(p)], ONE_TOKEN)[0].metrics.ttft for p in prompts]
    scheduled = sum(s.num_batched_tokens for s in engine.step_stats[warm_steps:])
    return ttfts, scheduled, engine.block_manager.prefix_cache_stats.hits - warm_hits


def measure_sharing_run(
    model: Any,
    ids: RandomIds,
    prompts: Sequence[Sequence[int]],
    hits: Sequence[int],
    cal_trace: Sequence[TraceRequest],
    repeats: int,
    knobs: dict[str, Any],
    fraction: float = 0.0,
) -> SharingRun:
    """`repeats` rounds, each timing the calibration prompts, then `prompts` with caching off and on (a fresh
    engine each), back to back; per request the fastest round counts, and the cost is fitted to all rounds'
    calibration steps. The same prompts must schedule the same work in every round (else this raises)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    steps: list[sim.StepRecord] = []
    ttfts: dict[bool, list[list[float]]] = {False: [], True: []}
    scheduled: dict[bool, set[int]] = {False: set(), True: set()}
    reported: set[int] = set()
    for _ in range(repeats):
        steps += _calibrate(model, cal_trace, knobs)
        for caching in (False, True):
            times, tokens, engine_hits = _timed_requests(model, prompts, ids(8), caching, knobs)
            ttfts[caching].append(times)
            scheduled[caching].add(tokens)
            if caching:
                reported.add(engine_hits)
    if any(len(s) != 1 for s in (*scheduled.values(), reported)):
        raise AssertionError(
            f"the same prompts scheduled different work across rounds: {scheduled}, {reported}"
        )
    fastest = {c: tuple(min(t) for t in zip(*ttfts[c], strict=True)) for c in ttfts}
    return SharingRun(
        fraction, sum(map(len, prompts)), tuple(hits), tuple(map(len, prompts)), scheduled[False].pop(),
        scheduled[True].pop(), reported.pop(), fastest[False], fastest[True], prefill_cost(steps),
        _on_cpu(model),
    )  # fmt: skip


def _on_cpu(model: Any) -> bool:
    return bool(next(model.parameters()).device.type == "cpu")


def measure_sharing(
    model: Any,
    ids: RandomIds,
    system: Sequence[int],
    fractions: Sequence[float],
    requests: int,
    own_len: int,
    cal_trace: Sequence[TraceRequest],
    repeats: int,
    knobs: dict[str, Any],
) -> list[SharingRun]:
    """`measure_sharing_run` at every fraction, on new `sharing_prompts`: one measurement of the claim."""
    runs = []
    for fraction in fractions:
        prompts = sharing_prompts(ids, system, fraction, requests, own_len)
        hits = predicted_hits(fraction, requests, len(system), knobs["block_size"])
        runs.append(measure_sharing_run(model, ids, prompts, hits, cal_trace, repeats, knobs, fraction))
    return runs


def _equal(name: str, measured: int, expected: int) -> claims.Check:
    return claims.Check(name, measured == expected, f"{measured} against {expected}")


def check_sharing(runs: Sequence[SharingRun], tolerance: float) -> list[claims.Check]:
    """The claim on one `measure_sharing`: exact prefill work and hits at every fraction; where a hit is visible
    (`sharing_regime`), with caching on, TTFT relative to caching off falls at every step up in sharing (on a
    CPU the sizes must make it visible); every mean TTFT within `tolerance` of the calibrated prediction (with
    caching on, of the prompt less the hits a working cache serves)."""
    regime = sharing_regime(runs, tolerance)
    checks = regime.checks()
    for r in runs:
        share = f"{r.fraction:.0%} sharing"
        checks.append(
            _equal(f"{share}: prefill tokens scheduled, caching off", r.scheduled_off, r.prompt_tokens)
        )
        expected_on = r.prompt_tokens - sum(r.hits)
        checks.append(_equal(f"{share}: prefill tokens scheduled, caching on", r.scheduled_on, expected_on))
        checks.append(_equal(f"{share}: prefix hits the engine reported", r.engine_hits, sum(r.hits)))
    relative = [r.mean_ms(True) / r.mean_ms(False) for r in runs]
    for i in range(1, len(runs) if regime.visible else 1):
        a, b = runs[i - 1].fraction, runs[i].fraction
        name = f"TTFT with caching on, relative to off, falls from {a:.0%} to {b:.0%} sharing"
        checks.append(claims.less(name, relative[i], relative[i - 1]))
    for r in runs:
        for caching, label in ((False, "off"), (True, "on")):
            name = f"{r.fraction:.0%} sharing, caching {label}: mean TTFT (ms) as predicted"
            checks.append(claims.within(name, r.mean_ms(caching), r.mean_predicted_ms(caching), tolerance))
    return checks


# ---------------------------------------------------------------------------------------------------------------
# The side channel

GUESSES = ("right guess", "wrong guess")


@dataclass(frozen=True)
class Probe:
    """One probe of the attacker: its prompt length, the tokens the engine served from the cache, and its TTFT
    (the fastest round)."""

    prompt_len: int
    cached_tokens: int
    ttft_ms: float


@dataclass(frozen=True)
class ProbeRun:
    """The attacker's probes after a victim's request, with the victim's salt (a shared cache) and with its own."""

    shared: dict[str, Probe]
    salted: dict[str, Probe]
    shared_hits: int  # prefix hits the engine reported for the probes, shared cache
    salted_hits: int
    cost: sim.LinearStepCost  # calibrated in the same rounds
    on_cpu: bool = True


def _attack(
    model: Any,
    ids: RandomIds,
    system: Sequence[int],
    victim: Sequence[int],
    wrong: Sequence[int],
    salts: tuple[str, str],
    own_len: int,
    knobs: dict[str, Any],
) -> tuple[dict[str, Probe], int]:
    """One round: a fresh engine (prefix caching on), a warm-up, the victim's request under `salts[0]`, then the
    right and the wrong guess under `salts[1]`, each with new own tokens."""
    engine = LLMEngine(model, **knobs)
    engine.generate([ids(own_len)], ONE_TOKEN)
    engine.generate([{"prompt_token_ids": list(victim), "cache_salt": salts[0]}], ONE_TOKEN)
    before = engine.block_manager.prefix_cache_stats.hits
    probes = {}
    for name, prefix in zip(GUESSES, (system, wrong), strict=True):
        prompt = list(prefix) + ids(own_len)
        (out,) = engine.generate([{"prompt_token_ids": prompt, "cache_salt": salts[1]}], ONE_TOKEN)
        probes[name] = Probe(len(prompt), out.metrics.num_cached_tokens, 1e3 * out.metrics.ttft)
    return probes, engine.block_manager.prefix_cache_stats.hits - before


def _fastest(rounds: list[dict[str, Probe]]) -> dict[str, Probe]:
    out = {}
    for name in GUESSES:
        cached = {r[name].cached_tokens for r in rounds}
        if len(cached) != 1:
            raise AssertionError(f"{name}: cached tokens differ across rounds: {sorted(cached)}")
        out[name] = Probe(rounds[0][name].prompt_len, cached.pop(), min(r[name].ttft_ms for r in rounds))
    return out


def measure_probes(
    model: Any,
    ids: RandomIds,
    system: Sequence[int],
    own_len: int,
    cal_trace: Sequence[TraceRequest],
    repeats: int,
    knobs: dict[str, Any],
    salts: tuple[str, str] = ("tenant-a", "tenant-b"),
) -> ProbeRun:
    """`repeats` rounds, each calibrating the prefill cost, then attacking a shared cache (the attacker under the
    victim's salt, as with no salts at all) and a salted one (the attacker under a salt of its own)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    victim, wrong = list(system) + ids(own_len), ids(len(system))
    steps: list[sim.StepRecord] = []
    rounds: dict[bool, list[dict[str, Probe]]] = {False: [], True: []}
    hits: dict[bool, set[int]] = {False: set(), True: set()}
    for _ in range(repeats):
        steps += _calibrate(model, cal_trace, knobs)
        for salted in (False, True):
            pair = (salts[0], salts[1] if salted else salts[0])
            probes, engine_hits = _attack(model, ids, system, victim, wrong, pair, own_len, knobs)
            rounds[salted].append(probes)
            hits[salted].add(engine_hits)
    if any(len(h) != 1 for h in hits.values()):
        raise AssertionError(f"the probes hit differently across rounds: {hits}")
    return ProbeRun(
        _fastest(rounds[False]),
        _fastest(rounds[True]),
        hits[False].pop(),
        hits[True].pop(),
        prefill_cost(steps),
        _on_cpu(model),
    )


def check_probes(run: ProbeRun, prefix_len: int, tolerance: float) -> list[claims.Check]:
    """The claim on one `measure_probes`: exact hits (the right guess finds the whole prefix in a shared cache and
    nothing under its own salt; the wrong guess nothing); the hit visible: the right guess answers faster than the
    wrong one, by the ratio the calibrated cost predicts for what a working cache leaves each to compute (the
    prefix served to the right guess in a shared cache, nothing otherwise), within `tolerance`; and under its own
    salt the right guess answers like the wrong one, as predicted. The ratios compare two probes served back to
    back, so a machine whose speed drifts between the calibration and the probes slows both alike. That the hit
    answers faster is held only where a hit is visible (`probe_regime`; on a CPU the sizes must make it so)."""
    shared, salted = run.shared, run.salted
    regime = probe_regime(run, prefix_len, tolerance)
    checks = regime.checks() + [
        _equal("shared cache: right guess, cached tokens", shared["right guess"].cached_tokens, prefix_len),
        _equal("shared cache: prefix hits the engine reported", run.shared_hits, prefix_len),
        _equal("shared cache: wrong guess, cached tokens", shared["wrong guess"].cached_tokens, 0),
        _equal("own salt: prefix hits the engine reported", run.salted_hits, 0),
    ]
    for label, probes, served in (("shared cache", shared, prefix_len), ("own salt", salted, 0)):
        right, wrong = probes["right guess"], probes["wrong guess"]
        predicted = prefill_ms(run.cost, right.prompt_len - served) / prefill_ms(run.cost, wrong.prompt_len)
        name = f"{label}: TTFT of the right guess over the wrong one as predicted"
        checks.append(claims.within(name, right.ttft_ms / wrong.ttft_ms, predicted, tolerance))
    if regime.visible:
        checks.append(
            claims.less(
                "the hit is visible in TTFT (ms): right guess faster than wrong",
                shared["right guess"].ttft_ms,
                shared["wrong guess"].ttft_ms,
            )  # fmt: skip
        )
    return checks
