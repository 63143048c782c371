"""Serving on several GPUs, simulated: colocated replicas against disaggregated prefill and decode pools.

Every engine is kvlab's `LLMEngine` on a `CostRunner` with its own `VirtualClock`, as in
`kvlab.planning.simulate`: admission, chunked prefill, preemption and finishing are the engine's one step loop.
`run_cluster` advances them on one time axis: it always takes the earliest event, a trace arrival (handed to an
engine by the routing rule) or the step of the engine whose next step starts first. A request reaches an engine
no earlier than it exists, and an engine decides a step only from requests that exist when the step starts.

- `simulate_colocated`: N replicas, each doing prefill and decode with chunked prefill (vLLM's default); each
  arrival goes where a `kvlab.planning.router.Router` sends it (least-loaded unless told otherwise), so the four
  routing policies can be compared at any N, prefix-cache hits included.
- `simulate_disaggregated`: P prefill engines and D decode engines. A prefill engine runs a request to its first
  token (`max_tokens=1`), then its prompt's K/V crosses a link (`Transfer`) to the least-loaded decode engine,
  which admits it with all but the prompt's last token counted computed (`Request.external`) and generates every
  output token, as vLLM 0.33's decode instance does (it computes the prompt's last token again for its logits;
  `Scheduler._update_waiting_for_remote_kv`). TTFT is therefore prefill + transfer + the decode engine's first
  step, and the prefill's own token is not counted.

The transfer stage: each prefill engine sends over its own link, one transfer at a time, each taking
`Transfer.seconds` (latency + bytes / bandwidth: a `kvlab.disagg.pd.LinkFit` measured by `run_disaggregated`, or a
cited `kvlab.offload.tiers` link). What it leaves out: vLLM's decode instance reserves the blocks before the K/V
arrives (`WAITING_FOR_REMOTE_KVS`), while here they are taken on arrival; and the links of different prefill
engines do not share a switch. Everything here is modelled, not measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvlab.checks import check_count
from kvlab.costs.workloads import TraceRequest
from kvlab.engine.clock import VirtualClock
from kvlab.engine.config import EngineConfig
from kvlab.engine.cost_runner import CostRunner
from kvlab.engine.llm_engine import LLMEngine, RequestOutput
from kvlab.engine.metrics import SLO, RequestMetrics, summarize
from kvlab.engine.request import ExternalKV, Request, SamplingParams
from kvlab.planning.router import Router, least_loaded
from kvlab.planning.simulate import _check_trace

Cost = Callable[[Sequence[int], Sequence[int]], float]


@dataclass(frozen=True)
class Transfer:
    """Seconds to move a prompt's K/V: `latency_s` + tokens × `kv_bytes_per_token` / `bytes_per_s`."""

    kv_bytes_per_token: int
    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        check_count("kv_bytes_per_token", self.kv_bytes_per_token)
        if not self.bytes_per_s > 0 or not math.isfinite(self.bytes_per_s) or self.latency_s < 0:
            raise ValueError(
                f"a link needs bytes_per_s > 0 and latency_s >= 0, got {self.bytes_per_s!r}, {self.latency_s!r}"
            )

    @classmethod
    def over(cls, link: Any, kv_bytes_per_token: int) -> Transfer:
        """Over a `kvlab.disagg.pd.LinkFit` (its latency and bandwidth) or a `kvlab.offload.tiers.Link`
        (its datasheet rate, no latency)."""
        return cls(kv_bytes_per_token, link.bytes_per_s, max(0.0, getattr(link, "latency_s", 0.0)))

    def seconds(self, num_tokens: int) -> float:
        return self.latency_s + num_tokens * self.kv_bytes_per_token / self.bytes_per_s


@dataclass
class ClusterResult:
    """Each request's metrics as the user sees them (arrival at the cluster to each token), the GPUs used, and,
    when disaggregated, each request's transfer seconds and the seconds each engine spent in steps."""

    requests: list[RequestMetrics]
    num_gpus: int
    busy_seconds: list[float]
    transfer_seconds: list[float] = field(default_factory=list)
    # prompt tokens looked up in, and served by, the prefix caches of the engines that prefill
    prompt_tokens: int = 0
    hit_tokens: int = 0

    def summary(self, slo: SLO | None = None, qs: Sequence[float] = (50, 99)) -> dict[str, float]:
        out = summarize(self.requests, slo=slo, qs=qs)
        if slo is not None:
            out["request_goodput_per_gpu"] = out["request_goodput"] / self.num_gpus
        out["prefix_hit_rate"] = self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return out


def _next_step(engine: LLMEngine) -> float:
    """When `engine` next steps: now if it has work that has arrived, else at its next arrival (inf: none)."""
    scheduler = engine.scheduler
    if scheduler.running:
        return engine.clock.now()
    upcoming = scheduler.next_arrival()
    return math.inf if upcoming is None else max(engine.clock.now(), upcoming)


def run_cluster(
    engines: Sequence[LLMEngine],
    trace: Sequence[TraceRequest],
    dispatch: Callable[[int, TraceRequest], None],
    on_outputs: Callable[[int, list[RequestOutput]], None],
    max_steps: int = 10_000_000,
) -> None:
    """Advance `engines` on one time axis: `dispatch(i, request)` at each arrival (trace order), and after each
    engine step `on_outputs(engine index, the requests it finished)`."""
    arrivals = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)[::-1]
    for _ in range(max_steps):
        times = [_next_step(e) for e in engines]
        k = min(range(len(engines)), key=times.__getitem__)
        if arrivals and trace[arrivals[-1]].arrival_time <= times[k]:
            i = arrivals.pop()
            dispatch(i, trace[i])
            continue
        if times[k] == math.inf:
            return
        on_outputs(k, engines[k].step())
    raise RuntimeError(f"the cluster did not finish in {max_steps} steps")


def _engines(cost: Cost, config: EngineConfig, count: int) -> list[LLMEngine]:
    if config.num_blocks is None:
        raise ValueError("the simulator needs each engine's pool size: num_blocks")
    return [
        LLMEngine(
            config=replace(config, max_model_len=None),
            runner=CostRunner(cost, config.num_blocks, config.max_model_len),
            clock=VirtualClock(),
            log_stats=False,
        )
        for _ in range(check_count("the engine count", count))
    ]


def _busy(engines: Sequence[LLMEngine]) -> list[float]:
    return [sum(e.runner.step_seconds) for e in engines if isinstance(e.runner, CostRunner)]


def _lookups(engines: Sequence[LLMEngine]) -> tuple[int, int]:
    """Prompt tokens the engines' prefix caches looked up, and served."""
    stats = [e.block_manager.prefix_cache_stats for e in engines]
    return sum(s.queries for s in stats), sum(s.hits for s in stats)


def simulate_colocated(
    trace: Sequence[TraceRequest],
    cost: Cost,
    config: EngineConfig,
    num_replicas: int,
    router: Router | None = None,
) -> ClusterResult:
    """`num_replicas` engines that each prefill and decode; `router` (default least-loaded) picks each one."""
    _check_trace(trace)
    engines = _engines(cost, config, num_replicas)
    router = router or Router("least_loaded")
    seqs: list[Request] = []

    def dispatch(i: int, r: TraceRequest) -> None:
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        engine = engines[router.choose(r.prompt_token_ids, engines)]
        seqs.append(engine.add_request(list(r.prompt_token_ids), params, arrival_time=r.arrival_time))

    run_cluster(engines, trace, dispatch, lambda k, outs: _check_outputs(outs))
    return ClusterResult([s.metrics for s in seqs], num_replicas, _busy(engines), [], *_lookups(engines))


def _check_outputs(outputs: list[RequestOutput]) -> None:
    for out in outputs:
        if out.finish_reason == "error":
            raise ValueError(f"request {out.request_id}: {out.error}")


def simulate_disaggregated(
    trace: Sequence[TraceRequest],
    prefill_cost: Cost,
    decode_cost: Cost,
    prefill: EngineConfig,
    decode: EngineConfig,
    num_prefill: int,
    num_decode: int,
    transfer: Transfer,
) -> ClusterResult:
    """`num_prefill` prefill engines and `num_decode` decode engines with a `transfer` stage between them."""
    _check_trace(trace)
    prefills = _engines(prefill_cost, prefill, num_prefill)
    decodes = _engines(decode_cost, decode, num_decode)
    link_free = [0.0] * num_prefill
    metrics: list[RequestMetrics] = [RequestMetrics(r.arrival_time, len(r.prompt_token_ids)) for r in trace]
    decoded: dict[str, Request] = {}
    seconds: dict[int, float] = {}

    def dispatch(i: int, r: TraceRequest) -> None:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        engine = prefills[least_loaded(prefills)]
        engine.add_request(list(r.prompt_token_ids), params, arrival_time=r.arrival_time, request_id=str(i))

    def on_outputs(k: int, outputs: list[RequestOutput]) -> None:
        _check_outputs(outputs)
        if k >= num_prefill:
            return
        for out in outputs:
            i = int(out.request_id)
            done = out.metrics.finish_time
            assert done is not None
            start = max(done, link_free[k])
            seconds[i] = transfer.seconds(len(out.prompt_token_ids))
            link_free[k] = start + seconds[i]
            r = trace[i]
            seq = Request(
                list(r.prompt_token_ids),
                SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                arrival_time=link_free[k],
                request_id=out.request_id,
            )
            # Every prompt token but the last arrives computed: the decode engine's first step computes it.
            seq.external = ExternalKV(len(r.prompt_token_ids) - 1, None)
            # The decode engine is chosen as the transfer starts; the request waits there until it lands.
            decodes[least_loaded(decodes)].enqueue(seq)
            decoded[out.request_id] = seq

    run_cluster([*prefills, *decodes], trace, dispatch, on_outputs)
    for i, m in enumerate(metrics):
        got = decoded[str(i)].metrics
        m.first_scheduled_time, m.first_token_time, m.finish_time = (
            got.first_scheduled_time,
            got.first_token_time,
            got.finish_time,
        )
        m.token_times = got.token_times
        m.num_preemptions = got.num_preemptions
    return ClusterResult(
        metrics,
        num_prefill + num_decode,
        _busy([*prefills, *decodes]),
        [seconds[i] for i in range(len(trace))],
        *_lookups(prefills),
    )
