"""kvlab.planning.plan: capacity planning against latency targets (modelled with kvlab.planning.simulate)."""

import random

import pytest

from kvlab.costs import budget, roofline
from kvlab.costs.workloads import Workload, WorkloadError
from kvlab.engine.metrics import RequestMetrics
from kvlab.planning import plan as P
from kvlab.planning import simulate as sim

SMALL = dict(num_requests=40, mean_input=200, mean_output=40)


def test_budget_and_concurrency_come_from_the_one_budget_function():
    p = P.plan(
        "meta-llama/Llama-3.1-8B",
        "H100-SXM",
        context=8192,
        workload=Workload(rate=2.0, **SMALL),
        targets=P.Targets(ttft_ms=500, itl_ms=50),
        dp=1,
    )
    mb = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    assert p.budget == mb
    assert p.max_sequences == mb.max_sequences(8192) == mb.num_blocks // mb.blocks_per_sequence(8192)
    assert p.vllm_max_concurrency == pytest.approx(mb.max_tokens() / 8192)
    assert p.max_sequences <= p.vllm_max_concurrency < p.max_sequences + 1
    text = p.report()
    for term in ("KV pool", "capacity", "weights", "TTFT", "ITL", "E2EL", "goodput", "binds", "modelled"):
        assert term in text
    assert p.meets_targets and p.num_gpus == 1


def test_step_cost_of_one_decode_equals_the_realistic_roofline():
    """Hand check: one sequence decoding at context c costs what roofline.decode_step_time(realistic) says."""
    cost = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM")
    for context in (1, 1024, 8192):
        expected = roofline.decode_step_time(
            "meta-llama/Llama-3.1-8B", "H100-SXM", 1, context, dtype="bf16", realistic=True
        )
        assert cost([1], [context]) == pytest.approx(expected, rel=0.02)


def test_one_request_alone_hand_worked():
    """A 10-token prompt, 5 output tokens, cost 1 ms + 1 ms per token: prefill step 11 ms gives the first token,
    then 4 decode steps of 2 ms: TTFT 11 ms, E2EL 19 ms, every ITL 2 ms."""
    trace = [sim.TraceRequest(0.0, tuple(range(2, 12)), 5)]
    result = sim.simulate(trace, sim.LinearStepCost(1e-3, 1e-3), num_blocks=8, block_size=4)
    (m,) = result.requests
    assert m.ttft == pytest.approx(11e-3)
    assert m.e2e_latency == pytest.approx(19e-3)
    assert m.itls == pytest.approx([2e-3] * 4)


def test_closed_loop_concurrency_keeps_that_many_in_flight():
    trace = [sim.TraceRequest(0.0, (2, 3, 4, 5), 3) for _ in range(6)]
    result = sim.simulate(trace, sim.LinearStepCost(1e-3), num_blocks=64, block_size=4, concurrency=2)
    starts = sorted(m.arrival_time for m in result.requests)
    assert starts[:2] == [0.0, 0.0] and all(t > 0 for t in starts[2:])
    assert result.summary()["mean_running"] <= 2


def test_gpu_search_finds_the_smallest_count():
    kwargs = dict(
        context=4096,
        workload=Workload(rate=60.0, num_requests=60, mean_input=300, mean_output=30),
        targets=P.Targets(ttft_ms=200, percentile=90),
    )
    p = P.plan("Qwen/Qwen2.5-7B", "L4", **kwargs)
    assert p.dp > 1 and p.meets_targets
    assert [d for d, _, _ in p.searched] == list(range(1, p.dp + 1))
    assert not any(met for _, _, met in p.searched[:-1])
    fewer = P.plan("Qwen/Qwen2.5-7B", "L4", dp=p.dp - 1, **kwargs)
    assert not fewer.meets_targets


def test_claim_17_same_memory_share_meets_one_target_and_misses_another():
    """Same model, GPU and gpu_memory_utilization (so the same KV share of memory): the targets hold at a low
    arrival rate and fail at a high one."""
    kw = dict(context=8192, dp=1, targets=P.Targets(ttft_ms=300, itl_ms=40, percentile=90))
    chat = dict(num_requests=120, mean_input=1000, mean_output=20)
    low = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", workload=Workload(rate=1.0, **chat), **kw)
    high = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", workload=Workload(rate=200.0, **chat), **kw)
    assert low.budget == high.budget
    assert low.meets_targets and not high.meets_targets


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: P.plan(
                "meta-llama/Llama-3.1-70B",
                "H100-SXM",
                workload=Workload(rate=1.0),
                targets=P.Targets(ttft_ms=500),
            ),
            "does not fit one H100-SXM at tp=1",
        ),
        (
            lambda: P.plan(
                "meta-llama/Llama-3.1-8B",
                "H100-SXM",
                workload=Workload(rate=1.0, **SMALL),
                targets=P.Targets(itl_ms=1),
            ),
            "no GPU count meets the targets",
        ),
        (lambda: Workload(rate=1.0, num_requests=0), "num_requests must be an integer >= 1"),
        (lambda: Workload(rate=-1.0), "rate must be a positive number"),
        (lambda: Workload(rate=1.0, concurrency=4), "exactly one"),
        (lambda: Workload(rate=1.0, mean_input=0), "at least|>= 1"),
        (lambda: P.Targets(ttft_ms=-5), "positive"),
        (lambda: P.Targets(percentile=0), "percentile"),
    ],
    ids=[
        "no-fit",
        "unreachable",
        "empty",
        "negative-rate",
        "rate-and-concurrency",
        "zero-length",
        "neg-target",
        "bad-percentile",
    ],
)
def test_bad_input_says_why(call, message):
    # A plan's own errors are PlanErrors, a workload's WorkloadErrors: both one-line ValueErrors.
    with pytest.raises((P.PlanError, WorkloadError), match=message):
        call()


def test_a_context_too_short_for_the_prefix_is_a_plan_error():
    with pytest.raises(P.PlanError, match="context 256 leaves no room for output after a 200-token prefix"):
        P.plan(
            "meta-llama/Llama-3.1-8B",
            "H100-SXM",
            context=256,
            workload=Workload(rate=1.0, prefix_fraction=1.0, prefix_len=200, **SMALL),
            targets=P.Targets(ttft_ms=500),
            dp=1,
        )


def test_no_count_up_to_the_limit():
    with pytest.raises(P.PlanError, match="no GPU count up to 2"):
        P.plan(
            "Qwen/Qwen2.5-7B",
            "L4",
            context=4096,
            workload=Workload(rate=200.0, num_requests=60, mean_input=300, mean_output=30),
            targets=P.Targets(ttft_ms=200, percentile=90),
            max_gpus=2,
        )


def test_tp_link_time_hand_worked():
    """Llama-3.1-8B (32 layers, hidden 4096, bf16) at tp=2 on H100 SXM (NVLink 900 GB/s total, 450 GB/s each
    way): per token, two all-reduces per layer of 4096 × 2 bytes = 524,288 bytes enter; a 2-rank ring sends
    2 × (1/2) of that, 524,288 bytes, in 1.165 µs. Plus 64 all-reduce latencies."""
    cost = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM", tp=2, allreduce_latency_s=10e-6)
    per_token = 524_288 / 450e9
    assert cost.link_seconds([1] * 8) == pytest.approx(8 * per_token + 64 * 10e-6, rel=1e-9)
    assert cost.link_seconds([100]) == pytest.approx(100 * per_token + 64 * 10e-6, rel=1e-9)
    one = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM")
    assert one.link_seconds([1] * 8) == 0.0  # one GPU: no link
    # tp=2 halves each GPU's bytes: the decode step's memory term is about half of tp=1's.
    assert cost.parts([1], [1024])[1] == pytest.approx(one.parts([1], [1024])[1] / 2, rel=0.05)
    assert cost([1], [1024]) == pytest.approx(
        max(cost.parts([1], [1024])) + cost.link_seconds([1]) + roofline.REALISM.step_overhead_s
    )


def test_pp_step_passes_every_stage_and_hands_off_activations():
    """pp=2: a step is 2 stages of half the layers (about the whole model's bytes at one GPU's bandwidth) plus
    one hand-off of 4096 × 2 bytes per token over the link."""
    one = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM")
    two = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM", pp=2)
    assert two.link_seconds([1] * 4) == pytest.approx(4 * 4096 * 2 / 450e9, rel=1e-9)
    for batch, context in ((1, 1024), (32, 4096)):
        pp_memory, tp1_memory = (
            two.parts([1] * batch, [context] * batch)[1],
            one.parts([1] * batch, [context] * batch)[1],
        )
        assert tp1_memory <= pp_memory <= 1.15 * tp1_memory  # the largest stage counted twice


def test_pp_plan_splits_the_pool_and_counts_its_gpus():
    kw = dict(context=8192, workload=Workload(rate=2.0, **SMALL), targets=P.Targets(ttft_ms=2000, itl_ms=200))
    p = P.plan("meta-llama/Llama-3.1-70B", "H100-SXM", settings=budget.BudgetSettings(tp=2, pp=2), dp=1, **kw)
    assert (p.num_gpus, p.engines) == (4, 2)
    mb = budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=2, pp=2)
    assert p.budget == mb
    assert "tp=2, pp=2" in p.report() and "links" in p.report() and p.link_ms > 0
    with pytest.raises(P.PlanError, match="pipeline-parallel size 33 exceeds"):
        P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", settings=budget.BudgetSettings(pp=33), dp=1, **kw)
    with pytest.raises(P.PlanError, match="does not divide"):
        P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", settings=budget.BudgetSettings(tp=3), dp=1, **kw)


def test_cli_plan_with_tp_and_pp(capsys):
    from kvlab import cli

    argv = ["plan", "meta-llama/Llama-3.1-70B", "--gpu", "H100-SXM", "--context", "8k", "--ttft", "2s"]
    argv += ["--rate", "2/s", "--requests", "30", "--input-len", "200", "--output-len", "40"]
    assert cli.main([*argv, "--tp", "2", "--pp", "2", "--dp", "1", "--allreduce-latency", "20us"]) == 0
    out = capsys.readouterr().out
    assert "4 × H100-SXM (tp=2, pp=2, dp=1)" in out and "links" in out
    assert (
        cli.main(["plan", "meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--rate", "1/s", "--pp", "33"]) == 2
    )
    assert "pipeline-parallel size 33 exceeds" in capsys.readouterr().err.strip().splitlines()[-1]


def _request(ttft: float, e2el: float) -> RequestMetrics:
    m = RequestMetrics(arrival_time=0.0)
    m.first_token_time, m.finish_time, m.token_times = ttft, e2el, [ttft, e2el]
    return m


def test_a_run_refuted_early_has_the_full_runs_verdict():
    """`Targets.refuted_by` fires on a prefix only where `met` on the whole run is False, and after the whole
    run exactly where it is: a stopped run never changes a verdict."""
    targets = P.Targets(ttft_ms=100, percentile=90)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        runs = [_request(rng.choice([0.05, 0.2]), 0.3) for _ in range(n)]
        refuted = targets.refuted_by(n)
        fired = [refuted(m) for m in runs]
        met = targets.met(runs)
        assert fired[-1] == (not met)
        assert not any(fired) or not met


def test_goodput_is_the_same_with_and_without_early_stops(monkeypatch):
    # Long prompts and a tight TTFT: the bisection's upper rates miss, and their runs stop early.
    args = dict(
        context=8192,
        workload=Workload(rate=2.0, num_requests=100, mean_input=2000, mean_output=40),
        targets=P.Targets(ttft_ms=200, itl_ms=30),
        dp=1,
    )
    stops: list[bool] = []
    simulate = P.simulate

    def counting(*a, **kw):
        result = simulate(*a, **kw)
        stops.append(result.stopped)
        return result

    monkeypatch.setattr(P, "simulate", counting)
    early = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", **args)
    assert any(stops), "no bisection run was stopped early: the test does not exercise the stop"
    monkeypatch.setattr(P.Targets, "refuted_by", lambda self, n: lambda m: False)
    full = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", **args)
    assert early.goodput_rps == full.goodput_rps
    # A stop that fires at once would refute every rate: the comparison above catches a wrong stop.
    monkeypatch.setattr(P.Targets, "refuted_by", lambda self, n: lambda m: True)
    wrong = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", **args)
    assert wrong.goodput_rps != full.goodput_rps


def test_attention_pairs_summed_in_integers_equal_the_triangle_formula():
    # parts() sums n * (c - (n - 1) / 2) in integers (one sum over contexts when every n is 1); the values must
    # be those of the float formula exactly, or a plan's step times would drift in the last bits.
    cost = P.RooflineStepCost("meta-llama/Llama-3.1-8B", "H100-SXM")
    rng = random.Random(0)
    for decode_only in (True, False):
        for _ in range(50):
            seqs = rng.randint(1, 300)
            new = [1 if decode_only else rng.choice([1, 1, 7, 512]) for _ in range(seqs)]
            ctx = [n + rng.randint(0, 100_000) for n in new]
            pairs = sum(n * (c - (n - 1) / 2) for n, c in zip(new, ctx, strict=True))
            flops = (
                cost.body_flops * sum(new)
                + cost.head_flops * len(new) / cost.pp
                + cost.attn_flops_per_ctx * pairs
            )
            moved = cost.weight_bytes + cost.kv_per_token * sum(ctx)
            assert cost.parts(new, ctx) == (cost.pp * flops / cost.flops, cost.pp * moved / cost.bandwidth)


def test_a_burst_of_a_prefix_widens_a_bracket_that_proves_too_low(monkeypatch):
    args = dict(
        context=8192,
        workload=Workload(rate=2.0, num_requests=100, mean_input=2000, mean_output=40),
        targets=P.Targets(ttft_ms=200, itl_ms=30),
        dp=1,
    )
    full = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", **args)
    bursts: list[float] = []
    simulate = P.simulate

    def noting(trace, *a, **kw):
        result = simulate(trace, *a, **kw)
        if len(trace) == 2 and all(r.arrival_time == 0 for r in trace):
            bursts.append(result.summary()["request_throughput"])
        return result

    monkeypatch.setattr(P, "simulate", noting)
    monkeypatch.setattr(P, "BURST_REQUESTS", 2)
    short = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", **args)
    # Two requests at once say little of the GPU's throughput: the bracket they give is far too low ...
    assert len(bursts) == 1 and 2 * bursts[0] < 0.8 * full.goodput_rps
    # ... and doubling it finds the goodput the whole burst's bracket finds, to the bisection's resolution.
    assert short.goodput_rps == pytest.approx(full.goodput_rps, rel=0.1)


def test_a_goodput_whose_search_top_still_passes_is_reported_as_a_lower_bound():
    """Chapter 14's plan: on 150 requests the bracket's top (twice the burst throughput) still meets the targets,
    so the goodput is the top of the search, not the highest passing rate; the report says so."""
    targets = P.Targets(ttft_ms=500, itl_ms=50, percentile=99)
    workload = Workload(rate=4.0, num_requests=150, seed=0, mean_input=161.31, mean_output=337.99)
    p = P.plan("meta-llama/Llama-3.1-8B", "H100-SXM", context=8192, workload=workload, targets=targets)
    assert p.goodput_is_lower_bound
    assert f"goodput      >= {p.goodput_rps:.2f} req/s" in p.report() and "a lower bound" in p.report()


def test_highest_passing_says_whether_it_found_the_edge():
    assert P._highest_passing(lambda rate: rate <= 5.0, 1.0, 8.0, steps=12)[1] is False
    assert P._highest_passing(lambda rate: True, 1.0, 8.0, may_widen=False) == (8.0, True)
