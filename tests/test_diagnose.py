"""kvlab.diagnose: hand-worked workloads, each lever of the book's order, and every error path."""

import math

import pytest

from kvlab import budget, roofline
from kvlab.diagnose import (
    Workload,
    WorkloadError,
    concurrency,
    diagnose,
    load_workload,
    workload_from_dict,
)

LLAMA = "meta-llama/Llama-3.1-8B"


def first(w):
    lever = diagnose(w).first
    return None if lever is None else lever.step


def test_chat_with_the_models_max_len_starts_with_context_statistics():
    w = Workload(LLAMA, "H100-SXM", 160, 340, concurrency=48)
    d = diagnose(w)
    pool = budget.memory_budget(LLAMA, "H100-SXM").max_tokens()
    lever = d.first
    assert lever is not None and lever.step == 1
    # vLLM's startup bound reserves max_model_len (131,072 for Llama-3.1) per request; measured lengths don't.
    assert lever.numbers["worst_case"] == pool // 131072 < 48
    assert lever.numbers["typical"] == pool // 500
    assert "--max-model-len 2000" == lever.vllm and "--context-length 2000" == lever.sglang


def test_same_chat_with_max_model_len_set_needs_nothing():
    assert first(Workload(LLAMA, "H100-SXM", 160, 340, concurrency=48, max_model_len=4096)) is None


def test_mha_model_over_its_pool_fires_active_tokens_then_attention_and_precision():
    w = Workload("meta-llama/Llama-2-7b-hf", "A100-80GB", 2000, 500, concurrency=64, max_model_len=4096)
    d = diagnose(w)
    pool = budget.memory_budget(w.model, w.gpu).max_tokens()
    resident = 64 * (2000 + 250)
    assert resident > pool
    applying = [lever.step for lever in d.levers if lever.applies]
    assert applying == [2, 3, 4]
    assert d.levers[1].numbers["fits_seqs"] == pool // 2250
    assert d.levers[2].numbers["per_token"] == 4 * d.levers[2].numbers["gqa_per_token"]  # 32 -> 8 KV heads
    assert (
        d.levers[3].numbers["fp8_pool"] == budget.memory_budget(w.model, w.gpu, kv_dtype="fp8").max_tokens()
    )


def test_shared_system_prompt_fires_prefix_reuse_until_caching_is_on():
    rag = dict(
        model=LLAMA,
        gpu="H100-SXM",
        mean_input=3000,
        mean_output=300,
        concurrency=64,
        max_model_len=8192,
        max_input=6000,
        max_output=1000,
        prefix_fraction=0.9,
        prefix_len=2000,
    )
    lever = diagnose(Workload(**rag)).first
    assert lever is not None and lever.step == 5
    assert lever.numbers["share"] == pytest.approx(0.9 * 2000 / 3000)
    assert lever.vllm == "--enable-prefix-caching" and "--schedule-policy lpm" in lever.sglang
    assert first(Workload(**rag, prefix_caching=True)) is None


def test_contiguous_reservations_fire_paging():
    w = Workload(
        LLAMA,
        "H100-SXM",
        200,
        200,
        concurrency=300,
        max_model_len=2048,
        max_input=1500,
        max_output=600,
        max_num_seqs=512,
        paged=False,
    )
    lever = diagnose(w).first
    assert lever is not None and lever.step == 6
    assert lever.numbers["fragmentation"] == pytest.approx((2048 - 299.5) / 2048)
    assert first(Workload(**{**w.__dict__, "paged": True})) is None  # the same load, paged, fits


def test_max_num_seqs_below_the_load_fires_batching():
    w = Workload(LLAMA, "H100-SXM", 20, 60, concurrency=400, max_model_len=1024, max_num_seqs=128)
    lever = diagnose(w).first
    assert lever is not None and lever.step == 7
    assert lever.vllm.startswith("--max-num-seqs 400")


def test_agentic_long_context_fires_true_capacity():
    w = Workload(
        LLAMA,
        "H100-SXM",
        100_000,
        2000,
        concurrency=4,
        max_input=120_000,
        max_output=4000,
        prefix_caching=True,
    )
    lever = diagnose(w).first
    assert lever is not None and lever.step == 8
    pool = budget.memory_budget(LLAMA, "H100-SXM").max_tokens()
    assert lever.numbers["longest_share"] == pytest.approx(124_000 / pool)


def test_a_model_that_does_not_fit_goes_to_topology_first():
    d = diagnose(Workload("meta-llama/Llama-3.1-70B", "H100-SXM", 500, 300, concurrency=16))
    assert d.first is not None and d.first.step == 9 and d.first.numbers["tp_fit"] == 2
    assert [lever.step for lever in d.levers if lever.applies] == [9]
    assert budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=2).fits


def test_rate_becomes_requests_in_flight_by_littles_law():
    w = Workload(LLAMA, "H100-SXM", 160, 340, rate=10.0)
    c = concurrency(w)
    step = roofline.decode_step_time(LLAMA, "H100-SXM", math.ceil(c), 330, "bf16", "bf16", realistic=True)
    prefill = roofline.prefill_time(LLAMA, "H100-SXM", 1, 160, "bf16", "bf16", realistic=True)
    assert c == pytest.approx(10.0 * (prefill + 340 * step), rel=1e-3)


def test_report_names_the_first_lever_and_both_engines():
    text = diagnose(Workload(LLAMA, "H100-SXM", 160, 340, concurrency=48)).report()
    assert "start with: 1. context and output statistics" in text
    assert "docs.vllm.ai" in text and "docs.sglang.io" in text


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model": "no/such-model"}, "unknown model"),
        ({"gpu": "Z9000"}, "Z9000"),
        ({"mean_input": -5}, "mean_input"),
        ({"mean_output": 0}, "mean_output"),
        ({"concurrency": 0}, "concurrency"),
        ({"rate": 4.0}, "exactly one"),
        ({"prefix_fraction": 1.5}, "prefix_fraction"),
        ({"kv_dtype": "fp4"}, "kv_dtype"),
        ({"max_input": 10}, "max_input"),
        ({"tp": 3}, "tensor-parallel size 3"),
    ],
)
def test_bad_workloads_are_one_line_errors(changes, message):
    data = dict(model=LLAMA, gpu="H100-SXM", mean_input=100, mean_output=100, concurrency=8) | changes
    with pytest.raises(WorkloadError, match=message) as err:
        workload_from_dict(data)
    assert "\n" not in str(err.value)


def test_dict_errors():
    with pytest.raises(WorkloadError, match="empty"):
        workload_from_dict({})
    with pytest.raises(WorkloadError, match="unknown field 'colour'"):
        workload_from_dict(
            dict(model=LLAMA, gpu="H100-SXM", mean_input=1, mean_output=1, concurrency=1, colour=1)
        )
    with pytest.raises(WorkloadError, match="missing gpu"):
        workload_from_dict(dict(model=LLAMA, mean_input=1, mean_output=1, concurrency=1))


def test_files(tmp_path):
    good = "model: meta-llama/Llama-3.1-8B\ngpu: H100-SXM\nmean-input: 160\nmean_output: 340\nconcurrency: 48\nmax_model_len: 4k\n"
    (tmp_path / "w.yaml").write_text(good)
    assert load_workload(tmp_path / "w.yaml").max_model_len == 4096
    (tmp_path / "w.toml").write_text(
        'model = "meta-llama/Llama-3.1-8B"\ngpu = "H100-SXM"\nmean_input = 160\nmean_output = 340\nrate = 2.5\n'
    )
    assert load_workload(tmp_path / "w.toml").rate == 2.5
    with pytest.raises(WorkloadError, match="no workload file"):
        load_workload(tmp_path / "missing.yaml")
    (tmp_path / "w.txt").write_text(good)
    with pytest.raises(WorkloadError, match="expected a .yaml"):
        load_workload(tmp_path / "w.txt")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(tmp_path / "bad.json")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(WorkloadError, match="empty"):
        load_workload(tmp_path / "empty.yaml")


def test_resident_tokens_weight_requests_by_their_output_length():
    w = Workload(LLAMA, "H100-SXM", 100, 50, concurrency=1)
    assert w.mean_resident == 100 + (50 - 1) / 2  # p, p + 1, ..., p + n - 2 over n - 1 steps
    # Outputs of 25 and 75 tokens (mean 50, cv 0.5): the long one holds its slot three times as many steps.
    steps = [100 + k for n in (25, 75) for k in range(n - 1)]
    by_hand = sum(steps) / len(steps)
    spread = Workload(LLAMA, "H100-SXM", 100, 50, concurrency=1, output_cv=0.5)
    assert spread.mean_resident == pytest.approx(by_hand, rel=0.02)
    with pytest.raises(WorkloadError, match="output_cv"):
        Workload(LLAMA, "H100-SXM", 100, 50, concurrency=1, output_cv=-1)
