import math

import numpy as np
import pytest

from kvlab.costs.workloads import ALPACA, SHAREGPT, poisson_arrivals, synthetic_trace
from kvlab.engine.metrics import SLO, RequestMetrics, duration, summarize


def request(arrival, token_times, prompt=10):
    return RequestMetrics(
        arrival_time=arrival,
        num_prompt_tokens=prompt,
        first_scheduled_time=arrival,
        first_token_time=token_times[0],
        finish_time=token_times[-1],
        token_times=list(token_times),
    )


def test_request_metrics():
    m = request(1.0, [1.5, 1.6, 1.8])
    assert m.ttft == pytest.approx(0.5)
    assert m.itls == pytest.approx([0.1, 0.2])
    assert m.tpot == pytest.approx(0.15)
    assert m.e2e_latency == pytest.approx(0.8)
    assert request(0.0, [0.2]).tpot is None


def test_summary_uses_vllm_names_and_values():
    reqs = [request(0.0, [0.1, 0.2, 0.3]), request(0.5, [0.9, 1.0]), request(1.0, [1.2, 1.5, 1.8, 2.0])]
    s = summarize(reqs)
    assert s["duration"] == pytest.approx(duration(reqs)) == pytest.approx(2.0)
    assert s["completed"] == 3 and s["total_output_tokens"] == 9 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(19.5)
    assert s["mean_ttft_ms"] == pytest.approx((100 + 400 + 200) / 3)
    assert s["median_ttft_ms"] == pytest.approx(200) == pytest.approx(s["p50_ttft_ms"])
    itls = np.array([0.1, 0.1, 0.1, 0.3, 0.3, 0.2]) * 1e3
    assert s["mean_itl_ms"] == pytest.approx(itls.mean())
    assert s["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99))
    assert s["mean_tpot_ms"] == pytest.approx((100 + 100 + 800 / 3) / 3)
    assert s["p95_e2el_ms"] == pytest.approx(np.percentile([300, 500, 1000], 95))
    assert "request_goodput" not in s
    goodput = summarize(reqs, slo=SLO(ttft_ms=250, tpot_ms=300))["request_goodput"]
    assert goodput == pytest.approx(2 / 2.0)  # the second request's TTFT is 400 ms
    with pytest.raises(ValueError):
        summarize([])


@pytest.mark.parametrize("profile", [SHAREGPT, ALPACA])
def test_trace_length_means_match_published_statistics(profile):
    trace = synthetic_trace(20_000, profile.name, seed=0)
    inputs = np.mean([len(r.prompt_token_ids) for r in trace])
    outputs = np.mean([r.max_tokens for r in trace])
    assert inputs == pytest.approx(profile.mean_input, rel=0.03)
    assert outputs == pytest.approx(profile.mean_output, rel=0.03)


def test_trace_is_seeded_and_scaled():
    a = synthetic_trace(50, "sharegpt", request_rate=4.0, scale=0.1, seed=1, vocab_size=100)
    assert a == synthetic_trace(50, "sharegpt", request_rate=4.0, scale=0.1, seed=1, vocab_size=100)
    assert a != synthetic_trace(50, "sharegpt", request_rate=4.0, scale=0.1, seed=2, vocab_size=100)
    assert all(2 <= t < 100 for r in a for t in r.prompt_token_ids)
    capped = synthetic_trace(200, "sharegpt", scale=0.1, max_input_len=20, max_output_len=30)
    assert max(len(r.prompt_token_ids) for r in capped) <= 20 and max(r.max_tokens for r in capped) <= 30
    assert all(r.arrival_time == 0.0 for r in capped)  # infinite rate: everything at once


def test_poisson_arrivals_rate():
    times = poisson_arrivals(20_000, 5.0, np.random.default_rng(0))
    assert np.all(np.diff(times) >= 0)
    assert np.mean(np.diff(times)) == pytest.approx(0.2, rel=0.03)
    assert poisson_arrivals(3, math.inf, np.random.default_rng(0)).tolist() == [0, 0, 0]


def test_shared_system_prompt_fraction():
    trace = synthetic_trace(2000, "alpaca", shared_prefix_len=32, shared_prefix_fraction=0.3, seed=5)
    sharing = [r for r in trace if r.shares_prefix]
    assert len(sharing) / len(trace) == pytest.approx(0.3, abs=0.03)
    prefix = sharing[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix for r in sharing)
    assert sum(r.prompt_token_ids[:32] == prefix for r in trace) == len(sharing)


def test_resident_lengths_one_per_request_step():
    from kvlab.costs.workloads import TraceRequest, resident_lengths

    trace = [TraceRequest(0.0, (5, 6, 7), 4), TraceRequest(0.0, (5,), 1)]
    assert resident_lengths(trace) == [3, 4, 5]  # the one-token request retires in its prefill step


def test_predicted_prefix_hit_tokens_whole_blocks_after_the_first_sharer():
    from kvlab.costs.workloads import TraceRequest, predicted_prefix_hit_tokens

    prefix = tuple(range(2, 12))  # 10 tokens: 2 whole blocks of 4
    trace = [
        TraceRequest(0.0, prefix + (50, 51), 3, True),  # first sharer: nothing cached yet
        TraceRequest(0.0, (60,) * 12, 3, False),
        TraceRequest(0.0, prefix + (52,), 3, True),  # 11 tokens: 2 blocks
        TraceRequest(0.0, prefix[:8], 3, True),  # 8 tokens: the last one is computed, so 1 block
    ]
    assert predicted_prefix_hit_tokens(trace, len(prefix), 4) == 8 + 4
    assert predicted_prefix_hit_tokens(trace, 3, 4) == 0  # shorter than a block


def test_one_draw_serves_every_rate_exactly():
    from kvlab.costs.workloads import Workload, draw_trace

    w = Workload(rate=3.0, num_requests=200, prefix_len=32, prefix_fraction=0.5)
    at = w.traces(1000, max_model_len=4096)
    for rate in (0.5, 3.0, 77.7, None, math.inf):
        assert at(rate) == w.trace(rate, 1000, max_model_len=4096)
    # The open loop's draw takes the exponential gaps first, so a burst's requests are a different draw.
    assert [r.max_tokens for r in at(None)] != [r.max_tokens for r in at(3.0)]
    with pytest.raises(ValueError, match="burst's draw"):
        draw_trace(5, burst=True).at(2.0)
    with pytest.raises(ValueError, match="burst's draw"):
        draw_trace(5, burst=False).at(math.inf)


def test_inter_token_latencies_lay_every_requests_gaps_end_to_end():
    from kvlab.engine.metrics import inter_token_latencies

    reqs = [request(0.0, [0.5, 0.7, 1.0]), request(0.0, [2.0]), request(1.0, [3.0, 3.5])]
    empty = RequestMetrics(arrival_time=0.0)
    for group in (reqs, [empty, *reqs, empty], [empty], reqs[1:2]):
        flat = [gap for r in group for gap in r.itls]
        assert inter_token_latencies(group).tolist() == pytest.approx(flat, abs=0)
