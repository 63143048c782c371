"""The budget table, takeaways and exercise answers of chapters 5-9, recomputed by kvlab.

Each test reads the page as written, takes the text it states (a table row, a takeaway or one exercise's folded
answer) and asserts that the figure kvlab computes now, formatted as the page writes it, appears there. A change
in kvlab or in a registry config that moves a number fails here instead of leaving the page wrong. Everything is
computed (big models on the meta device through kvlab's own functions); nothing here runs a lab.
"""

from __future__ import annotations

import pytest
from book_pages import ANSWER, TAKEAWAYS, answers, flat, page

from kvlab.costs import budget
from kvlab.specs import sizing
from kvlab.units import format_bytes

LLAMA_8B = "meta-llama/Llama-3.1-8B"
H100 = "H100-SXM"
CHAPTERS = ["05_active_tokens", "06_long_context", "07_paging", "08_continuous_batching", "09_prefix_caching"]


def takeaways(chapter: str) -> str:
    (box,) = TAKEAWAYS.findall(page(chapter))
    return flat(box)


def table_rows(chapter: str) -> dict[str, str]:
    """First cell -> second cell of every three-column Markdown table row of the page."""
    return {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in page(chapter).splitlines()
        if line.startswith("| ") and line.count("|") == 4
    }


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_ends_with_takeaways_and_answered_exercises(chapter):
    text = page(chapter)
    bullets = [line for line in TAKEAWAYS.findall(text)[0].splitlines() if line.startswith("- ")]
    assert 3 <= len(bullets) <= 5, f"{chapter}: {len(bullets)} takeaways"
    assert ":class: tip kvlab-takeaways" in text
    exercises = text.split("\n## Exercises\n", 1)[1]
    assert 2 <= len(ANSWER.findall(exercises)) <= 3, f"{chapter}: 2-3 answered exercises"
    assert "kvlab sweep" in exercises or "parameters cell" in exercises, (
        f"{chapter}: no exercise runs the lab"
    )


# Chapter 5 -----------------------------------------------------------------------------------------------------


def h100_budget(**kwargs) -> budget.MemoryBudget:
    return budget.memory_budget(LLAMA_8B, H100, **kwargs)


# Chapter 5's budget tables are glued from the lab: tests/test_ch5_budget.py holds them to kvlab's budget.


def test_ch5_takeaways():
    plan = h100_budget()
    box = takeaways("05_active_tokens")
    assert f"{format_bytes(plan.kv_pool_bytes)} of {format_bytes(plan.capacity_bytes)}" in box
    ratio = plan.max_sequences(500) / plan.max_sequences(10_000)
    assert f"about {round(ratio)}× more 500-token chats than 10,000-token documents" in box


def test_ch5_answers():
    first, second = answers("05_active_tokens")
    held = sizing.kv_cache_bytes(LLAMA_8B, 32_768, 32, "bf16")
    assert f"**{format_bytes(held)}**" in first and held > h100_budget().capacity_bytes
    assert f"**{h100_budget().max_sequences(32_768)}** sequences of 32,768 tokens" in first
    assert f"against {h100_budget().max_sequences(10_000)} of 10,000" in first
    fp8 = h100_budget(kv_dtype="fp8").max_sequences(10_000)
    assert f"**{fp8}** sequences, twice the {h100_budget().max_sequences(10_000)}" in second
    assert fp8 == 2 * h100_budget().max_sequences(10_000)


# Chapter 6 -----------------------------------------------------------------------------------------------------


def test_ch6_takeaways():
    box = takeaways("06_long_context")
    held = sizing.kv_cache_bytes(LLAMA_8B, 131_072, 1, "bf16")
    weights = sizing.weight_bytes(LLAMA_8B, "bf16")
    assert f"({format_bytes(held)} against {format_bytes(weights)})" in box
    assert f"one H100 holds {h100_budget().max_sequences(131_072)} such users in bf16" in box


def test_ch6_answers():
    first, second = answers("06_long_context")
    qwen = "Qwen/Qwen2.5-7B"
    assert f"**{sizing.crossover_context(qwen, 8):,} tokens**" in first
    assert f"at {sizing.crossover_context(LLAMA_8B, 8):,}:" in first
    per_token = (format_bytes(sizing.kv_bytes_per_token(m, "bf16")) for m in (qwen, LLAMA_8B))
    assert "stores {} per token against {}".format(*per_token) in first
    counts = [
        budget.memory_budget(LLAMA_8B, gpu, kv_dtype=dtype).max_sequences(131_072)
        for gpu in (H100, "H200")
        for dtype in ("bf16", "fp8")
    ]
    assert (
        "On an H100 SXM: **{}** in bf16, **{}** in fp8. On an H200: **{}** in bf16, **{}** in fp8.".format(
            *counts
        )
        in second
    )


# Chapter 7 -----------------------------------------------------------------------------------------------------


def h100_max_num_seqs() -> int:
    from kvlab.specs import hardware, vllm_defaults

    gpu = hardware.spec_for(H100)
    assert gpu is not None
    return vllm_defaults.batch_defaults(gpu.memory_bytes, gpu.name).max_num_seqs


def test_ch7_answers_and_takeaways():
    from kvlab.specs import vllm_defaults

    # vLLM's own default block (64 from 0.34.0), not the 16 tokens a block of kvlab's engine and the lab holds
    block = vllm_defaults.CURRENT.block_size
    per_sequence = (block - 1) * sizing.kv_bytes_per_token(LLAMA_8B, "bf16")
    assert f"with blocks of {block}, at most {format_bytes(per_sequence)} per" in takeaways("07_paging")
    _, second = answers("07_paging")
    seqs = h100_max_num_seqs()
    assert f"`max_num_seqs` = {seqs:,}" in flat(page("07_paging"))
    pool = h100_budget().kv_pool_bytes
    assert f"at most {block - 1} slots of 128 KiB: {format_bytes(per_sequence)}" in second
    assert f"For {seqs:,} sequences that is **{format_bytes(seqs * per_sequence)}**" in second
    assert f"**{100 * seqs * per_sequence / pool:.1f} %** of the {format_bytes(pool)} pool" in second


# Chapter 8 -----------------------------------------------------------------------------------------------------


def test_ch8_takeaways_give_vllms_max_num_seqs_by_gpu():
    from kvlab.specs import hardware, vllm_defaults

    def default(gpu: str) -> int:
        spec = hardware.spec_for(gpu)
        assert spec is not None
        return vllm_defaults.batch_defaults(spec.memory_bytes, spec.name).max_num_seqs

    box = takeaways("08_continuous_batching")
    assert f"default is {default(H100):,} on an H100, {default('A100-80GB')} on an A100" in box
    assert default("L4") == default("A100-80GB")


def test_ch8_answers():
    from kvlab.specs import hardware

    first, second = answers("08_continuous_batching")
    gpu = hardware.spec_for(H100)
    assert gpu is not None
    weights = sizing.weight_bytes(LLAMA_8B, "bf16")
    assert (
        f"The weights, {format_bytes(weights)}, read at {gpu.bandwidth_bytes_per_s / 1e12:.2f} TB/s" in first
    )
    assert f"about **{weights / gpu.bandwidth_bytes_per_s * 1e3:.1f} ms**" in first
    fit = h100_budget().max_sequences(2_000)
    assert (
        f"The pool holds **{fit}** such requests, far below `max_num_seqs` = {h100_max_num_seqs():,}"
        in second
    )
    assert fit < h100_max_num_seqs()


# Chapter 9 -----------------------------------------------------------------------------------------------------


def test_ch9_says_the_measured_saving_is_a_small_model_on_this_cpu():
    opening = flat(page("09_prefix_caching").split("\n## ", 1)[0])
    assert "ch9_real_ttft_saving" in opening
    assert "measured for a 135M model on this CPU" in opening


def test_ch9_answers():
    first, second = answers("09_prefix_caching")
    block = budget.BLOCK_SIZE
    assert (
        f"**{100 // block * block}** tokens in both runs: ⌊100 / {block}⌋ = {100 // block} whole blocks"
        in first
    )
    assert 96 // block * block == 100 // block * block
    blocks = 2_000 // block
    per_block = block * sizing.kv_bytes_per_token(LLAMA_8B, "bf16")
    fit = h100_budget().max_sequences(2_000)
    assert f"⌊2,000 / {block}⌋ = {blocks} blocks of {format_bytes(per_block)}" in second
    assert f"**{format_bytes(blocks * per_block)}**, held once" in second
    assert f"{fit} copies hold **{format_bytes(fit * blocks * per_block)}**" in second
    assert f"How much would {fit} requests" in flat(page("09_prefix_caching"))
