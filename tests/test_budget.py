"""The memory budget: every term named, block rounding, vLLM's own arithmetic, and a measured activation peak."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.costs import budget
from kvlab.measure import MemoryTracker
from kvlab.models import tiny_model
from kvlab.specs import hardware, sizing
from kvlab.units import GiB, MiB

LLAMA3 = "meta-llama/Llama-3.1-8B"


def test_terms_add_up_to_the_capacity():
    plan = budget.memory_budget(LLAMA3, "H100-SXM")
    assert plan.capacity_bytes == 81559 * MiB
    cuda_total = plan.capacity_bytes - budget.DRIVER_RESERVED_BYTES
    # vLLM's request_memory: ceil(CUDA's total × utilisation), 0.92 by default in 0.33.
    assert plan.requested_bytes == math.ceil(cuda_total * 0.92)
    assert plan.runtime_bytes == budget.non_torch_bytes(1)
    assert plan.weight_bytes == sizing.weight_bytes(LLAMA3)
    assert plan.block_bytes == 16 * 131_072
    parts = (
        plan.driver_reserved_bytes
        + plan.engine_cap_bytes
        + plan.runtime_bytes
        + plan.weight_bytes
        + plan.peak_bytes
        + plan.cuda_graph_bytes
        + plan.rounding_bytes
        + plan.kv_pool_bytes
    )
    assert parts == plan.capacity_bytes
    assert 0 <= plan.rounding_bytes < plan.block_bytes
    # Less than "capacity minus weights", which is what the chapters used to give the cache.
    assert plan.kv_pool_bytes < plan.capacity_bytes - plan.weight_bytes
    assert plan.max_sequences(8192) == plan.num_blocks // 512


def test_profile_peak_is_the_larger_of_forward_and_sampler():
    # vLLM 0.33 on an H100 under `vllm serve`: 8,192 batched tokens, 1,024 sampled rows.
    plan = budget.memory_budget(LLAMA3, "H100-SXM")
    assert plan.activation_bytes == budget.forward_peak_bytes(LLAMA3, 8192)
    assert plan.sampler_bytes == budget.sampler_peak_bytes(LLAMA3, 1024)
    assert plan.peak_bytes == max(plan.activation_bytes, plan.sampler_bytes)
    offline = budget.memory_budget(LLAMA3, "H100-SXM", usage_context="llm")
    assert offline.activation_bytes == budget.forward_peak_bytes(LLAMA3, 16384) > plan.activation_bytes


def test_chunked_prefill_off_profiles_a_whole_prompt():
    on = budget.memory_budget(LLAMA3, "L4", max_model_len=32768)
    off = budget.memory_budget(LLAMA3, "L4", max_model_len=32768, enable_chunked_prefill=False)
    assert on.activation_bytes == budget.forward_peak_bytes(LLAMA3, 2048)
    assert off.activation_bytes == budget.forward_peak_bytes(LLAMA3, 32768)
    assert off.kv_pool_bytes < on.kv_pool_bytes


def test_cuda_graphs_charged_unless_eager_or_switched_off():
    plan = budget.memory_budget(LLAMA3, "H100-SXM")
    assert plan.cuda_graph_bytes > 50 * budget.CUDA_GRAPH_BYTES
    assert budget.memory_budget(LLAMA3, "H100-SXM", enforce_eager=True).cuda_graph_bytes == 0
    unset = budget.memory_budget(LLAMA3, "H100-SXM", estimate_cuda_graphs=False)
    assert unset.cuda_graph_bytes == 0 and unset.num_blocks > plan.num_blocks


def test_capture_sizes_follow_vllm():
    sizes = budget.cuda_graph_sizes(max_num_seqs=256, max_num_batched_tokens=8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-2:] == [496, 512] and len(sizes) == 51
    assert budget.cuda_graph_sizes(max_num_seqs=4, max_num_batched_tokens=8192) == [1, 2, 4, 8]
    assert budget.cuda_graph_sizes(max_num_seqs=256, max_num_batched_tokens=100)[-1] == 100


def test_non_torch_memory_grows_at_tp():
    assert budget.non_torch_bytes(2) > 4 * budget.non_torch_bytes(1)
    plan = budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=4)
    assert plan.runtime_bytes == budget.non_torch_bytes(4)


def test_every_estimated_term_is_labelled():
    lines = budget.memory_budget(LLAMA3, "H100-SXM").lines(8192)
    for label in ("driver reserve", "non-torch memory", "activations", "CUDA graphs"):
        (line,) = [line for line in lines if label in line]
        assert "estimate" in line, line
    assert any("vllm/engine/arg_utils.py" in line for line in lines)
    measured = budget.memory_budget(LLAMA3, "H100-SXM", runtime_bytes=MiB, activation_bytes=GiB)
    assert "estimate" not in next(line for line in measured.lines() if "activations" in line)


def test_reproduces_vllms_logged_kv_cache_size():
    # vLLM v1 on an H100 (CUDA-visible total 79.18 GiB), Llama-3.1-8B, gpu_memory_utilization 0.9: weights
    # 14.99 GiB, peak activation 4.76 GiB, non-torch 0.13 GiB -> "Available KV cache memory: 51.38 GiB"
    # (llm-d/llm-d-benchmark, config_explorer/empirical-vllm-memory-results.md).
    plan = budget.MemoryBudget(
        capacity_bytes=round(79.18 * GiB),
        gpu_memory_utilization=0.9,
        runtime_bytes=round(0.13 * GiB),
        weight_bytes=round(14.99 * GiB),
        activation_bytes=round(4.76 * GiB),
        block_size=16,
        kv_bytes_per_token=sizing.kv_bytes_per_token(LLAMA3),
    )
    assert plan.kv_headroom_bytes / GiB == pytest.approx(51.38, abs=0.01)


def test_block_rounding_per_sequence():
    plan = budget.memory_budget(LLAMA3, "A100-80GB", block_size=16)
    assert plan.blocks_per_sequence(1) == 1 and plan.blocks_per_sequence(16) == 1
    assert plan.blocks_per_sequence(17) == 2
    assert plan.max_sequences(17) == plan.num_blocks // 2


def test_does_not_fit_is_reported_not_clamped():
    plan = budget.memory_budget("meta-llama/Llama-3.1-70B", "L4")
    assert plan.kv_headroom_bytes < 0 and plan.num_blocks == 0 and not plan.fits
    assert any("does NOT fit" in line for line in plan.lines(4096))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gpu_memory_utilization=0.0),
        dict(gpu_memory_utilization=1.5),
        dict(runtime_bytes=-1),
        dict(block_size=0),
    ],
)
def test_bad_input(kwargs):
    with pytest.raises(ValueError):
        budget.memory_budget(LLAMA3, "H100-SXM", **kwargs)


def test_unknown_gpu():
    with pytest.raises(hardware.UnknownAcceleratorError):
        budget.memory_budget(LLAMA3, "Z100")


def test_measured_terms_replace_the_defaults():
    plan = budget.memory_budget(LLAMA3, "H200", runtime_bytes=500 * MiB, activation_bytes=2 * GiB)
    assert (plan.runtime_bytes, plan.activation_bytes) == (500 * MiB, 2 * GiB)
    assert "measured" in plan.runtime_source and "measured" in plan.activation_source


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("tokens", [64, 1024])
def test_activation_estimate_matches_a_measured_forward(family, tokens):
    # Independent of the formula: live storage bytes of a real transformers forward, counted by the allocator
    # stand-in on CPU (fp32, SDPA attention, logits for the last token only).
    model = tiny_model(family)
    ids = torch.zeros(1, tokens, dtype=torch.long)
    with torch.inference_mode(), MemoryTracker("cpu") as mem:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    estimate = budget.activation_workspace_bytes(model.config, tokens, 1, "fp32")
    assert estimate == pytest.approx(mem.peak_bytes, rel=0.02)


def test_cuda_context_needs_cuda():
    from kvlab.measure import cuda_context_bytes

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            cuda_context_bytes("cpu")
    else:  # pragma: no cover - GPU machines
        assert 0 < cuda_context_bytes("cuda") < 4 * GiB
