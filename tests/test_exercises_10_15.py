"""The exercise answers of chapters 10-15 and the appendix, recomputed by kvlab now.

Each chapter page folds its answers in ```{dropdown} Answer``` blocks. These tests read the answers from the
page and assert that the numbers kvlab computes today, formatted as the page writes them, appear there, so that
a change to kvlab that moves an answer fails here instead of leaving the page wrong. Offline and fast: registry
configs on the meta device, no forward passes.
"""

from __future__ import annotations

import re

import yaml
from book_pages import BOOK, answers
from transformers import LlamaConfig

from kvlab.costs import budget
from kvlab.experiments import parallel, quant
from kvlab.offload.reload import recompute_vs_reload
from kvlab.planning.diagnose import deployment_from_dict, diagnose
from kvlab.specs import arch, sizing, vllm_defaults
from kvlab.units import format_bytes


def assert_in(answer: str, *numbers: str) -> None:
    for number in numbers:
        assert number in answer, f"the answer should say {number!r}: {answer!r}"


def test_every_chapter_has_two_or_three_answered_exercises() -> None:
    for chapter in (
        "10_weights_not_cache",
        "11_kv_quantization",
        "12_beyond_hbm",
        "13_many_gpus",
        "14_capacity_planning",
        "15_where_to_start",
    ):
        assert 2 <= len(answers(chapter)) <= 3, chapter


def test_ch10_crossover_context_of_qwen_at_batch_8() -> None:
    bf16 = sizing.crossover_context("Qwen/Qwen2.5-7B", 8)
    four_bit = sizing.crossover_context("Qwen/Qwen2.5-7B", 8, weight_dtype=4)
    assert bf16 is not None and four_bit is not None
    assert_in(answers("10_weights_not_cache")[0], f"{bf16:,} tokens", f"{four_bit:,} tokens")


def test_ch10_long_sequences_with_4_bit_weights() -> None:
    bf16 = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", weight_dtype="bf16")
    four_bit = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", weight_dtype=4)
    assert_in(
        answers("10_weights_not_cache")[1],
        f"{bf16.max_sequences(32768)} with bf16",
        f"{four_bit.max_sequences(32768)} with 4-bit",
        format_bytes(bf16.kv_pool_bytes),
        format_bytes(four_bit.kv_pool_bytes),
    )


def test_ch11_requests_on_an_h20_with_an_fp8_cache() -> None:
    bf16 = budget.memory_budget("meta-llama/Llama-3.1-8B", "H20", kv_dtype="bf16")
    fp8 = budget.memory_budget("meta-llama/Llama-3.1-8B", "H20", kv_dtype="fp8")
    assert format_bytes(bf16.kv_pool_bytes) == format_bytes(fp8.kv_pool_bytes), "the pool is the same memory"
    assert_in(
        answers("11_kv_quantization")[0],
        f"{bf16.max_sequences(8192)} with bf16",
        f"{fp8.max_sequences(8192)} with fp8",
        f"same {format_bytes(fp8.kv_pool_bytes)} pool",
        f"rounds {bf16.kv_pool_bytes / (8192 * bf16.kv_bytes_per_token):.1f} sequences down",
    )


def test_ch11_kivi_residual_of_128_stores_the_same() -> None:
    # SmolLM2-135M-Instruct's shape (chapter 10's lab glues it): 30 layers, 3 KV heads of dimension 64.
    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    # the lab's memory section: a 128-token prompt and one decode step, KIVI groups of 32
    tokens = 128 + 1
    stored = {
        r: quant.predicted_stored_bytes("kivi2", config, tokens, residual_length=r, group_size=32)
        for r in (32, 128)
    }
    full = quant.predicted_stored_bytes("none", config, tokens)
    assert stored[32] == stored[128]
    assert_in(
        answers("11_kv_quantization")[1],
        f"same {format_bytes(stored[128])}",
        f"{full / stored[128]:.1f}× less",
    )


def test_ch12_reloading_a_32k_cache_over_pcie_gen4() -> None:
    estimate = recompute_vs_reload(
        "meta-llama/Llama-3.1-8B", "H100-SXM", "PCIe Gen4 x16", 32768, "bf16", "bf16"
    )
    at_8k = recompute_vs_reload("meta-llama/Llama-3.1-8B", "H100-SXM", "PCIe Gen4 x16", 8192, "bf16", "bf16")
    assert estimate.speedup > at_8k.speedup, "the answer says the ratio is higher than at 8k tokens"
    assert_in(
        answers("12_beyond_hbm")[0],
        f"{format_bytes(estimate.kv_bytes)} cache",
        f"{estimate.reload_s * 1e3:.0f} ms",
        f"{estimate.recompute_s * 1e3:.0f} ms",
        f"{estimate.speedup:.1f}× faster",
    )


def test_ch12_fewer_kv_heads_stream_fewer_bytes() -> None:
    # the lab's parameters: 4 layers, hidden 256, 8 query heads, fp32 on a CPU
    def per_layer(kv_heads: int) -> str:
        config = LlamaConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=kv_heads,
            vocab_size=256,
        )
        return format_bytes(sizing.kv_bytes_per_token(config, "fp32") // 4)

    assert_in(answers("12_beyond_hbm")[1], f"from {per_layer(8)} to {per_layer(2)}")


PLANS = {
    "TP=8": (8, 1, 1),
    "PP=8": (1, 8, 1),
    "TP=4 × PP=2": (4, 2, 1),
    "TP=2 × DP=4": (2, 1, 4),
    "DP=8": (1, 1, 8),
}


def test_ch13_plan_table_is_what_kvlab_computes() -> None:
    # chapter 13's lab parameters: Llama-3.1-70B, 32 sequences of 32,768 tokens, bf16, H100-SXM
    model, context, batch = "meta-llama/Llama-3.1-70B", 32768, 32
    page = (BOOK / "13_many_gpus" / "index.md").read_text()
    rows = {}
    for label, (tp, pp, dp) in PLANS.items():
        where = parallel.placement(model, context, batch, tp=tp, pp=pp, dp=dp)
        mem = budget.memory_budget(model, "H100-SXM", tp=tp, pp=pp)
        fits = mem.fits and mem.max_sequences(context) >= where.sequences_per_replica
        held = mem.max_sequences(context) * dp if mem.fits else 0
        rows[label] = (
            f"| {label} | {format_bytes(where.weight_bytes)} | {format_bytes(where.kv_bytes)} | "
            f"{where.sequences_per_replica} | {held} | {'yes' if fits else 'no'} |"
        )
        assert rows[label] in page, f"chapter 13's table row should read {rows[label]}"


def test_ch13_kv_heads_are_copied_past_their_count() -> None:
    per_gpu = {
        t: format_bytes(sizing.kv_bytes_per_token("meta-llama/Llama-3.1-70B", "bf16", tp=t))
        for t in (1, 8, 16)
    }
    assert per_gpu[8] == per_gpu[16]
    assert_in(
        answers("13_many_gpus")[0],
        f"{per_gpu[8]} at TP=8 and still {per_gpu[16]} at TP=16",
        f"from {per_gpu[1]}",
    )


def test_ch13_tp8_holds_fewer_than_64_long_sequences() -> None:
    held = budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=8).max_sequences(32768)
    assert held < 64
    assert_in(answers("13_many_gpus")[1], f"holds {held} sequences of 32,768 tokens", f"at most {held}")


GLOSSARY = {
    "Prefill": "预填充",
    "Decode": "解码",
    "Active tokens": "活跃 token",
    "GQA": "分组查询注意力",
    "MQA": "多查询注意力",
    "KV pool": "KV 缓存池",
    "`gpu_memory_utilization`": "显存利用率",
    "Preemption": "抢占",
    "Chunked prefill": "分块预填充",
}


def test_glossary_has_the_serving_terms_with_their_chinese_names() -> None:
    page = (BOOK / "appendix_cheat_sheet" / "index.md").read_text()
    for term, chinese in GLOSSARY.items():
        assert re.search(rf"^\*\*{re.escape(term)}\*\* \([^)]*{chinese}\)$", page, re.M), term


def test_glossary_max_num_seqs_names_the_h100_default() -> None:
    page = (BOOK / "appendix_cheat_sheet" / "index.md").read_text()
    entry = page[page.index("**`max_num_seqs`**") :].split("\n\n")[0]
    assert f"{vllm_defaults.BIG.max_num_seqs['serve']:,} for `vllm serve` on an H100" in entry


def test_deepseek_v3_caches_a_576_wide_latent() -> None:
    shape = sizing.cached_shapes("deepseek-ai/DeepSeek-V3")
    assert shape == "latent 512 + rope 64"
    layers = arch.describe("deepseek-ai/DeepSeek-V3").num_layers
    assert sizing.kv_bytes_per_token("deepseek-ai/DeepSeek-V3", "bf16") == layers * (512 + 64) * 2
    assert "512 + 64 = 576" in (BOOK / "appendix_cheat_sheet" / "index.md").read_text()


def test_toc_puts_chapters_14_and_15_in_planning_a_deployment() -> None:
    toc = yaml.safe_load((BOOK.parent / "_toc.yml").read_text())
    part = next(p for p in toc["parts"] if p["caption"] == "Planning a deployment")
    assert [c["file"] for c in part["chapters"]] == [
        "book/14_capacity_planning/index",
        "book/15_where_to_start/index",
    ]


def test_ch14_budget_table_term_by_term() -> None:
    plan = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    page = (BOOK / "14_capacity_planning" / "index.md").read_text()
    # vLLM 0.34's measured rule: no engine cap; a margin and the transient peak are kept free instead
    taken = {
        "− driver reserve": plan.driver_reserved_bytes,
        "− context": plan.context_bytes,
        "− non-torch memory": plan.runtime_bytes,
        "− weights": plan.weight_bytes,
        "− CUDA graphs": plan.cuda_graph_bytes,
        "− margin": plan.margin_bytes,
        "− transient peak": plan.transient_bytes,
    }
    # The table's terms are the whole budget: nothing else is taken, up to block rounding.
    assert plan.capacity_bytes - sum(taken.values()) - plan.kv_pool_bytes == plan.rounding_bytes
    terms = {
        "capacity": plan.capacity_bytes,
        **taken,
        "− block rounding": plan.rounding_bytes,
        "= KV pool": plan.kv_pool_bytes,
    }
    for term, value in terms.items():
        assert f"| {term} | {format_bytes(value)} |" in page, term
    assert (
        f"| − block rounding | {format_bytes(plan.rounding_bytes)} | whole blocks of {plan.block_size} tokens |"
        in page
    )
    assert f"| {plan.max_sequences(8192)} requests of 8,192 tokens |" in page


def test_ch14_fp8_requests_and_a_squeezed_pool() -> None:
    fp8 = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", kv_dtype="fp8")
    bf16 = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    squeezed = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", gpu_memory_utilization=0.5)
    first, second = answers("14_capacity_planning")
    assert_in(
        first,
        f"{fp8.max_sequences(8192)} requests",
        format_bytes(fp8.kv_pool_bytes),
        f"{bf16.max_sequences(8192)}",
    )
    assert_in(second, f"{squeezed.max_tokens():,} tokens", format_bytes(squeezed.kv_pool_bytes))


# chapter 15's lab workloads (its parameters cell), on its GPU
CH15_CHAT = dict(
    gpu="H100-SXM", model="meta-llama/Llama-3.1-8B", mean_input=161.31, mean_output=337.99, rate=2.0
)
CH15_MHA = dict(
    model="meta-llama/Llama-2-7b-hf",
    gpu="A100-80GB",
    mean_input=2000,
    mean_output=500,
    concurrency=64,
    max_model_len=4096,
)
CH15_70B = dict(
    model="meta-llama/Llama-3.1-70B", mean_input=500, mean_output=300, concurrency=16, max_model_len=8192
)


def applying(spec: dict) -> list[int]:
    return [lever.step for lever in diagnose(deployment_from_dict(spec)).levers if lever.applies]


def test_ch15_short_chat_moved_to_an_h100() -> None:
    lab = diagnose(deployment_from_dict(CH15_CHAT | {"gpu": "L4"}))
    h100 = diagnose(deployment_from_dict(CH15_CHAT))
    # the exercise's command line rounds the lab's mean lengths
    cli = diagnose(deployment_from_dict(CH15_CHAT | {"mean_input": 161, "mean_output": 338}))
    assert round(cli.concurrency) == round(h100.concurrency)
    assert lab.first is not None and lab.first.step == 1 and h100.first is None
    capped = diagnose(deployment_from_dict(CH15_CHAT | {"max_model_len": 2048}))
    # A paged pool reserves nothing per request: the same pool, the same load, the same (empty) diagnosis.
    assert capped.memory == h100.memory and capped.concurrency == h100.concurrency and capped.first is None
    before, after = h100.levers[0].numbers["worst_case"], capped.levers[0].numbers["worst_case"]
    assert before < after
    assert_in(
        answers("15_where_to_start")[0],
        "No lever applies",
        f"the pool of {h100.memory.max_tokens():,} tokens holds a {h100.deployment.context_limit:,}-token request",
        f"about {round(h100.concurrency):,} requests in flight",
        f"from {before:,.0f} to {after:,.0f} requests",
    )


def test_ch15_mha_summaries_with_an_output_spread() -> None:
    even = diagnose(deployment_from_dict(CH15_MHA))
    spread = diagnose(deployment_from_dict(CH15_MHA | {"output_cv": 1.0}))
    assert even.first is not None and spread.first is not None
    assert even.first.step == spread.first.step == 2
    per_request = spread.workload.mean_resident - even.workload.mean_resident
    assert_in(
        answers("15_where_to_start")[1],
        f"{spread.first.numbers['resident']:,.0f} tokens are resident instead of {even.first.numbers['resident']:,.0f}",
        f"adds {per_request:,.0f} tokens per request",
        f"from {even.first.numbers['fits_seqs']:.0f} to {spread.first.numbers['fits_seqs']:.0f} running requests",
        f"`--max-num-seqs {spread.first.numbers['fits_seqs']:.0f}`",
    )


def test_ch15_70b_tensor_parallel_size_by_gpu() -> None:
    h100 = diagnose(deployment_from_dict(CH15_70B | {"gpu": "H100-SXM"}))
    h200 = diagnose(deployment_from_dict(CH15_70B | {"gpu": "H200"}))
    # On an H100 the weights leave no pool: lever 9 names the smallest TP that fits.
    assert h100.first is not None and h100.first.step == 9
    tp_h100 = int(h100.first.numbers["tp_fit"])
    # vLLM 0.34 leaves the weights a pool on one H200, shorter than one max_model_len request: lever 1 first,
    # then lever 2; the next TP up lifts both.
    tp_h200 = h200.deployment.settings.tp
    assert h200.memory.fits and tp_h200 < tp_h100
    assert h200.first is not None and h200.first.step == 1
    active = h200.levers[1]
    assert active.step == 2 and active.applies
    assert diagnose(deployment_from_dict(CH15_70B | {"gpu": "H200", "tp": 2 * tp_h200})).first is None
    assert_in(
        answers("15_where_to_start")[2],
        f"`--tensor-parallel-size {tp_h200}` on an H200, against {tp_h100} on an H100-SXM",
        f"holds only {h200.memory.max_tokens():,} tokens, less than one {h200.deployment.context_limit:,}-token request",
        f"`--max-model-len {h200.first.numbers['needed']:.0f}`",
        f"caps the running requests at {active.numbers['fits_seqs']:.0f}",
        f"TP={2 * tp_h200} would lift both limits",
    )
