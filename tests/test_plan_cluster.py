"""kvlab plan --disagg P:D and --router POLICY: layouts of the same GPUs compared on one trace (modelled)."""

import pytest

from kvlab.cli import main
from kvlab.costs.workloads import Workload
from kvlab.planning import plan

MODEL, GPU = "meta-llama/Llama-3.1-8B", "H100-SXM"
TARGETS = plan.Targets(ttft_ms=2000, itl_ms=50)


def long_prompts(rate: float) -> Workload:
    return Workload(mean_input=4000, mean_output=300, rate=rate, num_requests=150)


def rows(rate: float) -> dict[str, plan.ClusterRow]:
    result = plan.plan_cluster(
        MODEL, GPU, context=8192, workload=long_prompts(rate), targets=TARGETS, disagg=(2, 2)
    )
    return {row.layout: row for row in result.rows}


def test_where_the_split_loses_and_wins():
    """At a light load the split only adds the transfer and a decode step to TTFT. At a heavy one, colocated
    decodes share steps with 4,000-token prefill chunks and their p99 ITL grows; the decode pool's does not."""
    light, heavy = rows(2.0), rows(20.0)
    assert list(light) == ["colocated × 4", "2 prefill : 2 decode"]
    assert (
        light["colocated × 4"].summary["p50_ttft_ms"] < light["2 prefill : 2 decode"].summary["p50_ttft_ms"]
    )
    colocated, split = heavy["colocated × 4"].summary, heavy["2 prefill : 2 decode"].summary
    assert split["p99_itl_ms"] * 3 < colocated["p99_itl_ms"]
    assert all(row.num_gpus == 4 for row in heavy.values())


def test_router_rows():
    workload = Workload(rate=40.0, num_requests=120, prefix_fraction=0.8, prefix_len=2000)
    result = plan.plan_cluster(
        MODEL, GPU, context=8192, workload=workload, targets=TARGETS, router="prefix_affinity", dp=4
    )
    layouts = [row.layout for row in result.rows]
    assert layouts == ["4 replicas, round_robin", "4 replicas, prefix_affinity"]
    assert all(row.summary["prefix_hit_rate"] > 0.5 for row in result.rows)
    assert "prefix hits" in result.report()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disagg", "0:3"], "P:D, prefill and decode GPUs of at least 1"),
        (["--disagg", "1-3"], "P:D"),
        (["--router", "kv_cost"], "--router needs --dp N"),
        (["--disagg", "40:40"], "more than --max-gpus 64"),
        (["--disagg", "1:1", "--tp", "2"], "single-GPU engines"),
        (["--disagg", "1:1", "--kv-link", "carrier pigeon"], "unknown link"),
    ],
)
def test_impossible_layouts_are_one_line(args, message, capsys):
    code = main(["plan", MODEL, "--gpu", GPU, "--rate", "20/s", "--ttft", "500ms", "--requests", "20", *args])
    assert code != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_closed_loop_is_refused():
    with pytest.raises(plan.PlanError, match="open-loop"):
        plan.plan_cluster(
            MODEL, GPU, context=8192, workload=Workload(concurrency=8), targets=TARGETS, disagg=(1, 1)
        )


def test_the_command_line_prints_the_layouts(capsys):
    code = main(
        [
            "plan",
            MODEL,
            "--gpu",
            GPU,
            "--rate",
            "20/s",
            "--ttft",
            "500ms",
            "--requests",
            "60",
            "--dp",
            "2",
            "--disagg",
            "1:1",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "cluster      layouts compared at 20 req/s" in out
    assert "1 prefill : 1 decode" in out and "colocated × 2" in out


def test_cluster_goodput_bisects_to_the_highest_passing_rate():
    """A layout that meets a TTFT target up to 7.3 req/s: the search brackets it from twice the offered rate."""
    from kvlab.engine.metrics import RequestMetrics

    class Run:
        def __init__(self, rate):
            latency = 0.05 if rate <= 7.3 else 0.5
            self.requests = [RequestMetrics(0.0, 10, first_token_time=latency, finish_time=latency)]

    found = plan.cluster_goodput(Run, plan.Targets(ttft_ms=100), offered=5.0, steps=12)
    assert 7.3 - 10 / 2**12 <= found <= 7.3
    # from 1 req/s: 2 and 4 pass, 8 fails, six halvings of [4, 8]
    assert 7.3 - 4 / 2**6 <= plan.cluster_goodput(Run, plan.Targets(ttft_ms=100), offered=1.0) <= 7.3
    # a top that still passes after MAX_WIDENINGS doublings is returned as it is, a lower bound
    assert plan.cluster_goodput(Run, plan.Targets(ttft_ms=100), offered=0.1) == pytest.approx(3.2)
    assert plan.cluster_goodput(Run, plan.Targets(ttft_ms=100), offered=200.0) == 0.0


def test_goodput_in_the_report():
    result = plan.plan_cluster(
        MODEL, GPU, context=8192, workload=long_prompts(5.0), targets=TARGETS, disagg=(2, 2), goodput=True
    )
    assert all(row.goodput_rps is not None and row.goodput_rps > 0 for row in result.rows)
    assert "goodput: DistServe's" in result.report()
