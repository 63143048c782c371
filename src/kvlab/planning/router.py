"""Routing requests over several engine replicas, and the prefix-cache hits each routing gets, predicted exactly.

One engine's prefix cache (`kvlab.engine.block_pool`) serves a shared system prompt once it has computed it.
Behind a router that spreads requests over N replicas, each replica has its own cache, so a system prompt is
computed once per replica it reaches: where requests go decides how much is served from cache. This module runs
real `kvlab.engine.LLMEngine` replicas behind four policies (`POLICIES`), each choosing a replica on arrival:

- `round_robin`: request i goes to replica i mod N; blind to load and to caches.
- `least_loaded`: the fewest unfinished requests, then the fewest blocks in use; ties to the lowest index.
- `prefix_affinity`: the chained hash of the prompt's first K whole blocks, mod N, so every request that starts
  with the same K blocks lands on one replica. Prefix-aware routing as llm-d's blog describes it ("KV-Cache Wins
  You Can See: From Prefix Caching in vLLM to Distributed Scheduling with llm-d", 2025-09,
  https://llm-d.ai/blog/kvcache-wins-you-can-see), in its simplest stateless form: a hash of the prefix, no
  view of the caches.
- `kv_cost`: NVIDIA Dynamo's KV router cost (its documentation, https://docs.nvidia.com/dynamo/latest/components/router/README.html):
  for each replica, the prompt blocks it would compute (those not already cached there: new prefill blocks)
  plus its active blocks (those its requests hold, and the prompt blocks of requests routed to it and still
  waiting); the lowest cost wins, ties to the lowest index. We follow that description, with a weight of 1 on each term; Dynamo's
  "potential" decode blocks also count the incoming request's own blocks, the same on every replica, which
  changes no choice. The cached blocks are read from each replica's own block pool (its hash index,
  `BlockPool.cached_block_hash_to_block`), not from a copy kept by the router.

`run_policy` routes a trace and runs the replicas; `predict_hits` says, from the token ids alone, how many prompt
tokens an assignment of requests to replicas serves from cache. The two agree exactly (tests/test_router.py)
under the conditions `predict_hits` states, which `run_policy` meets by default and reports (`evicted_blocks`,
the replicas' `BlockPool.num_evictions`).
`multi_tenant_trace` builds the workload where routing matters: several tenants, each with its own system prompt.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedModel

from kvlab.checks import check_count
from kvlab.costs.workloads import TraceRequest
from kvlab.engine.block_manager import BlockManager
from kvlab.engine.block_pool import hash_block_tokens
from kvlab.engine.llm_engine import LLMEngine
from kvlab.engine.outputs import ScheduledBatch
from kvlab.engine.request import Request, SamplingParams
from kvlab.units import cdiv

POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "kv_cost")


@dataclass(frozen=True)
class TenantTrace:
    """A multi-tenant trace: the requests in arrival order, each tenant's system prompt, and each request's tenant
    (None for a request without a system prompt)."""

    requests: tuple[TraceRequest, ...]
    system_prompts: tuple[tuple[int, ...], ...]
    tenants: tuple[int | None, ...]

    def prefix_blocks(self, block_size: int) -> int:
        """Whole blocks the shortest system prompt fills (at least 1): `prefix_affinity`'s default K, so the
        hash covers system-prompt tokens only and every request of a tenant hashes alike."""
        check_count("block_size", block_size)
        return max(1, min((len(p) for p in self.system_prompts), default=0) // block_size)


def multi_tenant_trace(
    num_requests: int,
    system_prompt_lens: Sequence[int],
    shares: Sequence[float],
    suffix_lens: tuple[int, int] = (4, 12),
    output_lens: tuple[int, int] = (2, 6),
    vocab_size: int = 256,
    seed: int = 0,
) -> TenantTrace:
    """A seeded trace of `num_requests` requests over tenants with system prompts of `system_prompt_lens` tokens.

    Tenant t's system prompt opens `round(shares[t] × num_requests)` of the requests (largest remainders, so the
    counts add up); the share left over (1 - sum of shares) has no system prompt. Each request then has its own
    suffix of a length drawn from `suffix_lens` and an output length from `output_lens` (both inclusive ranges),
    and the requests come in a seeded random order, all with `arrival_time` 0 (`run_policy` paces them).

    Ids are drawn from 2 up (tiny models use 0 and 1 as bos and eos), like `kvlab.costs.workloads.draw_trace`. No
    prompt equals or begins with another, whole (suffixes are drawn again until none does), so a request's cache
    hits can come only from blocks of other prompts, never from another request's generated tokens.
    """
    check_count("num_requests", num_requests)
    check_count("vocab_size", vocab_size, 3)
    if len(system_prompt_lens) != len(shares):
        raise ValueError(
            f"one share per system prompt: got {len(system_prompt_lens)} lengths and {len(shares)} shares"
        )
    for n in system_prompt_lens:
        check_count("a system prompt length", n)
    for s in shares:
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s <= 1:
            raise ValueError(f"a share must be a number in [0, 1], got {s!r}")
    if sum(shares) > 1 + 1e-9:
        raise ValueError(f"shares add up to {sum(shares):g}, more than 1")
    for name, (low, high) in (("suffix_lens", suffix_lens), ("output_lens", output_lens)):
        if (
            isinstance(low, bool)
            or isinstance(high, bool)
            or not isinstance(low, int)
            or not isinstance(high, int)
        ):
            raise ValueError(f"{name} must be two integers (low, high), got {(low, high)!r}")
        if not 1 <= low <= high:
            raise ValueError(f"{name} must satisfy 1 <= low <= high, got {(low, high)!r}")
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(2, vocab_size, size=n))

    # Redraws allowed before giving up: a vocabulary too small for distinct prompts would loop forever.
    redraws = 100 + 10 * num_requests

    def clash(prompts: list[tuple[int, ...]]) -> int | None:
        nonlocal redraws
        pair = _prefix_pair(prompts)
        if pair is None:
            return None
        redraws -= 1
        if redraws < 0:
            raise ValueError(f"cannot draw {len(prompts)} distinct prompts from {vocab_size - 2} token ids")
        return pair[0]

    system_prompts = [draw(n) for n in system_prompt_lens]
    # A system prompt that opens another would make their tenants share blocks: draw it again.
    while (i := clash(system_prompts)) is not None:
        system_prompts[i] = draw(len(system_prompts[i]))
    tenants: list[int | None] = []
    for t, count in enumerate(_counts(shares, num_requests)):
        tenants += [t] * count
    tenants += [None] * (num_requests - len(tenants))
    tenants = [tenants[i] for i in rng.permutation(num_requests)]
    heads = [() if t is None else system_prompts[t] for t in tenants]
    suffixes = [draw(int(rng.integers(suffix_lens[0], suffix_lens[1] + 1))) for _ in tenants]
    outputs = [int(rng.integers(output_lens[0], output_lens[1] + 1)) for _ in tenants]
    prompts = [h + s for h, s in zip(heads, suffixes, strict=True)]
    # Unique prompts, none opening another: the one that opens the other gets a new suffix (system prompts open
    # none of each other, so a new suffix can always end the clash).
    while (i := clash(prompts)) is not None:
        prompts[i] = heads[i] + draw(len(suffixes[i]))
    requests = tuple(
        TraceRequest(0.0, p, n, t is not None) for p, n, t in zip(prompts, outputs, tenants, strict=True)
    )
    return TenantTrace(requests, tuple(system_prompts), tuple(tenants))


def _counts(shares: Sequence[float], total: int) -> list[int]:
    """Requests per share: the floors of share × total, then one more to the largest remainders (lowest index
    first on ties) until they reach round(sum of shares × total)."""
    exact = [s * total for s in shares]
    counts = [math.floor(x) for x in exact]
    target = min(total, round(sum(exact)))
    for i in sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))[
        : max(0, target - sum(counts))
    ]:
        counts[i] += 1
    return counts


def _prefix_pair(prompts: Sequence[tuple[int, ...]]) -> tuple[int, int] | None:
    """Indices (i, j) of two prompts where prompt i equals or opens prompt j, or None.

    Sorted, a prompt comes right before the prompts it opens (every prompt between them also starts with it),
    so comparing neighbours finds a pair if there is one."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    for a, b in zip(order, order[1:], strict=False):
        if prompts[b][: len(prompts[a])] == prompts[a]:
            return a, b
    return None


def prefix_hashes(prompt: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The engine's chained hashes (`kvlab.engine.block_pool.hash_block_tokens`, no cache salt) of the prompt's first
    `num_blocks` whole blocks (default: all of them)."""
    whole = len(prompt) // block_size if num_blocks is None else min(num_blocks, len(prompt) // block_size)
    hashes: list[int] = []
    for i in range(whole):
        hashes.append(
            hash_block_tokens(
                hashes[-1] if hashes else None, list(prompt[i * block_size : (i + 1) * block_size])
            )
        )
    return hashes


def round_robin(turn: int, num_replicas: int) -> int:
    """The replica of the `turn`-th request (counting from 0)."""
    return turn % check_count("num_replicas", num_replicas)


def least_loaded(replicas: Sequence[LLMEngine]) -> int:
    """The replica with the fewest unfinished requests (waiting or running), then the fewest blocks in use; ties
    to the lowest index."""
    check_count("num_replicas", len(replicas))
    return min(
        range(len(replicas)),
        key=lambda i: (
            len(replicas[i].scheduler.waiting) + len(replicas[i].scheduler.running),
            replicas[i].block_manager.num_used_blocks,
            i,
        ),
    )


def prefix_affinity(prompt: Sequence[int], num_replicas: int, block_size: int, prefix_blocks: int) -> int:
    """The chained hash of the prompt's first `prefix_blocks` whole blocks, mod `num_replicas`.

    A prompt with fewer whole blocks hashes the ones it has; a prompt shorter than one block hashes its tokens."""
    check_count("num_replicas", num_replicas)
    check_count("prefix_blocks", prefix_blocks)
    hashes = prefix_hashes(prompt, check_count("block_size", block_size), prefix_blocks)
    key = hashes[-1] if hashes else hash_block_tokens(None, list(prompt))
    return key % num_replicas


def cached_prompt_blocks(prompt: Sequence[int], block_manager: BlockManager) -> int:
    """Leading whole blocks of `prompt` that `block_manager` holds cached now (in use or free, not evicted), at
    most those before the prompt's last token, which the engine always computes (`BlockManager.get_computed_blocks`).

    Reads the first KV-cache group's hash table: the one group of a model whose layers all attend fully."""
    if not block_manager.enable_prefix_caching:
        return 0
    bs = block_manager.block_size
    n = 0
    for h in prefix_hashes(prompt, bs, (len(prompt) - 1) // bs):
        if (0, h) not in block_manager.block_pool.cached_block_hash_to_block:
            break
        n += 1
    return n


def replica_costs(prompt: Sequence[int], replicas: Sequence[LLMEngine]) -> list[int]:
    """Per replica, Dynamo's cost with weights 1: the prompt blocks it would compute, after the blocks it has
    cached (new prefill blocks), plus its active blocks: those its admitted requests hold (a block two requests
    share counts once) and the prompt blocks of requests routed to it and still waiting. Dynamo counts a request
    from the moment it routes it; without the waiting term, requests that arrive before any step would all cost
    the same everywhere, and the ties would send every one to replica 0."""
    costs = []
    for engine in replicas:
        bm = engine.block_manager
        hit = cached_prompt_blocks(prompt, bm) * bm.block_size
        # A preempted request waits again with its tokens so far: count what it will hold, not just its prompt
        queued = sum(cdiv(seq.num_tokens, bm.block_size) for seq in engine.scheduler.waiting)
        costs.append(cdiv(len(prompt) - hit, bm.block_size) + bm.num_used_blocks + queued)
    return costs


def kv_cost(prompt: Sequence[int], replicas: Sequence[LLMEngine]) -> int:
    """The replica of lowest `replica_costs`; ties to the lowest index."""
    check_count("num_replicas", len(replicas))
    costs = replica_costs(prompt, replicas)
    return costs.index(min(costs))


@dataclass
class Router:
    """One policy of `POLICIES`, with its state: how many requests it has routed (round-robin's turn).

    `prefix_blocks` is `prefix_affinity`'s K, the whole blocks it hashes; the other policies ignore it."""

    policy: str
    prefix_blocks: int | None = None
    routed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.prefix_blocks is not None:
            check_count("prefix_blocks", self.prefix_blocks)
        if self.policy == "prefix_affinity" and self.prefix_blocks is None:
            raise ValueError("prefix_affinity needs prefix_blocks (K, the whole blocks it hashes)")

    def choose(self, prompt: Sequence[int], replicas: Sequence[LLMEngine]) -> int:
        """The replica for the next request, given the replicas' state now."""
        check_count("num_replicas", len(replicas))
        turn, self.routed = self.routed, self.routed + 1
        if self.policy == "round_robin":
            return round_robin(turn, len(replicas))
        if self.policy == "least_loaded":
            return least_loaded(replicas)
        if self.policy == "prefix_affinity":
            assert self.prefix_blocks is not None  # __post_init__ refused None
            return prefix_affinity(
                prompt, len(replicas), replicas[0].block_manager.block_size, self.prefix_blocks
            )
        return kv_cost(prompt, replicas)


@dataclass(frozen=True)
class RouteResult:
    """One policy's run: where each request went, what the replicas' prefix caches served, and the balance.

    `hit_tokens` and `prompt_tokens` are the replicas' `prefix_cache_stats` (hits and queries) summed;
    `prefill_tokens` counts the prompt tokens the replicas actually computed, step by step, so it equals
    `prompt_tokens - hit_tokens` unless a preemption recomputed some. `outputs` are the generated ids, in trace
    order. `evicted_blocks` counts cached blocks the replicas evicted (0 is `predict_hits`' condition)."""

    policy: str
    assignment: tuple[int, ...]
    hit_tokens: int
    prompt_tokens: int
    prefill_tokens: int
    hits_per_replica: tuple[int, ...]
    hits_per_request: tuple[int, ...]
    requests_per_replica: tuple[int, ...]
    prompt_tokens_per_replica: tuple[int, ...]
    outputs: tuple[tuple[int, ...], ...]
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_imbalance(self) -> float:
        """Most requests on one replica over the mean per replica (1.0: even)."""
        return _imbalance(self.requests_per_replica)

    @property
    def prompt_imbalance(self) -> float:
        """Most prompt tokens on one replica over the mean per replica (1.0: even)."""
        return _imbalance(self.prompt_tokens_per_replica)


def _imbalance(per_replica: Sequence[int]) -> float:
    mean = sum(per_replica) / len(per_replica)
    return max(per_replica) / mean if mean else 1.0


def _requests_of(trace: TenantTrace | Sequence[TraceRequest]) -> list[TraceRequest]:
    requests = list(trace.requests if isinstance(trace, TenantTrace) else trace)
    if not requests:
        raise ValueError("the trace is empty: routing needs at least one request")
    return requests


def roomy_num_blocks(trace: TenantTrace | Sequence[TraceRequest], block_size: int) -> int:
    """A pool no replica can evict from, whatever it is sent: blocks for every request's prompt and output.

    The allocator hands out a never-used block before it evicts a cached one (free blocks holding no hash sit
    at the front of its queue), and no run allocates more blocks than this, so none is ever evicted."""
    check_count("block_size", block_size)
    return sum(cdiv(len(r.prompt_token_ids) + r.max_tokens, block_size) for r in _requests_of(trace))


def run_policy(
    trace: TenantTrace | Sequence[TraceRequest],
    model: PreTrainedModel,
    policy: str,
    num_replicas: int,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    prefix_blocks: int | None = None,
    arrivals_per_step: int | None = 1,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
) -> RouteResult:
    """Route `trace` over `num_replicas` fresh `LLMEngine` replicas of `model` by `policy`, run them, and report.

    Arrivals, deterministic: requests arrive in trace order (their `arrival_time` is not read), each routed on
    arrival; after every `arrivals_per_step` arrivals, each replica with unfinished work runs one engine step
    (None: all arrive before any step). After the last arrival every replica runs until done. Requests ignore
    eos and generate their `max_tokens`, greedily; a replica's queue keeps trace order, as its scheduler admits.

    `num_blocks` per replica defaults to `roomy_num_blocks`, so no cached block is evicted; `prefix_blocks`
    (`prefix_affinity`'s K) defaults to `TenantTrace.prefix_blocks` for a tenant trace.
    """
    requests = _requests_of(trace)
    check_count("num_replicas", num_replicas)
    if arrivals_per_step is not None:
        check_count("arrivals_per_step", arrivals_per_step)
    if prefix_blocks is None and isinstance(trace, TenantTrace):
        prefix_blocks = trace.prefix_blocks(block_size)
    router = Router(policy, prefix_blocks)
    num_blocks = roomy_num_blocks(requests, block_size) if num_blocks is None else num_blocks
    replicas = [
        LLMEngine(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=True,
            clock="virtual",
            log_stats=False,
        )
        for _ in range(num_replicas)
    ]
    prefill = [0] * num_replicas
    for k, engine in enumerate(replicas):
        engine.scheduler.on_step.append(functools.partial(_count_prefill, counts=prefill, replica=k))
    assignment: list[int] = []
    seqs: list[Request] = []
    for i, r in enumerate(requests):
        k = router.choose(r.prompt_token_ids, replicas)
        assignment.append(k)
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        seqs.append(replicas[k].add_request(list(r.prompt_token_ids), params, request_id=str(i)))
        if arrivals_per_step is not None and (i + 1) % arrivals_per_step == 0:
            for engine in replicas:
                if engine.has_unfinished_requests():
                    engine.step()
    while any(engine.has_unfinished_requests() for engine in replicas):
        for engine in replicas:
            if engine.has_unfinished_requests():
                engine.step()
    stats = [engine.block_manager.prefix_cache_stats for engine in replicas]
    return RouteResult(
        policy=policy,
        assignment=tuple(assignment),
        hit_tokens=sum(s.hits for s in stats),
        prompt_tokens=sum(s.queries for s in stats),
        prefill_tokens=sum(prefill),
        hits_per_replica=tuple(s.hits for s in stats),
        hits_per_request=tuple(s.metrics.num_cached_tokens for s in seqs),
        requests_per_replica=tuple(assignment.count(k) for k in range(num_replicas)),
        prompt_tokens_per_replica=tuple(
            sum(len(r.prompt_token_ids) for r, a in zip(requests, assignment, strict=True) if a == k)
            for k in range(num_replicas)
        ),
        outputs=tuple(tuple(s.output_token_ids) for s in seqs),
        evicted_blocks=sum(engine.block_manager.block_pool.num_evictions for engine in replicas),
    )


def _count_prefill(batch: ScheduledBatch, counts: list[int], replica: int) -> None:
    """Add the prompt tokens a batch computes (it runs before the sequences advance, so `num_computed_tokens`
    is still where each chunk starts)."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        counts[replica] += max(0, min(start + n, seq.num_prompt_tokens) - start)


def compare_policies(
    trace: TenantTrace | Sequence[TraceRequest],
    model: PreTrainedModel,
    num_replicas: int,
    policies: Sequence[str] = POLICIES,
    **run_knobs: Any,
) -> dict[str, RouteResult]:
    """`run_policy` for each policy on the same trace, each on fresh replicas (`run_knobs` are its keywords)."""
    return {p: run_policy(trace, model, p, num_replicas, **run_knobs) for p in policies}


def predict_request_hits(
    trace: TenantTrace | Sequence[TraceRequest],
    assignment: Sequence[int],
    block_size: int,
    *,
    whole_blocks: bool = True,
) -> list[int]:
    """Per request, the prompt tokens its replica serves from cache: `predict_hits` request by request."""
    requests = _requests_of(trace)
    check_count("block_size", block_size)
    if len(assignment) != len(requests):
        raise ValueError(f"the assignment names {len(assignment)} replicas for {len(requests)} requests")
    for k in assignment:
        check_count("a replica index", k, 0)
    prompts = [tuple(r.prompt_token_ids) for r in requests]
    for k in set(assignment):
        mine = [p for p, a in zip(prompts, assignment, strict=True) if a == k]
        _check_no_extension(mine, block_size)
    hits = []
    # Per replica: what it has cached, as block hashes (whole blocks) or as the prompts it has seen (tokens).
    cached: dict[int, set[int]] = {}
    seen: dict[int, list[tuple[int, ...]]] = {}
    for prompt, k in zip(prompts, assignment, strict=True):
        # vLLM's rule, as the block manager applies it: the last prompt token is always computed.
        if whole_blocks:
            blocks = cached.setdefault(k, set())
            n = 0
            for h in prefix_hashes(prompt, block_size, (len(prompt) - 1) // block_size):
                if h not in blocks:
                    break
                n += 1
            hits.append(n * block_size)
            blocks.update(prefix_hashes(prompt, block_size))
        else:
            earlier = seen.setdefault(k, [])
            hits.append(min(len(prompt) - 1, max((_common(prompt, q) for q in earlier), default=0)))
            earlier.append(prompt)
    return hits


def predict_hits(
    trace: TenantTrace | Sequence[TraceRequest],
    assignment: Sequence[int],
    block_size: int,
    *,
    whole_blocks: bool = True,
) -> int:
    """Prompt tokens the replicas serve from their prefix caches when request i runs on replica `assignment[i]`,
    from the token ids alone.

    Each replica sees its requests in trace order, and a request finds cached the whole blocks of the prompts
    sent there before it (hashes chained, so a block matches only under an equal prefix); its hit is the longest
    run of its leading whole blocks found, at most those before its last token, which vLLM and kvlab's block
    manager always compute (`BlockManager.get_computed_blocks`: `(len - 1) // block_size` blocks at most, so a prompt
    cached in full still computes its last block).

    Exact under these conditions, which `run_policy` meets by default: no cached block is evicted (pools large
    enough: `roomy_num_blocks`; `RouteResult.evicted_blocks` is 0); every request is first admitted only after
    the earlier requests on its replica have had their whole prompts scheduled (the engine's first-come,
    first-served queue does this, in trace order); the models' layers all attend fully; and no prompt begins with
    another prompt sent to the same replica and reaches a whole block past it, since its hit could then run into
    blocks of the other request's generated tokens, which token ids alone do not show (a ValueError says so).

    `whole_blocks=False` counts matching tokens, partial blocks too: what a cache that shares single tokens
    would serve, and not what a paged cache does (tests/test_router.py shows the difference).
    """
    return sum(predict_request_hits(trace, assignment, block_size, whole_blocks=whole_blocks))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _check_no_extension(prompts: Sequence[tuple[int, ...]], block_size: int) -> None:
    """Refuse prompts (in arrival order on one replica) where a later one (q) begins with an earlier one (p) and
    q's hit could reach a block past p's prompt, a block that holds p's generated tokens.

    Sorted, the prompts that begin with p follow it in a run; q can hit block `len(p) // block_size` (the first
    that holds a token past p) only if `(len(q) - 1) // block_size` exceeds it."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    for a, i in enumerate(order):
        p = prompts[i]
        for j in order[a + 1 :]:
            q = prompts[j]
            if q[: len(p)] != p:
                break
            if i < j and (len(q) - 1) // block_size > len(p) // block_size:
                raise ValueError(
                    f"a prompt of {len(q)} tokens begins with an earlier one of {len(p)} on the same replica: its"
                    " hits would depend on that request's generated tokens, so they cannot be predicted"
                )
