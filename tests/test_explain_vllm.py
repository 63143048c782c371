"""`kvlab explain-vllm LOGFILE` on every published log in tests/data/vllm_logs/, and on a bad one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab import cli, units
from kvlab.costs import budget
from kvlab.planning import explain_vllm, vllm_log
from kvlab.specs import hardware

DATA = Path(__file__).parent / "data" / "vllm_logs"
INDEX = json.loads((DATA / "index.json").read_text())


@pytest.mark.parametrize("entry", INDEX, ids=[e["slug"] for e in INDEX])
def test_every_collected_log_is_explained(entry, capsys):
    assert cli.main(["explain-vllm", str(DATA / f"{entry['slug']}.log")]) == 0
    out = capsys.readouterr().out
    for term in ("weights", "non-torch memory", "activation peak", "available KV memory", "lever:"):
        assert term in out
    tokens = entry["printed"]["kv_cache_tokens"]
    if tokens is not None:
        assert f"{tokens:,} tokens" in out


def test_a_model_passed_on_the_command_line_sizes_a_log_without_a_config_line(capsys):
    log = DATA / "rtx3090-llama31-8b-20k.log"
    assert cli.main(["explain-vllm", str(log), "--model", "meta-llama/Llama-3.1-8B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "KV tokens: vLLM 31,232; kvlab" in out
    # the RTX 3090's printed total lets kvlab put its own available-memory figure beside vLLM's
    row = next(line for line in out.splitlines() if "available KV memory" in line)
    assert row.count("GiB") == 2


def test_the_lever_names_the_largest_printed_term(capsys):
    cli.main(["explain-vllm", str(DATA / "rtx3090-llama31-8b-20k.log")])
    assert "tensor-parallel-size (the weights are the largest term)" in capsys.readouterr().out


def test_concurrency_is_tokens_over_max_seq_len(capsys):
    cli.main(["explain-vllm", str(DATA / "vllm-practice-llama31-8b-40k.log")])
    assert "41,200 tokens / 40,960 per request = 1.01x (vLLM printed 1.01x)" in capsys.readouterr().out


def test_sliding_window_layers_are_charged_only_their_window():
    full = explain_vllm.per_request_bytes("meta-llama/Llama-3.1-8B", 32768, 8192, None, 1)
    assert full == 32768 * 131072
    gemma = explain_vllm.per_request_bytes("google/gemma-2-9b", 8192, 512, None, 1)
    every_layer = 8192 * 42 * 2 * 8 * 256 * 2  # 42 layers, 8 KV heads of 256, K and V, bf16
    assert gemma < every_layer


def test_a_bad_log_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.log"
    bad.write_text("INFO: Application startup complete.\n")
    assert cli.main(["explain-vllm", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvlab: error: not a vLLM start-up log") and "\n" not in err


def test_a_missing_file_exits_2_with_one_line(tmp_path, capsys):
    assert cli.main(["explain-vllm", str(tmp_path / "absent.log")]) == 2
    assert "cannot read" in capsys.readouterr().err


def _row(out: str, term: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(term))


def test_kvlabs_column_is_kvlab_size_gpus_arithmetic_at_the_logs_settings(capsys):
    # A v1 log (0.10.2, enforce_eager, no utilisation printed) read as if on an H100 SXM: kvlab's terms must be
    # memory_budget's at that release's defaults for the GPU (0.19.0's rule, the nearest kvlab read: 0.9), with
    # the log's eager mode and max_model_len.
    h100 = hardware.get("H100-SXM")
    log = vllm_log.parse((DATA / "jetson-thor-llama31-8b-v0.10.2.log").read_text())
    found = explain_vllm.estimate(log, "meta-llama/Llama-3.1-8B", h100.memory_bytes)
    expected = budget.BudgetSettings(
        enforce_eager=True, max_model_len=131072, vllm_version="0.10.2"
    ).memory_budget("meta-llama/Llama-3.1-8B", h100)
    assert expected.gpu_memory_utilization == 0.9
    assert found.memory.kv_headroom_bytes == expected.kv_headroom_bytes
    assert (found.max_num_batched_tokens, found.max_num_seqs) == (8192, 1024)  # vLLM serve on a >= 70 GiB GPU
    gib = h100.memory_bytes / 2**30
    assert (
        cli.main(
            ["explain-vllm", str(DATA / "jetson-thor-llama31-8b-v0.10.2.log"), "--gpu-memory-gib", str(gib)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert units.format_bytes(expected.kv_headroom_bytes) in _row(out, "available KV memory")
    assert units.format_bytes(expected.runtime_bytes) in _row(out, "non-torch memory")
    assert units.format_bytes(expected.peak_bytes) in _row(out, "activation peak")


def test_every_kvlab_figure_the_model_does_not_fix_is_labelled_an_estimate(capsys):
    cli.main(["explain-vllm", str(DATA / "vllm-practice-llama31-8b-40k.log"), "--gpu-memory-gib", "79.6"])
    out = capsys.readouterr().out
    for term in ("driver reserve", "non-torch memory", "activation peak"):
        assert "estimate" in _row(out, term), term


def test_a_v0_log_is_charged_no_cuda_graphs_and_a_whole_prompt_profiled(capsys):
    # v0 did not subtract graph memory; with chunked prefill off (max_model_len 20,000 <= 32k) it profiles
    # one whole 20,000-token prompt, the length the concurrency line prints.
    log = vllm_log.parse((DATA / "rtx3090-llama31-8b-20k.log").read_text())
    found = explain_vllm.estimate(log, "meta-llama/Llama-3.1-8B")
    assert found.memory.cuda_graph_bytes == 0
    assert found.max_num_batched_tokens == 20000
    assert found.settings.gpu_memory_utilization == 0.9  # printed
    assert found.memory.driver_reserved_bytes == 0  # the log prints CUDA's own total
    # kvlab's pool stays below what that vLLM found (3.81 GiB): the estimates are on the high side
    assert 0 < found.memory.kv_headroom_bytes < log.available_kv.bytes


# The memory lines of a public vLLM 0.10.2 start-up log: Qwen3-Next-80B-A3B-Instruct on two H200s, TP=2, bf16,
# prefix caching off (dated 10-23; its shell prompt names a "LegalAI-DataPipeline" project; found through the
# code-search index, which did not record its repository). The same figures test kvlab.costs.hybrid_pages.
QWEN3_NEXT_LOG = """\
INFO 10-23 15:10:10 [api_server.py:1896] vLLM API server version 0.10.2
INFO 10-23 15:10:22 [config.py:390] Setting attention block size to 544 tokens to ensure that attention page \
size is >= mamba page size.
INFO 10-23 15:10:22 [config.py:411] Padding mamba page size by 1.49% to ensure that mamba page size and \
attention page size are exactly equal.
INFO 10-23 15:10:29 [core.py:76] Initializing a V1 LLM engine (v0.10.2) with config: \
model='/data/models/Qwen3-Next-80B-A3B-Instruct', dtype=torch.bfloat16, max_seq_len=262144, \
tensor_parallel_size=2, pipeline_parallel_size=1, kv_cache_dtype=auto, enable_prefix_caching=False
INFO 10-23 15:14:18 [gpu_model_runner.py:2392] Model loading took 74.2812 GiB and 215.831224 seconds
INFO 10-23 15:14:30 [gpu_worker.py:298] Available KV cache memory: 44.59 GiB
INFO 10-23 15:14:30 [kv_cache_utils.py:1028] GPU KV cache size: 973,760 tokens
INFO 10-23 15:14:30 [kv_cache_utils.py:1032] Maximum concurrency for 262,144 tokens per request: 14.77x
"""


def test_a_hybrid_log_is_explained_page_by_page(tmp_path, capsys):
    log = tmp_path / "qwen3-next.log"
    log.write_text(QWEN3_NEXT_LOG)
    parsed = vllm_log.parse(QWEN3_NEXT_LOG)
    assert (parsed.hybrid_block_size, parsed.state_padding_percent) == (544, 1.49)
    assert cli.main(["explain-vllm", str(log), "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "attention block vLLM 544 tokens, kvlab 544; state page padded by vLLM 1.49%, kvlab 1.49%" in out
    assert "KV tokens: vLLM 973,760; kvlab 973,760" in out
    assert "= 14.77x (vLLM printed 14.77x)" in out
    assert "weights                    74.3 GiB" in out
    # Without the model, no quotient of tokens by length passes for vLLM's figure
    assert cli.main(["explain-vllm", str(log)]) == 0
    out = capsys.readouterr().out
    assert "a hybrid model (vLLM set its attention block to 544 tokens)" in out
    assert "3.71x" not in out


# vLLM 0.34.0's start-up lines, written with the format strings of vllm/v1/worker/extensible_kv_cache.py
# (measure_kv_cache_blocks, extend_kv_cache) and vllm/v1/worker/gpu_worker.py (the graph pool line).
LOG_034 = """\
INFO [__init__.py:200] Initializing a V1 LLM engine (v0.34.0) with config: model='meta-llama/Llama-3.1-8B', \
dtype=torch.bfloat16, max_seq_len=8192, tensor_parallel_size=1, enforce_eager=False
INFO [gpu_worker.py:800] Available KV cache memory: 60.12 GiB
INFO [gpu_worker.py:1113] CUDA graph pool memory: 0.84 GiB (actual), 1.02 GiB (estimated), difference: 0.18 GiB (21.4%).
WARNING [extensible_kv_cache.py:670] gpu_memory_utilization=0.92 caps this instance at 72.85 GiB, keeping 4.2 GiB \
of free device memory out of the KV cache. The extensible KV cache is sized from the memory measured after warmup
INFO [extensible_kv_cache.py:690] Memory after warmup: 62.5 GiB free, 0.02 GiB committed to the KV cache, 2.9 GiB \
kept for transient activations (2.9 GiB allocated at peak, 2.1 GiB of torch reservation growth); 6814 KV cache \
blocks (53.23 GiB) fit within the requested 72.85 GiB. Torch may reserve up to 20.1 GiB.
INFO [extensible_kv_cache.py:540] Extended KV cache to 6814 blocks (53.23 GiB).
INFO [kv_cache_utils.py:1000] GPU KV cache size: 436,096 tokens
"""


def test_a_034_log_is_explained_term_by_term_with_its_lever(tmp_path, capsys):
    path = tmp_path / "v034.log"
    path.write_text(LOG_034)
    log = vllm_log.parse(LOG_034)
    assert log.measured and log.extended_blocks == 6814 and log.graph_actual is not None
    assert cli.main(["explain-vllm", str(path), "--gpu-memory-gib", "79.6"]) == 0
    out = capsys.readouterr().out
    # headroom = 62.5 + 0.02; margin = max(1, 0.75 × 2.9) = 2.175; 4.2 GiB withheld by the utilisation:
    # KV = 62.52 - 2.175 - 2.9 - 4.2 = 53.245 GiB, the 6,814 blocks of 8 MiB (53.23 GiB) vLLM printed
    assert "headroom             62.52 GiB" in out and "- margin             2.17 GiB" in out
    assert "- utilisation cap    4.20 GiB" in out
    assert "= KV                 53.24 GiB" in out and "6,814 blocks (53.23 GiB), extended to 6,814" in out
    assert "measured KV pool" in out and "only the address space reserved" in out
    lever = next(line for line in out.splitlines() if "lever:" in line)
    assert "leave gpu_memory_utilization unset" in lever and "4.20 GiB" in lever


def test_a_034_log_without_its_measured_lines_says_what_is_missing(tmp_path, capsys):
    text = "\n".join(
        line for line in LOG_034.splitlines() if "Memory after warmup" not in line and "blocks (" not in line
    )
    path = tmp_path / "partial.log"
    path.write_text(text + "\n")
    assert cli.main(["explain-vllm", str(path), "--gpu-memory-gib", "79.6"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "lacks" in line]
    assert len(lines) == 1 and "'Memory after warmup: ...'" in lines[0] and "only the reservation" in lines[0]


def test_a_log_mixing_versions_gets_one_line(tmp_path, capsys):
    mixed = LOG_034 + "INFO worker.py:1 # GPU blocks: 1952, # CPU blocks: 2048\n"
    path = tmp_path / "mixed.log"
    path.write_text(mixed)
    assert cli.main(["explain-vllm", str(path), "--gpu-memory-gib", "79.6"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "mixed versions" in line]
    assert len(lines) == 1 and "# GPU blocks" in lines[0] and "Memory after warmup" in lines[0]
    # 0.34's lines in a log that says it is 0.33
    older = LOG_034.replace("(v0.34.0)", "(v0.33.0)")
    (tmp_path / "older.log").write_text(older)
    assert cli.main(["explain-vllm", str(tmp_path / "older.log"), "--gpu-memory-gib", "79.6"]) == 0
    assert "pass --vllm-version 0.34" in capsys.readouterr().out


def test_explain_takes_a_version_for_a_log_that_prints_none(capsys):
    log = DATA / "rtx3090-llama31-8b-20k.log"
    assert cli.main(["explain-vllm", str(log), "--vllm-version", "0.6.4"]) == 0
    with pytest.raises(SystemExit) as err:
        cli.main(["explain-vllm", str(log), "--vllm-version", "nonsense"])
    assert err.value.code == 2 and "not a vLLM release" in capsys.readouterr().err
