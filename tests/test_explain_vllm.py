"""`kvlab explain-vllm LOGFILE` on every published log in tests/data/vllm_logs/, and on a bad one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab import cli, explain_vllm

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
