"""Disaggregated prefill and decode as two real processes that send K/V over `torch.distributed`.

`run_disaggregated(factory, prompts, params)` starts two processes, each building the same model with `factory`:
rank 0 is a prefill `LLMEngine`, rank 1 a decode `LLMEngine`. Rank 0 prefills every prompt (continuous batching,
`max_tokens=1`) and, as each request finishes there, a sender thread ships a header (request index, prompt
length, first token, payload bytes) and the prompt's K/V as raw bytes (`kvlab.disagg.connector`). On rank 1 a
receiver thread takes them as they come and hands them to the decode engine, which admits each with its prompt
counted as computed and generates the rest. Threads keep each engine stepping while bytes move, as vLLM's NIXL
connector transfers asynchronously.

The link: gloo over TCP on loopback when there is no GPU, or only one (K/V staged through host memory); NCCL
between two GPUs when the machine has two. `probe_sizes` payloads measure the link as the requests use it
(header, then payload, one at a time): before the requests, or, with `overlap=False`, in rounds with them (each
round every request's K/V and one payload of each size, shuffled). `LinkFit` fits seconds = latency + bytes /
bandwidth to the median of each size, so each request's transfer (its median over the rounds) can be predicted.
A transfer's seconds run from the moment the sender starts it (stamped into its header) to the moment the
receiver, always waiting in a receive, holds the whole payload.

Both processes stamp events with `time.perf_counter`, which is one system-wide monotonic clock on Linux, so times
taken in one process compare with the other's.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlab.claims import Check, between
from kvlab.disagg.connector import KVCapture, Prefilled, prefill_params, to_decode_request
from kvlab.engine.config import EngineConfig
from kvlab.engine.kv_pool import KVPool, KVShape
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.request import SamplingParams

# header fields, one int64 each; SENT_NS is the sender's `time.perf_counter_ns()` as the header leaves
INDEX, PROMPT_LEN, FIRST_TOKEN, DONE, NBYTES, SENT_NS = range(6)
HEADER_LEN = 6
# a payload size of -1 ends the stream; a request index of -1 marks a probe's payload
END = -1
PROBE = -1
# between the acknowledged transfers of the rounds
PAUSE_S = 0.002
DEFAULT_PROBE_SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 22)


@dataclass(frozen=True)
class LinkFit:
    """seconds = `latency_s` + bytes / `bytes_per_s`, least squares over the probe's (bytes, seconds) samples
    (`samples` keeps them all)."""

    latency_s: float
    bytes_per_s: float
    samples: tuple[tuple[int, float], ...]

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> LinkFit:
        """Fit to the median sample of each size: the typical transfer, which is what one request's single
        transfer is compared with (the fastest would predict a transfer that the machine's other work rarely
        allows)."""
        by_size: dict[int, list[float]] = {}
        for size, seconds in samples:
            by_size.setdefault(size, []).append(seconds)
        if len(by_size) < 2:
            raise ValueError("fitting a link needs samples of at least two sizes")
        typical = {size: float(np.median(times)) for size, times in by_size.items()}
        slope, intercept = np.polyfit(list(typical), list(typical.values()), 1)
        if slope <= 0:
            raise ValueError(
                f"the probe's time does not grow with its size (slope {slope:.3g} s/B): too noisy"
            )
        return cls(float(intercept), float(1 / slope), tuple((int(s), float(t)) for s, t in samples))

    def predict(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass
class RequestTrace:
    """One request's path, in `time.perf_counter` seconds: queued at prefill, first token there, payload sent
    and received whole, finished at decode; `kv_bytes` sent and the seconds the receiver waited for them; with
    `SamplingParams(logprobs=k)`, each token's k best ids (the first from the prefill process, the rest from
    the decode process), for `kvlab.agreement`'s near-tie rule."""

    request_id: str
    prompt_len: int
    kv_bytes: int
    token_ids: list[int]
    arrival: float
    first_token: float
    sent: float = 0.0
    received: float = 0.0
    transfer_s: float = 0.0
    transfer_samples: list[float] = field(default_factory=list)
    finished: float = 0.0
    token_times: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] | None = None

    @property
    def ttft(self) -> float:
        """To the first token at the prefill instance."""
        return self.first_token - self.arrival


@dataclass(frozen=True)
class DisaggResult:
    """Tokens per prompt (in prompt order), each request's `RequestTrace`, and the link: its backend, where each
    engine ran, and the probe's fit."""

    token_ids: list[list[int]]
    traces: list[RequestTrace]
    backend: str
    devices: tuple[str, str]
    link: LinkFit

    @property
    def kv_bytes(self) -> list[int]:
        return [t.kv_bytes for t in self.traces]

    @property
    def top_token_ids(self) -> list[list[list[int]] | None]:
        """Per prompt, each token's best ids (None where the run asked for no `logprobs`)."""
        return [t.top_token_ids for t in self.traces]

    def transfer_ratios(self, link: LinkFit | None = None) -> list[float]:
        """Each request's measured transfer over what `link` (default: this run's fit) predicts for its bytes."""
        fit = link or self.link
        return [t.transfer_s / fit.predict(t.kv_bytes) for t in self.traces]

    def growth_ratio(self, link: LinkFit | None = None) -> float:
        """The requests' seconds per byte (the slope of a least-squares line through their `transfer_s`) over
        `link`'s (default: this run's fit), 1 / `bytes_per_s`."""
        fit = link or self.link
        sizes = [t.kv_bytes for t in self.traces]
        if len(set(sizes)) < 2:
            raise ValueError("the transfer claim needs requests of at least two sizes")
        return float(np.polyfit(sizes, [t.transfer_s for t in self.traces], 1)[0]) * fit.bytes_per_s

    def transfer_checks(self, band: Sequence[float], link: LinkFit | None = None) -> list[Check]:
        """The transfer claim on `link` (default: this run's fit), both ratios in `band` (low, high): the median
        of `transfer_ratios` (the prediction's level) and `growth_ratio`. The latency, and with it whatever the
        machine's other work adds to every transfer, cancels from the second: a bandwidth 2x wrong misses it even
        where the latency dominates the first."""
        low, high = band
        return [
            between("median measured / predicted", float(np.median(self.transfer_ratios(link))), low, high),
            between("seconds per byte, requests / link", self.growth_ratio(link), low, high),
        ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def placement() -> tuple[str, str, str]:
    """The backend and the two engines' devices on this machine."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return "nccl", "cuda:0", "cuda:1"
    if count == 1:
        return "gloo", "cuda:0", "cuda:0"
    return "gloo", "cpu", "cpu"


def run_disaggregated(
    factory: Callable[..., Any],
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    prefill: EngineConfig | None = None,
    decode: EngineConfig | None = None,
    probe_sizes: Sequence[int] = DEFAULT_PROBE_SIZES,
    probe_repeats: int = 5,
    timeout_s: float = 600.0,
    overlap: bool = True,
) -> DisaggResult:
    """Serve `prompts` on a prefill process and a decode process; `factory(device=...)` builds the model in each
    (it must be picklable, such as `functools.partial(kvlab.models.tiny_model, "llama", ...)`).

    `overlap=False` moves the K/V only once every prompt is prefilled, one request at a time, each acknowledged
    before the next, and decodes once all have landed: each transfer then meets the link alone, as the probe's
    do. On a CPU, where the engines' forwards and the transfer threads share the cores, that is the way to
    measure the link; the tokens and bytes are the same either way. Then the probe runs with the requests: in each
    of `probe_repeats` rounds, one payload of each probe size and then every request's K/V, so that the probe
    and the requests meet the same load, and each `RequestTrace` keeps its time from every round."""
    if not prompts:
        raise ValueError("no prompts to serve")
    prefill_params(params)
    if min(probe_sizes, default=0) < 1 or len(set(probe_sizes)) < 2 or probe_repeats < 1:
        raise ValueError("probe_sizes needs two or more distinct positive sizes, and probe_repeats >= 1")
    backend, *devices = placement()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = (backend, port, devices, factory, [list(p) for p in prompts], params, prefill, decode, overlap)
    probe = (tuple(probe_sizes), probe_repeats)
    procs = [ctx.Process(target=_worker, args=(rank, *args, probe, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < 2:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"the {('prefill', 'decode')[rank]} process failed:\n{value}")
            got[rank] = value
    except queue.Empty:
        raise RuntimeError(f"the disaggregated run did not finish in {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    traces: list[RequestTrace] = got[1]["traces"]
    for trace in traces:
        trace.arrival, trace.first_token, trace.sent = got[0]["times"][trace.request_id]
        first = got[0]["top"].get(trace.request_id)
        if first is not None:
            # the first token's candidates are the prefill's, the rest the decode engine's
            trace.top_token_ids = [first, *(trace.top_token_ids or [])]
    return DisaggResult(
        [t.token_ids for t in traces], traces, backend, (devices[0], devices[1]), LinkFit.fit(got[1]["probe"])
    )


def _worker(
    rank: int,
    backend: str,
    port: int,
    devices: list[str],
    factory: Callable[..., Any],
    prompts: list[list[int]],
    params: SamplingParams,
    prefill: EngineConfig | None,
    decode: EngineConfig | None,
    overlap: bool,
    probe: tuple[tuple[int, ...], int],
    results: Any,
) -> None:
    try:
        # Both ranks are on this machine: gloo talks over loopback, whatever interface the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        device = torch.device(devices[rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            # Two engines share this machine's cores, as two instances on one node would.
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        # The link's own tensors: on the GPU for NCCL, in host memory for gloo.
        link = device if backend == "nccl" else torch.device("cpu")
        model = factory(device=device)
        if rank == 0:
            if overlap:
                _probe_send(probe, link)
            config = prefill or EngineConfig()
            times, top = _serve_prefill(model, prompts, params, config, link, overlap, probe)
            value: Any = {"times": times, "top": top}
        else:
            # One receive buffer, its pages touched now, as vLLM's decode side receives into its registered pool:
            # a fresh buffer per transfer would charge each its page faults.
            largest = max(len(p) for p in prompts) * KVPool.bytes_per_token(
                KVShape.from_config(model.config), next(model.parameters()).dtype
            )
            staging = torch.zeros(max(largest, *probe[0]), dtype=torch.uint8, device=link)
            # without overlap, the receiver takes the probe's samples in the rounds of the requests
            samples = _probe_recv(probe, staging) if overlap else []
            config = decode or EngineConfig()
            traces = _serve_decode(model, prompts, params, config, staging, overlap, samples)
            value = {"probe": samples, "traces": traces}
        dist.barrier()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _send(header: list[int], payload: torch.Tensor | None, link: torch.device) -> None:
    staged = None if payload is None else payload.to(link).reshape(-1).view(torch.uint8)
    if link.type == "cuda":
        torch.cuda.synchronize(link)
    header = [*header[:SENT_NS], time.perf_counter_ns()]
    dist.send(torch.tensor(header, dtype=torch.int64, device=link), dst=1)
    if staged is not None and staged.numel():
        dist.send(staged, dst=1)


def _recv(staging: torch.Tensor) -> tuple[list[int], torch.Tensor | None, float]:
    """A header and its payload, received into `staging`; the seconds from the sender's stamp to the whole
    payload here. The payload returned is a copy, made after the clock stops."""
    link = staging.device
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=link)
    dist.recv(header, src=0)
    values = header.tolist()
    payload = None
    if values[NBYTES] > 0:
        if values[NBYTES] > staging.numel():
            raise ValueError(f"a payload of {values[NBYTES]:,} bytes exceeds the receive buffer")
        payload = staging[: values[NBYTES]]
        dist.recv(payload, src=0)
    if link.type == "cuda":
        torch.cuda.synchronize(link)
    seconds = (time.perf_counter_ns() - values[SENT_NS]) / 1e9
    return values, None if payload is None else payload.clone(), seconds


def _probe_payloads(probe: tuple[tuple[int, ...], int], link: torch.device) -> Iterator[list[torch.Tensor]]:
    """One payload of each size per round, made as the round comes. Real bytes in touched pages (a zeroed buffer
    can be the kernel's one zero page), a fresh buffer each send."""
    sizes, repeats = probe
    for _ in range(repeats):
        yield [torch.randint(0, 256, (size,), dtype=torch.uint8, device=link) for size in sizes]


def _send_acknowledged(header: list[int], payload: torch.Tensor | None, link: torch.device) -> None:
    """One transfer at a time: the next starts once this one has landed, as a lone request's would."""
    _send(header, payload, link)
    dist.recv(torch.zeros(1, dtype=torch.int64, device=link), src=1)


def _probe_send(probe: tuple[tuple[int, ...], int], link: torch.device) -> None:
    # Every payload made first: a request's K/V was written long before it leaves, so it is not in the CPU's
    # cache either.
    for batch in list(_probe_payloads(probe, link)):
        for payload in batch:
            _send_acknowledged([PROBE, 0, 0, 0, payload.numel(), 0], payload, link)


def _probe_recv(probe: tuple[tuple[int, ...], int], staging: torch.Tensor) -> list[tuple[int, float]]:
    sizes, repeats = probe
    samples = []
    ack = torch.zeros(1, dtype=torch.int64, device=staging.device)
    for _ in range(repeats * len(sizes)):
        header, _, seconds = _recv(staging)
        samples.append((header[NBYTES], seconds))
        dist.send(ack, dst=0)
    return samples


def _serve_prefill(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    config: EngineConfig,
    link: torch.device,
    overlap: bool,
    probe: tuple[tuple[int, ...], int],
) -> tuple[dict[str, tuple[float, float, float]], dict[str, list[int]]]:
    """Each request's (arrival, first token, sent) times, and its first token's best ids where asked for."""
    engine = LLMEngine(model, config)
    capture = KVCapture(engine)
    outbox: queue.Queue[tuple[list[int], torch.Tensor | None] | None] = queue.Queue()
    sent: dict[int, float] = {}
    sender = threading.Thread(target=_sender, args=(outbox, link, sent, None), daemon=True)
    if overlap:
        sender.start()
    arrival = time.perf_counter()
    first = prefill_params(params)
    index = {f"req-{i}": i for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, first, request_id=f"req-{i}")
    times = {}
    top: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            item = capture.take(out, params)
            times[out.request_id] = (arrival, now)
            if out.top_token_ids:
                top[out.request_id] = out.top_token_ids[0]
            done = int(item.finish_reason is not None)
            header = [
                index[out.request_id],
                len(out.prompt_token_ids),
                item.first_token,
                done,
                item.kv_bytes,
                0,
            ]
            outbox.put((header, item.kv))
    outbox.put(None)
    if overlap:
        sender.join()
    else:
        # Every prompt is prefilled: the transfers run now, one at a time, each acknowledged.
        _sender(outbox, link, sent, _probe_payloads(probe, link))
    return {rid: (*times[rid], sent[i]) for rid, i in index.items()}, top


def _sender(
    outbox: queue.Queue[tuple[list[int], torch.Tensor | None] | None],
    link: torch.device,
    sent: dict[int, float],
    rounds: Iterator[list[torch.Tensor]] | None,
) -> None:
    """Send each item as it comes; or, given the probe's `rounds`, once every item is queued: in each round,
    that round's probe payloads, then every item, each acknowledged (`sent` keeps the first round's times)."""
    if rounds is None:
        while (item := outbox.get()) is not None:
            sent[item[0][INDEX]] = time.perf_counter()
            _send(*item, link)
    else:
        items = list(iter(outbox.get, None))
        # Round after round, not one request's repeats back to back: the K/V sent again has left the CPU's
        # caches since, and a spell of the machine's other work slows the probe's payloads and the requests
        # alike. Each round shuffles its order: the scheduler lets a process that has run a while wait longer
        # for the core, so the last of a round's transfers would be the slowest, whatever its size.
        for number, batch in enumerate(rounds):
            probes = [([PROBE, 0, 0, 0, payload.numel(), 0], payload) for payload in batch]
            order = [*items, *probes]
            random.Random(number).shuffle(order)
            for header, payload in order:
                # a pause before each transfer: each starts after a wait, as a lone request's does
                time.sleep(PAUSE_S)
                if header[INDEX] != PROBE:
                    sent.setdefault(header[INDEX], time.perf_counter())
                _send_acknowledged(header, payload, link)
    _send([0, 0, 0, 0, END, 0], None, link)


def _serve_decode(
    model: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    config: EngineConfig,
    staging: torch.Tensor,
    overlap: bool,
    samples: list[tuple[int, float]],
) -> list[RequestTrace]:
    engine = LLMEngine(model, config)
    if engine.pool is None:
        raise ValueError("the decode engine needs a KV pool")
    pool = engine.pool
    inbox: queue.Queue[tuple[list[int], torch.Tensor | None, list[float], float] | None] = queue.Queue()
    if overlap:
        threading.Thread(target=_receiver, args=(inbox, staging, None), daemon=True).start()
    else:
        # Everything lands before the first decode step.
        _receiver(inbox, staging, samples)
    traces: dict[int, RequestTrace] = {}
    index = {f"req-{i}": i for i in range(len(prompts))}
    open_stream = True
    while open_stream or engine.has_unfinished_requests():
        # Block for the next arrival only when there is nothing to decode.
        while True:
            try:
                item = inbox.get(block=not engine.has_unfinished_requests() and open_stream)
            except queue.Empty:
                break
            if item is None:
                open_stream = False
                break
            header, payload, transfers, received = item
            i = header[INDEX]
            trace = RequestTrace(
                f"req-{i}", header[PROMPT_LEN], header[NBYTES], [header[FIRST_TOKEN]], 0.0, 0.0
            )
            trace.received, trace.transfer_samples = received, transfers
            # the typical round, as the probe's fit takes the median of each size
            trace.transfer_s = float(np.median(transfers))
            traces[i] = trace
            if header[DONE]:
                trace.finished = received
                continue
            assert payload is not None
            shape = (pool.shape.num_layers, 2, header[PROMPT_LEN], pool.shape.kv_heads, pool.shape.head_dim)
            kv = payload.to(pool.kv.device).view(pool.dtype).view(shape)
            item_ = Prefilled(trace.request_id, prompts[i], header[FIRST_TOKEN], None, kv)
            engine.enqueue(to_decode_request(item_, params, engine.clock.now()))
        if engine.has_unfinished_requests():
            now = time.perf_counter()
            for out in engine.step():
                i = index[out.request_id]
                traces[i].token_ids = out.token_ids
                traces[i].top_token_ids = out.top_token_ids
                traces[i].finished = now
    if len(traces) != len(prompts):
        raise RuntimeError(f"received {len(traces)} of {len(prompts)} requests")
    return [traces[i] for i in range(len(prompts))]


def _receiver(
    inbox: queue.Queue[Any], staging: torch.Tensor, samples: list[tuple[int, float]] | None
) -> None:
    """Each request's header, payload, transfer seconds and first receipt, put in `inbox` as it lands; or, given
    `samples` (the acknowledged rounds), the probe's (bytes, seconds) appended there, and each request put once
    the stream ends, with its seconds from every round."""
    ack = torch.zeros(1, dtype=torch.int64, device=staging.device)
    got: dict[int, tuple[list[int], torch.Tensor | None, list[float], float]] = {}
    while True:
        header, payload, seconds = _recv(staging)
        if header[NBYTES] == END:
            break
        if samples is None:
            inbox.put((header, payload, [seconds], time.perf_counter()))
            continue
        if header[INDEX] == PROBE:
            samples.append((header[NBYTES], seconds))
        elif header[INDEX] in got:
            # a later round: only its time
            got[header[INDEX]][2].append(seconds)
        else:
            got[header[INDEX]] = (header, payload, [seconds], time.perf_counter())
        dist.send(ack, dst=0)
    for item in got.values():
        inbox.put(item)
    inbox.put(None)
