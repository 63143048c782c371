"""kvlab.planning.cluster: engines advanced on one time axis; colocated replicas and P/D pools, modelled."""

import math

import pytest

from kvlab.costs.workloads import TraceRequest, synthetic_trace
from kvlab.disagg.pd import LinkFit
from kvlab.engine.config import EngineConfig
from kvlab.engine.metrics import SLO
from kvlab.offload.tiers import link
from kvlab.planning import cluster
from kvlab.planning.simulate import LinearStepCost, simulate

COST = LinearStepCost(overhead_s=5e-3, per_token_s=50e-6, per_context_token_s=1e-7, per_seq_s=1e-5)
CONFIG = EngineConfig(block_size=16, num_blocks=2000, max_num_batched_tokens=512, max_num_seqs=32)
TRANSFER = cluster.Transfer(kv_bytes_per_token=131072, bytes_per_s=50e9, latency_s=1e-4)


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(80, "sharegpt", request_rate=20.0, vocab_size=1000, seed=3)


def test_one_replica_is_the_simulator(trace):
    """One colocated replica on the cluster's time axis gives `simulate`'s metrics exactly."""
    alone = simulate(trace, COST, CONFIG, record_steps=False)
    one = cluster.simulate_colocated(trace, COST, CONFIG, 1)
    assert [m.token_times for m in one.requests] == [m.token_times for m in alone.requests]
    assert [m.first_token_time for m in one.requests] == [m.first_token_time for m in alone.requests]


def test_replicas_split_the_load(trace):
    two = cluster.simulate_colocated(trace, COST, CONFIG, 2)
    assert two.num_gpus == 2 and all(busy > 0 for busy in two.busy_seconds)
    one = cluster.simulate_colocated(trace, COST, CONFIG, 1)
    assert two.summary()["mean_ttft_ms"] < one.summary()["mean_ttft_ms"]


def test_a_lone_request_through_prefill_transfer_and_decode():
    """TTFT = the prefill step + the transfer + the decode engine's first step, which computes one token."""
    prompt = tuple(range(2, 302))
    result = cluster.simulate_disaggregated(
        [TraceRequest(0.0, prompt, 4)], COST, COST, CONFIG, CONFIG, 1, 1, TRANSFER
    )
    (m,) = result.requests
    prefill = COST([300], [300])
    transfer = TRANSFER.latency_s + 300 * 131072 / 50e9
    decode = COST([1], [300])
    assert result.transfer_seconds == [pytest.approx(transfer)]
    assert m.first_token_time == pytest.approx(prefill + transfer + decode)
    # then three decode steps of one token each
    assert m.num_output_tokens == 4
    assert m.finish_time == pytest.approx(
        prefill + transfer + decode + COST([1], [301]) + COST([1], [302]) + COST([1], [303])
    )
    assert result.busy_seconds[0] == pytest.approx(prefill)


def test_disaggregated_pools(trace):
    result = cluster.simulate_disaggregated(trace, COST, COST, CONFIG, CONFIG, 1, 2, TRANSFER)
    assert result.num_gpus == 3 and len(result.requests) == len(trace)
    assert [m.num_output_tokens for m in result.requests] == [r.max_tokens for r in trace]
    for r, m, seconds in zip(trace, result.requests, result.transfer_seconds, strict=True):
        assert seconds == pytest.approx(TRANSFER.seconds(len(r.prompt_token_ids)))
        # no token before the prompt was prefilled and its K/V landed
        assert m.first_token_time >= r.arrival_time + COST([0], [0]) + seconds
    summary = result.summary(SLO(ttft_ms=1000))
    assert summary["request_goodput_per_gpu"] == pytest.approx(summary["request_goodput"] / 3)


def test_transfer_over_a_measured_link_is_its_prediction():
    """The transfer stage charges what `run_disaggregated`'s fitted link predicts, byte for byte."""
    fit = LinkFit.fit([(1 << 14, 2e-5), (1 << 20, 6e-4), (1 << 22, 2.3e-3)])
    transfer = cluster.Transfer.over(fit, 4096)
    for tokens in (1, 100, 5000):
        assert transfer.seconds(tokens) == pytest.approx(fit.predict(tokens * 4096))
    ib = cluster.Transfer.over(link("400 Gb InfiniBand NDR"), 131072)
    assert ib.seconds(1000) == pytest.approx(1000 * 131072 / 50e9)


def test_bad_input(trace):
    with pytest.raises(ValueError, match="engine count"):
        cluster.simulate_disaggregated(trace, COST, COST, CONFIG, CONFIG, 0, 2, TRANSFER)
    with pytest.raises(ValueError, match="num_blocks"):
        cluster.simulate_colocated(trace, COST, EngineConfig(), 2)
    with pytest.raises(ValueError, match="bytes_per_s"):
        cluster.Transfer(1000, 0.0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        cluster.Transfer(1000, math.inf)
    with pytest.raises(ValueError, match="empty"):
        cluster.simulate_colocated([], COST, CONFIG, 2)


def test_routing_policies_at_larger_n():
    """Four replicas, three tenants: prefix-affinity serves more prompt tokens from cache than round-robin, and
    the simulator's hit count is the replicas' own prefix-cache statistics."""
    from kvlab.planning.router import Router, multi_tenant_trace

    tenants = multi_tenant_trace(120, (400, 600, 800), (0.4, 0.3, 0.3), output_lens=(20, 60), seed=0)
    trace = [TraceRequest(i * 0.02, r.prompt_token_ids, r.max_tokens) for i, r in enumerate(tenants.requests)]
    config = EngineConfig(
        block_size=16, num_blocks=4000, max_num_batched_tokens=512, enable_prefix_caching=True
    )
    results = {
        policy: cluster.simulate_colocated(trace, COST, config, 4, Router(policy, prefix_blocks=4))
        for policy in ("round_robin", "least_loaded", "prefix_affinity", "kv_cost")
    }
    rates = {policy: r.summary()["prefix_hit_rate"] for policy, r in results.items()}
    assert rates["prefix_affinity"] > rates["round_robin"] > 0
    assert all(r.prompt_tokens == sum(len(t.prompt_token_ids) for t in trace) for r in results.values())
