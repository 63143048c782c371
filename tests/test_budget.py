"""The memory budget: every term named, block rounding, vLLM's own arithmetic per release, and a measured
activation peak.

Provenance of each rule (read from the release's wheel, vllm-project/vllm):
- 0.34.0 measured rule: vllm/v1/worker/extensible_kv_cache.py `measure_kv_cache_bytes` (non_kv_used = initial free
  - free - committed; headroom = free + committed; margin = max(1 GiB, 0.75 × transient); available =
  min(requested - non_kv_used, headroom - margin) - max(transient, torch growth)), `ExtensibleKVCache.blocks_within`
  (granule rounding per segment); vllm/v1/worker/gpu_worker.py `determine_available_memory` (the reservation, and
  peak_activation_memory = transient headroom + CUDA-graph estimate, which `initialize_from_config` makes the
  cache's reserved_headroom_bytes); vllm/config/cache.py `resolved_gpu_memory_utilization` (1.0, 0.92 without
  the extensible cache) and DEFAULT_BLOCK_SIZE 64; vllm/config/vllm.py `_resolve_extensible_kv_cache`.
- 0.20.0-0.33.0 estimate with the graph charge: vllm/v1/worker/gpu_worker.py `determine_available_memory`
  (requested - non_kv_cache_memory - cudagraph_memory_estimate), vllm/envs.py
  VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS "1" (0.20.0; "0" in 0.19.0), CacheConfig.gpu_memory_utilization 0.92
  (0.20.0; 0.9 in 0.19.0).
- 0.6.4 (v0): vllm/worker/worker.py `determine_num_available_blocks` (total × utilisation - peak, with all memory
  outside PyTorch, the CUDA context included, added to the peak); vllm/config.py SchedulerConfig (512 tokens with
  chunked prefill, else max(max_model_len, 2048)); vllm/engine/arg_utils.py (utilisation 0.9, 256 sequences,
  chunked prefill on by default only above 32k tokens).
"""

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
    plan = budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0")
    assert plan.capacity_bytes == 81559 * MiB
    cuda_total = plan.capacity_bytes - budget.CENTRAL.driver_reserved_bytes
    # vLLM's request_memory: ceil(CUDA's total × utilisation), 0.92 by default in 0.33.
    assert plan.requested_bytes == math.ceil(cuda_total * 0.92)
    assert plan.runtime_bytes == budget.non_torch_bytes(1, budget.CENTRAL)
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
    plan = budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0").floor
    assert plan is not None
    assert plan.activation_bytes == budget.forward_peak_bytes(LLAMA3, 8192)
    assert plan.sampler_bytes == budget.sampler_peak_bytes(LLAMA3, 1024)
    assert plan.peak_bytes == max(plan.activation_bytes, plan.sampler_bytes)
    offline = budget.memory_budget(LLAMA3, "H100-SXM", usage_context="llm", vllm_version="0.33.0").floor
    assert offline is not None
    assert offline.activation_bytes == budget.forward_peak_bytes(LLAMA3, 16384) > plan.activation_bytes


def test_chunked_prefill_off_profiles_a_whole_prompt():
    on = budget.memory_budget(LLAMA3, "L4", max_model_len=32768, vllm_version="0.33.0")
    off = budget.memory_budget(
        LLAMA3, "L4", max_model_len=32768, enable_chunked_prefill=False, vllm_version="0.33.0"
    )
    central = budget.CENTRAL
    assert on.activation_bytes == budget.forward_peak_bytes(LLAMA3, 2048, estimates=central)
    assert off.activation_bytes == budget.forward_peak_bytes(LLAMA3, 32768, estimates=central)
    assert off.kv_pool_bytes < on.kv_pool_bytes


def test_cuda_graphs_charged_unless_eager_or_switched_off():
    plan = budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0")
    assert plan.cuda_graph_bytes > 50 * budget.CENTRAL.cuda_graph_bytes
    eager = budget.memory_budget(LLAMA3, "H100-SXM", enforce_eager=True, vllm_version="0.33.0")
    assert eager.cuda_graph_bytes == 0
    unset = budget.memory_budget(LLAMA3, "H100-SXM", estimate_cuda_graphs=False, vllm_version="0.33.0")
    assert unset.cuda_graph_bytes == 0 and unset.num_blocks > plan.num_blocks
    # 0.19.0 charged none by default (vllm/envs.py "0"); 0.20.0 does ("1")
    assert budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.19.0").cuda_graph_bytes == 0
    assert budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.20.0").cuda_graph_bytes > 0


def test_capture_sizes_follow_vllm():
    sizes = budget.cuda_graph_sizes(max_num_seqs=256, max_num_batched_tokens=8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-2:] == [496, 512] and len(sizes) == 51
    assert budget.cuda_graph_sizes(max_num_seqs=4, max_num_batched_tokens=8192) == [1, 2, 4, 8]
    assert budget.cuda_graph_sizes(max_num_seqs=256, max_num_batched_tokens=100)[-1] == 100


def test_non_torch_memory_grows_at_tp():
    assert budget.non_torch_bytes(2) > 4 * budget.non_torch_bytes(1)
    plan = budget.memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM", tp=4)
    assert plan.runtime_bytes == budget.non_torch_bytes(4, budget.CENTRAL)
    assert plan.floor is not None and plan.floor.runtime_bytes == budget.non_torch_bytes(4)


def test_every_estimated_term_is_labelled():
    lines = budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0").lines(8192)
    for label in ("driver reserve", "non-torch", "activations", "CUDA graphs"):
        (line,) = [line for line in lines if label in line]
        assert "estimate" in line, line
    assert any("vllm/engine/arg_utils.py" in line for line in lines)
    measured = budget.memory_budget(
        LLAMA3, "H100-SXM", runtime_bytes=MiB, activation_bytes=GiB, vllm_version="0.33.0"
    )
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
    plan = budget.memory_budget(LLAMA3, "A100-80GB", block_size=16, vllm_version="0.33.0")
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


def _measured(**changes):
    """A 0.34 budget worked by hand below: 80 GiB of CUDA memory, 0.5 GiB in use before vLLM's snapshot, 1 GiB
    outside PyTorch, 15 GiB of weights, a 2 GiB activation peak, 1 GiB of graphs captured and estimated."""
    terms = dict(
        capacity_bytes=80 * GiB,
        gpu_memory_utilization=1.0,
        runtime_bytes=GiB,
        weight_bytes=15 * GiB,
        activation_bytes=2 * GiB,
        block_size=64,
        kv_bytes_per_token=131_072,
        cuda_graph_bytes=GiB,
        cuda_graph_estimate_bytes=GiB,
        context_bytes=GiB // 2,
        sizing="measured",
        kv_segments=32,
    )
    return budget.MemoryBudget(**(terms | changes))


def test_measured_rule_by_hand():
    # measure_kv_cache_bytes (0.34.0): init_free = 80 - 0.5; free after warmup = 79.5 - 17 (1 + 15 + 1 GiB kept);
    # non_kv_used = 17; headroom = 62.5; transient = 2 + 1 (reserved_headroom_bytes = peak + graph estimate);
    # margin = max(1, 0.75 × 3) = 2.25; KV = min(80 - 17, 62.5 - 2.25) - 3 = 57.25 GiB.
    plan = _measured()
    assert (plan.transient_bytes, plan.margin_bytes) == (3 * GiB, int(2.25 * GiB))
    assert plan.kv_headroom_bytes == int(57.25 * GiB) and plan.utilization_cap_bytes == 0
    # 57.25 GiB in blocks of 64 tokens × 128 KiB = 8 MiB: 7,328 blocks, each of the 32 segments 1,832 MiB (whole
    # 2 MiB granules)
    assert plan.num_blocks == 7328
    # the reservation ("Available KV cache memory") is the estimate rule's figure: 80 - 1 - 15 - 2 - 1 = 61 GiB
    assert plan.reservation_bytes == 61 * GiB and plan.reservation_cap_bytes == 0
    # the stack sums to the capacity
    assert (
        sum(v for _, v, _ in plan.stack()) + plan.rounding_bytes + plan.kv_pool_bytes == plan.capacity_bytes
    )


def test_measured_rule_a_utilisation_under_one_withholds():
    # 0.92: requested = ceil(80 GiB × 0.92) = 73.6 GiB; requested - used = 56.6 GiB < 60.25: withheld 3.65 GiB,
    # KV = 56.6 - 3 = 53.6 GiB (the warning vLLM 0.34 prints when 0.7 < utilisation < 1.0 withholds >= 1 GiB)
    plan = _measured(gpu_memory_utilization=0.92)
    assert plan.kv_headroom_bytes == math.ceil(80 * GiB * 0.92) - 17 * GiB - 3 * GiB
    assert plan.utilization_cap_bytes == int(60.25 * GiB) - (math.ceil(80 * GiB * 0.92) - 17 * GiB)


def test_measured_rule_margin_floor_and_granules():
    small = _measured(activation_bytes=GiB // 4, cuda_graph_estimate_bytes=0)
    assert (
        small.margin_bytes == budget.KV_CACHE_MARGIN_FLOOR_BYTES
    )  # 0.75 × 0.25 GiB is below the 1 GiB floor
    # a segment rounds up to whole 2 MiB granules: 1,000 blocks of 64 tokens × 2,000 B over 3 segments
    odd = _measured(kv_bytes_per_token=2000, kv_segments=3)
    blocks = odd.num_blocks
    per_segment = -(-blocks * odd.block_bytes // 3)
    assert 3 * -(-per_segment // (2 * MiB)) * 2 * MiB <= odd.kv_headroom_bytes
    per_next = -(-(blocks + 1) * odd.block_bytes // 3)
    assert 3 * -(-per_next // (2 * MiB)) * 2 * MiB > odd.kv_headroom_bytes


def test_v0_charges_the_context_and_profiles_a_whole_prompt():
    # 0.6.4's determine_num_available_blocks: total × 0.9 - (peak + all memory outside PyTorch, context included);
    # at max_model_len 20,000 chunked prefill stays off (on only above 32k), so the profile runs 20,000 tokens
    plan = budget.memory_budget(LLAMA3, "L4", vllm_version="v0", max_model_len=20000)
    assert plan.sizing == "v0" and plan.cuda_graph_bytes == 0
    assert plan.activation_bytes == budget.forward_peak_bytes(LLAMA3, 20000, estimates=budget.CENTRAL)
    assert plan.kv_headroom_bytes == (
        plan.requested_bytes - plan.context_bytes - plan.runtime_bytes - plan.weight_bytes - plan.peak_bytes
    )
    assert plan.gpu_memory_utilization == 0.9 and plan.block_size == 16
    long = budget.memory_budget(LLAMA3, "L4", vllm_version="0.6.3", max_model_len=65536)
    assert long.activation_bytes == budget.forward_peak_bytes(LLAMA3, 512, estimates=budget.CENTRAL)


def test_default_is_034_measured_and_the_fallback_is_its_estimate_rule():
    current = budget.memory_budget(LLAMA3, "H100-SXM")
    assert current.sizing == "measured" and current.gpu_memory_utilization == 1.0 and current.block_size == 64
    fallback = budget.memory_budget(LLAMA3, "H100-SXM", extensible_kv_cache=False)
    assert fallback.sizing == "v1+graphs" and fallback.gpu_memory_utilization == 0.92
    assert fallback.block_size == 64 and "extensible KV cache off" in fallback.vllm_note
    older = budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0")
    assert current.kv_pool_bytes > older.kv_pool_bytes
    with pytest.raises(ValueError, match="no extensible KV cache"):
        budget.memory_budget(LLAMA3, "H100-SXM", vllm_version="0.33.0", extensible_kv_cache=True)


@pytest.mark.parametrize("version", ["v0", "0.19.0", "0.33.0", "0.34.0"])
def test_the_floor_is_below_the_expected_pool(version):
    plan = budget.memory_budget(LLAMA3, "A100-80GB", vllm_version=version)
    assert plan.floor is not None and plan.floor.floor is None
    assert plan.kv_pool_floor_bytes < plan.kv_pool_bytes


def test_size_prints_both_pools_and_which_one_the_sequences_use():
    lines = budget.memory_budget(LLAMA3, "H100-SXM").lines(8192)
    text = "\n".join(lines)
    assert "KV pool (expected)" in text and "KV pool floor" in text and "rule: vLLM 0.34.0" in text
    fit = next(line for line in lines if "sequences that fit" in line)
    assert "in the expected pool" in fit and "the floor holds" in fit


def test_settings_carry_the_version():
    s = budget.BudgetSettings(vllm_version="0.33")
    assert s.memory_budget(LLAMA3, "H100-SXM").vllm_note.startswith("vLLM 0.33.0")
    with pytest.raises(ValueError, match="not a vLLM release"):
        budget.BudgetSettings(vllm_version="latest")
