"""kvlab.planning.router: four routing policies over real tiny-model replicas, and the hits predicted exactly.

The trace has 3 tenants whose system prompts (22, 30, 37 tokens) end inside a block of 4, so a prediction that
counted partial blocks would be off; outputs are short (1-2 tokens), so requests finish between arrivals and the
cost policy, which charges a replica for its running requests' blocks, can come back to a replica's cache.
"""

import pytest

from kvlab.costs.workloads import TraceRequest
from kvlab.engine import LLMEngine
from kvlab.engine.request import Request, SamplingParams
from kvlab.models import tiny_model
from kvlab.planning import router

KNOBS = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
BLOCK = 4
REPLICAS = 4
SYSTEM = (22, 30, 37)
SHARES = (0.4, 0.3, 0.3)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", **KNOBS)


@pytest.fixture(scope="module")
def trace():
    return router.multi_tenant_trace(16, SYSTEM, SHARES, output_lens=(1, 2), seed=0)


@pytest.fixture(scope="module")
def results(llama, trace):
    return router.compare_policies(trace, llama, REPLICAS, block_size=BLOCK)


@pytest.mark.parametrize("policy", router.POLICIES)
def test_measured_hits_equal_prediction(results, trace, policy):
    result = results[policy]
    assert result.evicted_blocks == 0  # predict_hits' condition
    assert result.hit_tokens == router.predict_hits(trace, result.assignment, BLOCK)
    assert list(result.hits_per_request) == router.predict_request_hits(trace, result.assignment, BLOCK)
    assert result.prompt_tokens == sum(len(r.prompt_token_ids) for r in trace.requests)
    # No preemption with roomy pools: the replicas computed every prompt token the caches did not serve.
    assert result.prefill_tokens == result.prompt_tokens - result.hit_tokens
    assert sum(result.requests_per_replica) == len(trace.requests)
    assert sum(result.hits_per_replica) == result.hit_tokens


def test_prediction_on_other_sizes(llama):
    """2 and 3 replicas, blocks of 8, three arrivals per step: still exact, for every policy."""
    trace = router.multi_tenant_trace(10, (20, 27), (0.5, 0.3), output_lens=(1, 3), seed=1)
    for replicas in (2, 3):
        for policy, result in router.compare_policies(
            trace, llama, replicas, block_size=8, arrivals_per_step=3
        ).items():
            assert result.evicted_blocks == 0, policy
            assert result.hit_tokens == router.predict_hits(trace, result.assignment, 8), policy


def test_prefix_aware_policies_beat_round_robin(results):
    hits = {p: r.hit_tokens for p, r in results.items()}
    assert hits["prefix_affinity"] > hits["round_robin"]
    assert hits["kv_cost"] > hits["round_robin"]


def test_least_loaded_balances_requests(llama, trace):
    # All arrive before any step: each arrival sees the ones routed before it waiting.
    result = router.run_policy(
        trace, llama, "least_loaded", REPLICAS, block_size=BLOCK, arrivals_per_step=None
    )
    counts = result.requests_per_replica
    assert max(counts) - min(counts) <= 1
    assert result.request_imbalance <= (len(trace.requests) / REPLICAS + 1) / (len(trace.requests) / REPLICAS)
    assert result.hit_tokens == router.predict_hits(trace, result.assignment, BLOCK)


@pytest.mark.parametrize("policy", ["prefix_affinity", "kv_cost"])
def test_outputs_equal_a_single_engine(llama, trace, results, policy):
    """A request's generated tokens do not depend on the replica, or on the cache hit it got there."""
    result = results[policy]
    # The first request that hit the cache on each replica, and the first that missed.
    first_hit = {}
    for i, (k, h) in enumerate(zip(result.assignment, result.hits_per_request, strict=True)):
        if h:
            first_hit.setdefault(k, i)
    chosen = [*first_hit.values(), result.hits_per_request.index(0)]
    assert len(first_hit) >= 2
    for i in chosen:
        r = trace.requests[i]
        alone = LLMEngine(llama, block_size=BLOCK, num_blocks=64, clock="virtual")
        out = alone.generate(
            [list(r.prompt_token_ids)], SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        )
        assert tuple(out[0].token_ids) == result.outputs[i]


def test_mutation_partial_blocks_would_fail(results, trace):
    """Counting the matched tokens of partial blocks (the system prompts end inside a block) over-predicts."""
    for policy, result in results.items():
        partial = router.predict_hits(trace, result.assignment, BLOCK, whole_blocks=False)
        assert partial > result.hit_tokens, policy


def test_last_token_is_always_computed():
    """A block-aligned prompt sent twice hits all its blocks but the last (vLLM's rule, the block manager's)."""
    prompt = tuple(range(2, 2 + 3 * BLOCK))
    trace = [TraceRequest(0.0, prompt, 2), TraceRequest(0.0, prompt, 2), TraceRequest(0.0, prompt[:5], 2)]
    assert router.predict_request_hits(trace, [0, 0, 0], BLOCK) == [0, 2 * BLOCK, BLOCK]
    assert router.predict_request_hits(trace, [0, 1, 1], BLOCK) == [0, 0, BLOCK]
    assert router.predict_request_hits(trace, [0, 1, 2], BLOCK) == [0, 0, 0]


def test_cached_blocks_read_from_the_block_manager(llama, trace):
    """`cached_prompt_blocks` agrees with the engine's own lookup, and the cost policy prefers that cache."""
    engines = [LLMEngine(llama, block_size=BLOCK, num_blocks=64, clock="virtual") for _ in range(2)]
    first, second = [r for r, t in zip(trace.requests, trace.tenants, strict=True) if t == 0][:2]
    engines[1].generate([list(first.prompt_token_ids)], SamplingParams(max_tokens=1))
    prompt = second.prompt_token_ids
    hit = engines[1].block_manager.get_computed_blocks(Request(list(prompt)))
    expected = hit.num_computed_tokens // BLOCK
    assert router.cached_prompt_blocks(prompt, engines[1].block_manager) == expected == SYSTEM[0] // BLOCK
    assert router.cached_prompt_blocks(prompt, engines[0].block_manager) == 0
    costs = router.replica_costs(prompt, engines)
    assert costs[1] == costs[0] - SYSTEM[0] // BLOCK
    assert router.kv_cost(prompt, engines) == 1


def test_trace_is_seeded_and_shaped(trace):
    again = router.multi_tenant_trace(16, SYSTEM, SHARES, output_lens=(1, 2), seed=0)
    assert again == trace
    assert router.multi_tenant_trace(16, SYSTEM, SHARES, output_lens=(1, 2), seed=1) != trace
    # round(share × 16) requests per tenant: 6.4, 4.8, 4.8 -> 6, 5, 5
    assert [trace.tenants.count(t) for t in range(3)] == [6, 5, 5]
    for r, t in zip(trace.requests, trace.tenants, strict=True):
        system = trace.system_prompts[t]
        assert r.prompt_token_ids[: len(system)] == system and len(r.prompt_token_ids) > len(system)
        assert r.shares_prefix and 1 <= r.max_tokens <= 2
    prompts = sorted(r.prompt_token_ids for r in trace.requests)
    assert all(b[: len(a)] != a for a, b in zip(prompts, prompts[1:], strict=False))
    assert trace.prefix_blocks(BLOCK) == 22 // BLOCK
    partial = router.multi_tenant_trace(10, (8,), (0.5,), seed=0)
    assert partial.tenants.count(None) == 5


def test_prefix_affinity_hashes_whole_blocks():
    base = list(range(2, 2 + 2 * BLOCK))
    same = [router.prefix_affinity(base + [n] * 3, 4, BLOCK, 2) for n in range(10, 20)]
    assert len(set(same)) == 1
    assert router.prefix_affinity([5, 6], 4, BLOCK, 2) in range(4)


PLAIN = [TraceRequest(0.0, (2, 3, 4, 5, 6), 2)]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: router.run_policy(PLAIN, None, "round_robin", 0), "num_replicas must be an integer >= 1"),
        (lambda: router.Router("fastest"), "unknown policy 'fastest'"),
        (lambda: router.Router("prefix_affinity"), "prefix_affinity needs prefix_blocks"),
        (lambda: router.Router("prefix_affinity", 0), "prefix_blocks must be an integer >= 1"),
        (lambda: router.Router("round_robin").choose([2, 3], []), "num_replicas must be an integer >= 1"),
        (lambda: router.round_robin(0, 0), "num_replicas must be an integer >= 1"),
        (lambda: router.multi_tenant_trace(4, (8, 8), (0.5, -0.1)), "a share must be a number in [0, 1]"),
        (lambda: router.multi_tenant_trace(4, (8, 8), (0.7, 0.6)), "shares add up to 1.3"),
        (lambda: router.multi_tenant_trace(4, (8,), (0.5, 0.5)), "one share per system prompt"),
        (lambda: router.multi_tenant_trace(0, (8,), (0.5,)), "num_requests must be an integer >= 1"),
        (lambda: router.multi_tenant_trace(4, (0,), (0.5,)), "a system prompt length must be"),
        (lambda: router.multi_tenant_trace(4, (8,), (0.5,), suffix_lens=(3, 2)), "suffix_lens must satisfy"),
        (lambda: router.multi_tenant_trace(9, (2,), (1.0,), (1, 1), vocab_size=4), "cannot draw 9 distinct"),
        (lambda: router.predict_hits(PLAIN, [0, 1], BLOCK), "the assignment names 2 replicas for 1 requests"),
        (lambda: router.predict_hits(PLAIN, [-1], BLOCK), "a replica index must be an integer >= 0"),
        (lambda: router.predict_hits(PLAIN, [0], 0), "block_size must be an integer >= 1"),
        (lambda: router.predict_hits([], [], BLOCK), "the trace is empty"),
        (
            lambda: router.predict_hits(
                [TraceRequest(0.0, (2,) * 4, 1), TraceRequest(0.0, (2,) * 9, 1)], [0, 0], BLOCK
            ),
            "cannot be predicted",
        ),
        (lambda: router.run_policy(PLAIN, None, "prefix_affinity", 2), "prefix_affinity needs prefix_blocks"),
        (lambda: router.run_policy(PLAIN, None, "round_robin", 2, arrivals_per_step=0), "arrivals_per_step"),
    ],
)
def test_bad_input_gives_one_line_error(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cost_policy_counts_requests_routed_and_still_waiting(llama, trace):
    # All 16 arrive before any step: only the waiting term tells the replicas apart; without it every request
    # went to replica 0
    result = router.run_policy(trace, llama, "kv_cost", REPLICAS, block_size=BLOCK, arrivals_per_step=None)
    assert max(result.requests_per_replica) < len(trace.requests)
    assert result.hit_tokens == router.predict_hits(trace, result.assignment, BLOCK)


@pytest.mark.slow
def test_prediction_holds_on_the_real_model():
    """SmolLM2-135M as four replicas: the hits every policy gets still equal the prediction from the token ids."""
    from kvlab.models import real_model

    model, _ = real_model(device="cpu")
    trace = router.multi_tenant_trace(
        16, SYSTEM, SHARES, output_lens=(1, 2), vocab_size=model.config.vocab_size, seed=0
    )
    for policy, result in router.compare_policies(trace, model, REPLICAS, block_size=BLOCK).items():
        assert result.evicted_blocks == 0, policy
        assert result.hit_tokens == router.predict_hits(trace, result.assignment, BLOCK), policy
