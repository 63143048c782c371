"""vLLM's page alignment for hybrid models (kvlab.costs.hybrid_pages) against a published vLLM log and the rule."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlab.costs.hybrid_pages import aligned_block_size, hybrid_pages, vllm_state_bytes
from kvlab.specs.arch import UnsupportedConfigError
from kvlab.specs.layers import StateLayer

QWEN3_NEXT = "Qwen/Qwen3-Next-80B-A3B-Thinking"
NEMOTRON_H = "nvidia/Nemotron-H-56B-Base-8K"


def test_qwen3_next_at_tp2_matches_a_published_vllm_log():
    # vLLM 0.10.2 serving Qwen3-Next-80B-A3B-Instruct (the same shapes as the Thinking config) on two H200s,
    # TP=2, bf16, prefix caching off: "Setting attention block size to 544 tokens" and "Padding mamba page size
    # by 1.49%" (a public start-up log, dated 10-23, whose shell prompt names a "LegalAI-DataPipeline" project;
    # found through the code-search index, its repository not recorded there).
    pages = hybrid_pages(QWEN3_NEXT, tp=2)
    assert pages.block_size == 544
    assert f"{pages.padding_percent:.2f}" == "1.49"


def test_the_same_log_s_pool_and_concurrency_follow_from_its_available_memory():
    # The same log: "Available KV cache memory: 44.59 GiB" per rank, "GPU KV cache size: 973,760 tokens" and
    # "Maximum concurrency for 262,144 tokens per request: 14.77x". The printed memory is rounded to 0.01 GiB;
    # every value it may stand for gives vLLM's figures.
    pages = hybrid_pages(QWEN3_NEXT, tp=2)
    assert (pages.group_size, pages.groups) == (12, (1, 3))
    for gib in (44.585, 44.59, 44.5949):
        available = int(gib * 2**30)
        assert pages.pool_tokens(available) == 973_760
        # 7,161 to 7,163 blocks over 485 a request (482 attention blocks of 544 tokens, 3 state pages)
        assert abs(pages.max_concurrency(available, 262_144) - 14.77) < 0.006
    assert f"{pages.max_concurrency(int(44.59 * 2**30), 262_144):.2f}" == "14.77"


def test_qwen3_next_by_hand():
    pages = hybrid_pages(QWEN3_NEXT)
    # Full attention: 2 KV heads × (256 + 256) × 2 B a token; gated DeltaNet: a conv window of 3 inputs of
    # 8,192 channels and a 32 × 128 × 128 state, both bf16.
    assert pages.attention_bytes_per_token == 2 * 512 * 2
    assert pages.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2
    assert pages.block_size == 16 * math.ceil(pages.state_bytes / (16 * 2048)) == 544
    assert (pages.attention_layers, pages.state_layers) == (12, 36)


def test_a_short_request_holds_a_whole_block_in_every_attention_layer():
    pages = hybrid_pages(NEMOTRON_H)
    assert pages.block_size == 2080
    # One token holds a full 2,080-token page in each of the 10 attention layers, and a page in each of 54
    # state layers.
    assert pages.pages(1) == 10 + 54
    assert pages.held_bytes(1) == 64 * pages.page_bytes
    assert pages.needed_bytes(1) == 10 * 4096 + 54 * pages.state_bytes
    assert (
        pages.held_bytes(pages.block_size) - pages.needed_bytes(pages.block_size) == 54 * pages.padding_bytes
    )


@given(
    state=st.integers(1, 10**9),
    token=st.integers(1, 10**6),
    block=st.sampled_from([1, 16, 32, 64, 128, 1024]),
    kernel=st.sampled_from([16, 32, 64]),
)
def test_the_page_covers_the_state_by_less_than_one_alignment_step(state, token, block, kernel):
    size = aligned_block_size(state, token, block, kernel)
    step = max(block, kernel)
    assert size >= block
    assert size * token >= state
    # Either the asked block already held the state, or one alignment step less would not have.
    assert size == block or (size % step == 0 and (size - step) * token < state)


def test_a_block_size_that_already_covers_the_state_is_kept():
    asked = hybrid_pages(QWEN3_NEXT, block_size=1024)
    assert asked.block_size == 1024
    assert asked.padding_bytes == 1024 * 2048 - asked.state_bytes


def test_an_fp32_ssm_cache_doubles_the_state_and_the_block():
    pages = hybrid_pages(QWEN3_NEXT, ssm_dtype="fp32")
    assert pages.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 4
    assert pages.block_size == 16 * math.ceil(pages.state_bytes / (16 * 2048))


def test_vllm_keeps_one_input_less_and_a_bf16_state():
    layer = StateLayer(conv_channels=10, conv_kernel=4, recurrent_shape=(2, 3, 5))
    assert vllm_state_bytes(layer) == 10 * 3 * 2 + 30 * 2
    # transformers keeps the whole kernel and a float32 state.
    assert layer.state_bytes("bf16") == 10 * 4 * 2 + 30 * 4
    assert vllm_state_bytes(layer, tp=2) == 5 * 3 * 2 + 15 * 2
    with pytest.raises(ValueError, match="does not divide"):
        vllm_state_bytes(layer, tp=4)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("meta-llama/Llama-3.1-8B", "no state layer"),
        ("google/gemma-2-9b", "no state layer"),
    ],
)
def test_models_the_rule_does_not_cover_are_one_line_errors(model, message):
    with pytest.raises(UnsupportedConfigError, match=message):
        hybrid_pages(model)


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        hybrid_pages(QWEN3_NEXT, block_size=0)
    with pytest.raises(ValueError, match="context must be an integer >= 1"):
        hybrid_pages(QWEN3_NEXT).pages(0)
