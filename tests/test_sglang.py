"""SGLang's pool (kvlab.costs.sglang): its automatic static fraction as SGLang 0.5.23 computes it, the token pool, and
published SGLang logs (tests/data/sglang_logs/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlab import cli
from kvlab.costs import sglang
from kvlab.specs import hardware, sizing
from kvlab.units import GiB, MiB

LOGS = sorted((Path(__file__).parent / "data" / "sglang_logs").glob("*.json"))


def _config(log: dict):
    from transformers import AutoConfig

    fields = dict(log["config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.parametrize(
    "gpu_mib, tp, chunk, graph_bs",
    [(15360, 1, 2048, 8), (24564, 1, 4096, 48), (24564, 4, 4096, 160), (46068, 2, 4096, 32),
     (81559, 1, 8192, 256), (81559, 8, 8192, 512), (97871, 1, 8192, 256), (183359, 8, 16384, 512)],
)  # fmt: skip
def test_graph_defaults_by_memory_tier(gpu_mib, tp, chunk, graph_bs):
    assert sglang.graph_defaults(gpu_mib, tp) == sglang.GraphDefaults(chunk, graph_bs)


def test_the_automatic_fraction_on_an_h100():
    # 512 + 1.5 x 8192 + 1024 x 1/8 + 2 x 256 + 8 x 58 prefill-graph sizes = 13,904 MiB of 81,559
    assert len(sglang.prefill_graph_sizes(8192)) == 58
    assert sglang.reserved_mib(81559) == 13904
    assert sglang.auto_mem_fraction_static(81559) == 0.830
    # more ranks reserve more (1 GiB per 8 GPUs of the group, larger graph batches from TP 4)
    assert sglang.auto_mem_fraction_static(81559, tp=8) < sglang.auto_mem_fraction_static(81559, tp=2)


def test_reserve_by_tier():
    # a 24 GB card reserves 512 + 1.5 x 4096 + 128 + 2 x 48 + 8 x 50 prefill-graph sizes; the H20 (96 GB) sits in
    # the H100's tier of chunk and graph batch, so it reserves the same MiB and keeps a larger fraction
    assert len(sglang.prefill_graph_sizes(4096)) == 50
    assert sglang.reserved_mib(24564) == 512 + 6144 + 128 + 96 + 400
    assert sglang.reserved_mib(97871) == sglang.reserved_mib(81559) == 13904
    assert sglang.auto_mem_fraction_static(97871) == round(1 - 13904 / 97871, 3) == 0.858
    with pytest.raises(ValueError, match="gpu_mem_mib"):
        sglang.graph_defaults(0)


def test_the_pool_is_the_static_fraction_less_the_weights():
    pool = sglang.sglang_pool("meta-llama/Llama-3.1-8B", "H100-SXM", mem_fraction_static=0.9)
    free = pool.capacity_bytes - pool.runtime_bytes
    assert pool.pre_load_free_bytes == free
    assert pool.rest_bytes == pytest.approx(free * 0.9 - pool.weight_bytes, abs=1)
    assert pool.cell_bytes == sizing.kv_bytes_per_token("meta-llama/Llama-3.1-8B", "bf16") == 128 * 1024
    assert pool.max_total_num_tokens == pool.rest_bytes // pool.cell_bytes
    assert pool.max_sequences(8192) == pool.max_total_num_tokens // 8192
    # a larger static fraction gives the cache more, token for token
    larger = sglang.sglang_pool("meta-llama/Llama-3.1-8B", "H100-SXM", mem_fraction_static=0.95)
    extra = larger.max_total_num_tokens - pool.max_total_num_tokens
    assert extra == pytest.approx(0.05 * free / pool.cell_bytes, abs=2)


def test_tensor_parallel_splits_weights_and_heads():
    one = sglang.sglang_pool("meta-llama/Llama-3.1-70B", "H100-SXM", tp=4, mem_fraction_static=0.9)
    assert one.cell_bytes == sizing.kv_bytes_per_token("meta-llama/Llama-3.1-70B", "bf16", tp=4)
    assert one.weight_bytes == sizing.weight_bytes_per_gpu("meta-llama/Llama-3.1-70B", "bf16", tp=4)
    assert one.fits


def test_weights_larger_than_the_fraction_do_not_fit():
    pool = sglang.sglang_pool("meta-llama/Llama-3.1-70B", "H100-SXM", mem_fraction_static=0.5)
    assert not pool.fits and pool.max_total_num_tokens == 0
    # SGLang's "Raise --mem-fraction-static above ..." figure, and the line that names it
    assert pool.min_mem_fraction_static() > 0.5
    assert "raise --mem-fraction-static above" in pool.lines()[-1]


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        sglang.sglang_pool("google/gemma-2-9b", "H100-SXM")


@pytest.mark.parametrize("fraction", [0, 1, 1.2, -0.1])
def test_bad_fractions_are_refused(fraction):
    with pytest.raises(ValueError, match="mem_fraction_static"):
        sglang.sglang_pool("meta-llama/Llama-3.1-8B", "H100-SXM", mem_fraction_static=fraction)


@pytest.mark.parametrize("log_path", LOGS, ids=[p.stem for p in LOGS])
def test_published_logs_bytes_per_token(log_path):
    # "#tokens: N, K size: X GB, V size: Y GB": SGLang's cell size is kvlab's KV bytes per token on one rank
    log = json.loads(log_path.read_text())
    assert log["source"].startswith("https://github.com/")
    line = next(text for text in log["sglang_lines"] if "KV Cache is allocated" in text)
    allocated = sglang.parse_allocated(line)
    per_token = sizing.kv_bytes_per_token(_config(log), log["kv_dtype"], tp=log["tp"])
    # the sizes are printed to 0.01 GiB each
    assert allocated.bytes_per_token() == pytest.approx(per_token, abs=0.01 * GiB / allocated.tokens)
    assert allocated.k_gib == pytest.approx(allocated.tokens * per_token / 2 / GiB, abs=0.005)


def test_published_log_budget_from_free_memory():
    # sgl-project/sglang#18263: after loading, avail 230.20 GB with 56.98 GB of weights, fraction 0.911: SGLang's
    # budget is free - (free + weights) x (1 - fraction), which the PR prints as 204.63 GB
    log = json.loads((LOGS[0].parent / "sglang_18263_qwen3_30b_a3b.json").read_text())
    end = re.search(r"avail mem=([\d.]+) GB, mem usage=([\d.]+) GB", log["sglang_lines"][0])
    assert end is not None
    after, weights = float(end[1]) * GiB, float(end[2]) * GiB
    printed = int(re.search(r"available_bytes (\d+)", log["sglang_lines"][1])[1])  # type: ignore[index]
    pool = sglang.SGLangPool(
        capacity_bytes=int(after + weights),
        mem_fraction_static=log["mem_fraction_static"],
        runtime_bytes=0,
        weight_bytes=int(weights),
        cell_bytes=sizing.kv_bytes_per_token(_config(log), "bf16"),
    )
    # two printed decimals of GiB on each input
    assert pool.rest_bytes == pytest.approx(printed, abs=0.02 * GiB)


def test_vllm_and_sglang_two_times_apart():
    # vllm-project/vllm#21348: the same bytes per token, a budget twice as large under SGLang
    log = json.loads((LOGS[0].parent / "vllm_21348_qwen3_235b_tp4.json").read_text())
    sgl = sglang.parse_allocated(log["sglang_lines"][0])
    vllm_tokens = int(log["vllm_lines"][1].split(": ")[1].split()[0].replace(",", ""))
    vllm_gib = float(log["vllm_lines"][0].split(": ")[1].split()[0])
    assert sgl.tokens / vllm_tokens == pytest.approx(2.05, abs=0.01)
    assert vllm_gib * GiB / vllm_tokens == pytest.approx(sgl.bytes_per_token(), rel=0.02)


def test_parse_allocated_rejects_other_lines():
    with pytest.raises(ValueError, match="KV Cache is allocated"):
        sglang.parse_allocated("GPU KV cache size: 178,880 tokens")


def test_kvlab_size_engine_sglang(capsys):
    assert (
        cli.main(["size", "meta-llama/Llama-3.1-8B", "--gpu", "H20", "--engine", "sglang", "--context", "8k"])
        == 0
    )
    out = capsys.readouterr().out
    pool = sglang.sglang_pool("meta-llama/Llama-3.1-8B", "H20")
    assert "SGLang 0.5.23's pool" in out and f"{pool.max_total_num_tokens:,}" in out
    assert f"{pool.mem_fraction_static:g}, SGLang 0.5.23's choice for H20" in out
    assert cli.main(["size", "meta-llama/Llama-3.1-8B", "--engine", "sglang"]) == 2
    assert "give --gpu" in capsys.readouterr().err
    assert cli.main(["size", "google/gemma-2-9b", "--gpu", "H100-SXM", "--engine", "sglang"]) == 2
    given = ["size", "meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--engine", "sglang"]
    assert cli.main([*given, "--mem-fraction-static", "0.8"]) == 0
    assert "(0.8, given)" in capsys.readouterr().out


def test_the_driver_total_drives_the_choice():
    # SGLang reads the device's total memory in MiB: the spec table's driver-reported figure
    h20 = hardware.get("H20")
    pool = sglang.sglang_pool("meta-llama/Llama-3.1-8B", h20)
    assert pool.mem_fraction_static == sglang.auto_mem_fraction_static(h20.memory_bytes / MiB)
