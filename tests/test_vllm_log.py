"""kvlab.planning.vllm_log reads published vLLM start-up logs (tests/data/vllm_logs/, each cited in index.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.planning import explain_vllm, vllm_log
from kvlab.specs import sizing

DATA = Path(__file__).parent / "data" / "vllm_logs"
INDEX = json.loads((DATA / "index.json").read_text())


def _log(entry: dict) -> vllm_log.StartupLog:
    return vllm_log.parse((DATA / f"{entry['slug']}.log").read_text())


def test_every_index_entry_has_its_log_and_a_source():
    assert len(INDEX) >= 10
    for entry in INDEX:
        assert (DATA / f"{entry['slug']}.log").is_file(), entry["slug"]
        assert entry["source"].startswith("https://github.com/"), entry["slug"]
        assert entry["format"] in ("v1", "v0")


@pytest.mark.parametrize("entry", INDEX, ids=[e["slug"] for e in INDEX])
def test_parser_finds_the_numbers_the_index_records(entry):
    log = _log(entry)
    assert log.printed_bytes() == entry["printed"]
    assert log.format == entry["format"]


@pytest.mark.parametrize("entry", INDEX, ids=[e["slug"] for e in INDEX])
def test_engine_config_line_matches_the_index(entry):
    log = _log(entry)
    if log.model is None:
        pytest.skip("the posted lines hold no engine config line")
    assert log.model == entry["model"]
    assert log.max_seq_len == entry["max_model_len"]
    assert (log.tensor_parallel_size or 1) == entry["tp"]


def test_both_families_of_the_profiling_line_are_read():
    v0 = vllm_log.parse(
        "INFO worker.py:266] the current vLLM instance can use total_gpu_memory (22.07GiB) x "
        "gpu_memory_utilization (0.90) = 19.86GiB\nINFO worker.py:266] model weights take 14.99GiB; "
        "non_torch_memory takes 0.05GiB; PyTorch activation peak memory takes 0.22GiB; the rest of the memory "
        "reserved for KV Cache is 4.60GiB.\n"
    )
    assert v0.format == "v0"
    assert v0.available_kv is not None and v0.available_kv.bytes == round(4.60 * 2**30)
    assert v0.activation_peak is not None and v0.activation_peak.bytes == round(0.22 * 2**30)
    assert v0.gpu_memory_utilization == 0.90
    v1 = vllm_log.parse("[gpu_worker.py:276] Available KV cache memory: 85.79 GiB\n")
    assert v1.format == "v1" and v1.available_kv is not None
    assert v1.available_kv.half_ulp_bytes == round(0.005 * 2**30)


def test_the_one_line_ledger_gives_the_total_the_terms_and_non_torch_by_difference():
    # the wording of wtdcode/vllm-backport#34's lines, with round figures
    ledger = vllm_log.parse(
        "[model_runner.py:407] Model loading took 15.0 GiB memory and 5.4 seconds\n"
        "[gpu_worker.py:955] Free memory on device (78.84/79.25 GiB) on startup. Desired GPU memory utilization "
        "is (0.92, 72.91 GiB). Actual usage is 15.26 GiB for consumed memory (weights + non-torch), 1.44 GiB for "
        "peak activation, and 0.23 GiB for CUDAGraph memory. Current kv cache memory in use is 56.2 GiB.\n"
    )
    gib = 2**30
    assert ledger.format == "v1" and ledger.gpu_memory_utilization == 0.92
    assert ledger.total_gpu_memory == vllm_log.Printed(round(79.25 * gib), round(0.005 * gib))
    assert ledger.activation_peak is not None and ledger.activation_peak.bytes == round(1.44 * gib)
    assert ledger.cuda_graph is not None and ledger.cuda_graph.bytes == round(0.23 * gib)
    assert ledger.available_kv is not None and ledger.available_kv.bytes == round(56.2 * gib)
    # non-torch memory: 15.26 - 15.0 GiB, within the two figures' roundings (0.005 + 0.05 GiB)
    non_torch = ledger.non_torch_memory
    assert non_torch == vllm_log.Printed(
        round(15.26 * gib) - round(15.0 * gib), round(0.005 * gib) + round(0.05 * gib)
    )
    assert ledger.non_torch is None and ledger.printed_bytes()["weights_and_non_torch_bytes"] == round(
        15.26 * gib
    )
    # without the weights' own line the two stay one figure
    alone = vllm_log.parse(
        "Actual usage is 15.26 GiB for consumed memory (weights + non-torch), 1.44 GiB for peak "
        "activation. Current kv cache memory in use is 56.2 GiB."
    )
    assert alone.non_torch_memory is None and alone.weights_and_non_torch is not None


def test_a_log_without_kv_lines_gets_one_line_naming_them():
    with pytest.raises(
        ValueError, match="Available KV cache memory.*GPU KV cache size.*# GPU blocks.*in use"
    ) as err:
        vllm_log.parse("INFO Starting vLLM API server on http://0.0.0.0:8000\n")
    assert "\n" not in str(err.value)


def test_tokens_fall_back_to_blocks_times_the_block_size():
    log = vllm_log.parse("INFO gpu_executor.py:122] # GPU blocks: 2575, # CPU blocks: 2048\n")
    assert log.tokens == 2575 * 16


# Logs whose model kvlab can size and which print both the KV memory and the tokens (or blocks) it held. The
# others are skipped for the reason the index gives: no model named, no KV memory printed, or a model outside
# the registry (Qwen3-14B, Qwen3-235B-A22B-FP8, a w8a8 Llama-3.1-70B).
SIZED = [
    e
    for e in INDEX
    if explain_vllm.registry_name(e["model"]) is not None
    and e["printed"]["available_kv_bytes"] is not None
    and (e["printed"]["kv_cache_tokens"] or e["printed"]["num_gpu_blocks"])
]


def test_enough_logs_are_sized():
    assert len(SIZED) >= 4


@pytest.mark.parametrize("entry", SIZED, ids=[e["slug"] for e in SIZED])
def test_tokens_from_the_printed_memory_equal_vllms_to_the_block(entry):
    """kvlab's exact per-token bytes turn vLLM's printed KV memory into its token count, to within one block
    once the memory's print rounding (half its last digit) is allowed for."""
    log = _log(entry)
    assert log.available_kv is not None and log.tokens is not None
    block = log.block_size or vllm_log.DEFAULT_BLOCK_SIZE
    per_token = sizing.kv_bytes_per_token(
        explain_vllm.registry_name(entry["model"]), explain_vllm.kv_dtype(log), tp=entry["tp"]
    )
    low = explain_vllm.tokens_from_memory(
        log.available_kv.bytes - log.available_kv.half_ulp_bytes, per_token, block
    )
    high = explain_vllm.tokens_from_memory(
        log.available_kv.bytes + log.available_kv.half_ulp_bytes, per_token, block
    )
    assert low - block <= log.tokens <= high + block
    # and the tolerance is tight: a cache of twice the bytes per token lands far outside it
    assert (
        not low - block
        <= explain_vllm.tokens_from_memory(log.available_kv.bytes, 2 * per_token, block)
        <= high + block
    )


def test_the_utilisation_is_read_from_the_cuda_graph_profiling_line():
    # vLLM >= 0.21 prints it only in its flag form (LMCache/LMCache#3430, tests/data/vllm_logs/)
    log = _log(next(e for e in INDEX if e["slug"] == "lmcache-3430-qwen3-8b-a5000-v0.21"))
    assert log.gpu_memory_utilization == 0.9764
