"""kvlab.planning.diagnose: hand-worked workloads, each lever of the book's order, and every error path."""

import dataclasses
import math

import pytest

from kvlab.costs import budget, roofline
from kvlab.costs.workloads import Workload, WorkloadError
from kvlab.planning import diagnose as D
from kvlab.planning.diagnose import as_dict, concurrency, deployment_from_dict, diagnose, load_deployment

LLAMA = "meta-llama/Llama-3.1-8B"


def Deployment(model, gpu, mean_input, mean_output, **fields):
    """A deployment from the flat fields of a workload file."""
    return deployment_from_dict(
        dict(model=model, gpu=gpu, mean_input=mean_input, mean_output=mean_output) | fields
    )


def first(d):
    lever = diagnose(d).first
    return None if lever is None else lever.step


def test_a_paged_engine_reserves_nothing_for_max_model_len():
    """vLLM and SGLang allocate blocks as tokens arrive: at the model's 131,072 tokens on an H100 the pool passes
    the start-up check, so lowering max_model_len admits no more requests and lever 1 does not apply."""
    d = diagnose(Deployment(LLAMA, "H100-SXM", 160, 340, concurrency=48))
    lever = d.levers[0]
    assert not lever.applies and d.first is None
    assert lever.numbers["worst_case"] == budget.memory_budget(LLAMA, "H100-SXM").max_tokens() // 131072 >= 1
    assert "reserves nothing per request" in lever.why and "start-up check (passes)" in lever.why


def test_a_pool_below_max_model_len_stops_a_paged_engine_at_start_up():
    """vLLM refuses to start when one max_model_len request does not fit the pool (_check_enough_kv_cache_memory in
    vllm/v1/core/kv_cache_planning.py, 0.33.0): on an L4 the 8B model's pool is far below 131,072 tokens."""
    d = diagnose(Deployment(LLAMA, "L4", 160, 340, concurrency=8))
    lever = d.first
    pool = budget.memory_budget(LLAMA, "L4").max_tokens()
    assert lever is not None and lever.step == 1 and lever.numbers["pool"] == pool < 131072
    assert lever.numbers["needed"] == 2000 <= pool
    assert "--max-model-len 2000" == lever.vllm and "--context-length 2000" == lever.sglang
    # With max_model_len set to what is served, the engine starts and lever 1 is gone.
    assert (
        not diagnose(Deployment(LLAMA, "L4", 160, 340, concurrency=8, max_model_len=2048)).levers[0].applies
    )
    # A longest request above the pool is a long-context problem (lever 8), not a setting.
    long = diagnose(Deployment(LLAMA, "L4", 160, 340, concurrency=1, max_input=pool, max_output=400))
    assert not long.levers[0].applies and "see lever 8" in long.levers[0].why


def test_contiguous_reservations_of_the_models_max_len_start_with_context_statistics():
    w = Deployment(LLAMA, "H100-SXM", 160, 340, concurrency=48, paged=False)
    d = diagnose(w)
    pool = budget.memory_budget(LLAMA, "H100-SXM").max_tokens()
    lever = d.first
    assert lever is not None and lever.step == 1
    # Reserving max_model_len (131,072 for Llama-3.1) per request admits 3; the measured lengths admit 820.
    assert lever.numbers["worst_case"] == pool // 131072 < 48
    assert lever.numbers["typical"] == pool // 500
    assert "--max-model-len 2000" == lever.vllm and "--context-length 2000" == lever.sglang


def test_same_chat_with_max_model_len_set_needs_nothing():
    assert first(Deployment(LLAMA, "H100-SXM", 160, 340, concurrency=48, max_model_len=4096)) is None
    assert (
        first(Deployment(LLAMA, "H100-SXM", 160, 340, concurrency=48, max_model_len=4096, paged=False))
        is None
    )


def test_mha_model_over_its_pool_fires_active_tokens_then_attention_and_precision():
    w = Deployment("meta-llama/Llama-2-7b-hf", "A100-80GB", 2000, 500, concurrency=64, max_model_len=4096)
    d = diagnose(w)
    pool = budget.memory_budget(w.model, w.gpu).max_tokens()
    resident = 64 * (2000 + 250)
    assert resident > pool
    applying = [lever.step for lever in d.levers if lever.applies]
    # Eviction applies too, but last: it costs accuracy, the others do not
    assert applying == [2, 3, 4, 10]
    assert d.first is not None and d.first.step == 2
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
    lever = diagnose(deployment_from_dict(rag)).first
    assert lever is not None and lever.step == 5
    assert lever.numbers["share"] == pytest.approx(0.9 * 2000 / 3000)
    assert lever.vllm == "--enable-prefix-caching" and "--schedule-policy lpm" in lever.sglang
    assert first(deployment_from_dict(rag | {"prefix_caching": True})) is None


def test_contiguous_reservations_fire_paging():
    w = Deployment(
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
    assert first(deployment_from_dict(as_dict(w) | {"paged": True})) is None  # the same load, paged, fits


def test_max_num_seqs_below_the_load_fires_batching():
    w = Deployment(LLAMA, "H100-SXM", 20, 60, concurrency=400, max_model_len=1024, max_num_seqs=128)
    lever = diagnose(w).first
    assert lever is not None and lever.step == 7
    assert lever.vllm.startswith("--max-num-seqs 400")


def test_agentic_long_context_fires_true_capacity():
    w = Deployment(
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
    d = diagnose(Deployment("meta-llama/Llama-3.1-70B", "H100-SXM", 500, 300, concurrency=16))
    # vLLM 0.34's expected pool: at TP=2 the 65.7 GiB of weights per GPU leave blocks; one GPU holds none.
    assert d.first is not None and d.first.step == 9 and d.first.numbers["tp_fit"] == 2
    assert [lever.step for lever in d.levers if lever.applies] == [9]
    assert budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=2).fits
    assert not budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=1).fits
    # the floor, every estimate at its bound (0.33's old figure), still needs 4
    floor = budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=2, vllm_version="0.33").floor
    assert floor is not None and not floor.fits


def test_rate_becomes_requests_in_flight_by_littles_law():
    w = Deployment(LLAMA, "H100-SXM", 160, 340, rate=10.0)
    c = concurrency(w)
    step = roofline.decode_step_time(LLAMA, "H100-SXM", math.ceil(c), 330, "bf16", "bf16", realistic=True)
    prefill = roofline.prefill_time(LLAMA, "H100-SXM", 1, 160, "bf16", "bf16", realistic=True)
    assert c == pytest.approx(10.0 * (prefill + 340 * step), rel=1e-3)


def test_report_names_the_first_lever_and_both_engines():
    text = diagnose(Deployment(LLAMA, "L4", 160, 340, concurrency=8)).report()
    assert "start with: 1. context and output statistics" in text
    assert "docs.vllm.ai" in text and "docs.sglang.io" in text
    # Every lever's mark starts in one column, lever 10's too
    marks = [
        line.index(" APPLIES ") if " APPLIES " in line else line.index(" ok ")
        for line in text.splitlines()
        if line[:3].strip().rstrip(".").isdigit()
    ]
    assert len(marks) == 10 and len(set(marks)) == 1


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
        deployment_from_dict(data)
    assert "\n" not in str(err.value)


def test_dict_errors():
    with pytest.raises(WorkloadError, match="empty"):
        deployment_from_dict({})
    with pytest.raises(WorkloadError, match="unknown field 'colour'"):
        deployment_from_dict(
            dict(model=LLAMA, gpu="H100-SXM", mean_input=1, mean_output=1, concurrency=1, colour=1)
        )
    with pytest.raises(WorkloadError, match="missing gpu"):
        deployment_from_dict(dict(model=LLAMA, mean_input=1, mean_output=1, concurrency=1))


def test_files(tmp_path):
    good = "model: meta-llama/Llama-3.1-8B\ngpu: H100-SXM\nmean-input: 160\nmean_output: 340\nconcurrency: 48\nmax_model_len: 4k\n"
    (tmp_path / "w.yaml").write_text(good)
    assert load_deployment(tmp_path / "w.yaml").max_model_len == 4096
    (tmp_path / "w.toml").write_text(
        'model = "meta-llama/Llama-3.1-8B"\ngpu = "H100-SXM"\nmean_input = 160\nmean_output = 340\nrate = 2.5\n'
    )
    assert load_deployment(tmp_path / "w.toml").workload.rate == 2.5
    with pytest.raises(WorkloadError, match="no workload file"):
        load_deployment(tmp_path / "missing.yaml")
    (tmp_path / "w.txt").write_text(good)
    with pytest.raises(WorkloadError, match="expected a .yaml"):
        load_deployment(tmp_path / "w.txt")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_deployment(tmp_path / "bad.json")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(WorkloadError, match="empty"):
        load_deployment(tmp_path / "empty.yaml")


def test_resident_tokens_weight_requests_by_their_output_length():
    w = Workload(100, 50, concurrency=1)
    assert w.mean_resident == 100 + (50 - 1) / 2  # p, p + 1, ..., p + n - 2 over n - 1 steps
    # Outputs of 25 and 75 tokens (mean 50, cv 0.5): the long one holds its slot three times as many steps.
    steps = [100 + k for n in (25, 75) for k in range(n - 1)]
    by_hand = sum(steps) / len(steps)
    spread = Workload(100, 50, concurrency=1, output_cv=0.5)
    assert spread.mean_resident == pytest.approx(by_hand, rel=0.02)
    with pytest.raises(WorkloadError, match="output_cv"):
        Workload(100, 50, concurrency=1, output_cv=-1)


# --- each lever on its own: one function of a Situation, checked on a hand-set load --------------------------------


def situation(in_flight, **fields):
    """The situation of a Llama-3.1-8B deployment on an H100 (pool: 476,672 tokens, vLLM 0.34) at a chosen load."""
    d = Deployment(LLAMA, "H100-SXM", fields.pop("mean_input", 160), fields.pop("mean_output", 340), **fields)
    s = D.situation(d)
    return dataclasses.replace(s, in_flight=float(in_flight))


POOL = budget.memory_budget(LLAMA, "H100-SXM").max_tokens()


def test_the_levers_are_the_books_ten_steps_in_order():
    s = situation(8, concurrency=8)
    assert [lever(s).step for lever in D.LEVERS] == list(range(1, 11))
    assert POOL == 476_672


def test_context_statistics_fires_between_the_worst_case_and_the_typical_bound():
    # Contiguous reservations of 476,672 tokens: 3 requests of 131,072 (the worst case), 953 of 500 (typical).
    assert D.context_statistics(situation(48, concurrency=48, paged=False)).applies
    assert not D.context_statistics(
        situation(2, concurrency=2, paged=False)
    ).applies  # the worst case covers 2
    assert not D.context_statistics(
        situation(1000, concurrency=1000, paged=False)
    ).applies  # past the lengths
    # Paged, no load makes the same max_model_len a lever: the pool passes the start-up check.
    assert not any(D.context_statistics(situation(n, concurrency=n)).applies for n in (2, 48, 900))


def test_active_tokens_fire_when_the_resident_tokens_exceed_the_pool():
    resident_per_request = 160 + (340 - 1) / 2
    below, above = POOL // resident_per_request, POOL // resident_per_request + 1
    assert not D.active_tokens(situation(below, concurrency=8)).applies
    lever = D.active_tokens(situation(above, concurrency=8))
    assert lever.applies and lever.numbers["fits_seqs"] == POOL // math.ceil(resident_per_request)


def test_attention_type_fires_only_for_mha_over_its_pool():
    gqa = D.attention_type(situation(10_000, concurrency=8))
    assert not gqa.applies and gqa.why.startswith("GQA with 8 KV head(s)")
    d = Deployment("meta-llama/Llama-2-7b-hf", "H100-SXM", 160, 340, concurrency=8)
    mha = D.attention_type(dataclasses.replace(D.situation(d), in_flight=10_000.0))
    assert mha.applies and mha.numbers["per_token"] == 4 * mha.numbers["gqa_per_token"]


def test_kv_precision_fires_for_a_wide_cache_over_its_pool():
    lever = D.kv_precision(situation(10_000, concurrency=8))
    assert lever.applies and lever.numbers["fp8_pool"] > POOL
    assert not D.kv_precision(situation(10_000, concurrency=8, kv_dtype="fp8")).applies


def test_prefix_reuse_fires_from_a_quarter_of_the_prompt_shared():
    assert D.prefix_reuse(situation(8, concurrency=8, prefix_fraction=0.5, prefix_len=80)).applies
    assert not D.prefix_reuse(situation(8, concurrency=8, prefix_fraction=0.5, prefix_len=79)).applies
    on = D.prefix_reuse(situation(8, concurrency=8, prefix_fraction=1.0, prefix_len=160, prefix_caching=True))
    assert not on.applies and on.why == "prefix caching is on"


def test_paging_fires_for_big_blocks_on_short_requests_that_fill_the_pool():
    short = dict(mean_input=10, mean_output=10, concurrency=8, block_size=128)
    lever = D.paging(situation(30_000, **short))
    assert lever.applies and lever.numbers["fragmentation"] == pytest.approx(127 / 2 / 14.5)
    assert not D.paging(situation(100, **short)).applies  # the waste does not bind


def test_batching_fires_when_max_num_seqs_caps_a_load_the_pool_holds():
    s = situation(400, concurrency=8, max_num_seqs=128)
    lever = D.batching(s)
    # 128 sampled rows leave a little more room than vLLM's 256: the pool is the deployment's own.
    assert lever.applies and lever.numbers == {"room": s.pool // 330, "cap": 128} and s.pool > POOL
    assert not D.batching(situation(100, concurrency=8, max_num_seqs=128)).applies


def test_long_context_fires_from_a_quarter_of_the_pool_for_one_request():
    assert D.long_context(situation(1, concurrency=1, max_input=100_000, max_output=20_000)).applies
    assert not D.long_context(situation(1, concurrency=1)).applies  # 4 × 500 tokens


def test_topology_fires_only_when_no_block_fits_and_names_the_smallest_tp():
    assert not D.topology(situation(8, concurrency=8)).applies
    d = Deployment("meta-llama/Llama-3.1-70B", "H100-SXM", 160, 340, concurrency=8)
    lever = D.topology(D.situation(d))
    # One H100 at TP=1 holds 131 GiB of weights in 79.6: no block. At TP=2 (vLLM 0.34's measured rule, central
    # terms): 65.7 GiB of weights, 1.5 GiB outside PyTorch, the graphs, a transient peak and its margin leave
    # blocks, so 2 is the smallest TP that holds one.
    assert lever.applies and lever.numbers["tp_fit"] == 2


def test_token_eviction_prices_half_the_tokens_where_the_cache_binds():
    # Llama-3.1-8B on an H100: requests of 160 + 340 tokens hold 330 on average (mean_resident), 410,064 in the pool
    over = D.token_eviction(situation(2000, concurrency=2000))
    assert over.applies and over.step == 10
    assert over.numbers["fits"] == POOL // 330
    assert over.numbers["fits_kept"] == POOL // 165
    assert "vllm-project/vllm/issues/5751" in over.vllm and "sglang/issues/12607" in over.sglang
    assert f"{POOL // 165:,} mean requests instead of {POOL // 330:,}" in over.why
    assert not D.token_eviction(situation(8, concurrency=8)).applies


def test_token_eviction_applies_to_one_long_request_that_fills_the_pool():
    long = situation(1, concurrency=1, max_input=120_000, max_output=4000)
    assert D.long_context(long).applies and D.token_eviction(long).applies


def test_token_eviction_does_not_apply_to_a_model_whose_cache_is_bounded():
    d = Deployment("mistralai/Mistral-7B-v0.1", "A100-80GB", 4000, 300, concurrency=200)
    lever = diagnose(d).levers[-1]
    assert D.situation(d).resident > D.situation(d).pool
    assert not lever.applies
    assert lever.why == "does not apply: the model has sliding layers, whose cache is already bounded"


def test_a_higher_utilisation_is_offered_only_below_1():
    """vLLM 0.34 already uses the whole GPU (gpu_memory_utilization 1.0): lever 2 offers no higher share there,
    while under 0.33's default of 0.92 it does."""
    spec = dict(
        model="meta-llama/Llama-2-7b-hf",
        gpu="A100-80GB",
        mean_input=2000,
        mean_output=500,
        concurrency=64,
        max_model_len=4096,
    )
    now = diagnose(deployment_from_dict(spec)).levers[1]
    before = diagnose(deployment_from_dict(spec | {"vllm_version": "0.33.0"})).levers[1]
    assert now.applies and before.applies
    assert "--gpu-memory-utilization" not in now.vllm
    assert before.vllm.endswith("(or a higher --gpu-memory-utilization)")
