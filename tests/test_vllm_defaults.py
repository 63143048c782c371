"""vLLM 0.33.0's defaults: the per-GPU batch table, the chunked-prefill-off rule, and one table read everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlab.costs import budget
from kvlab.engine.config import VLLM_DEFAULTS, EngineConfig
from kvlab.specs import hardware, vllm_defaults

GiB = 2**30
SRC = Path(vllm_defaults.__file__).parent


@pytest.mark.parametrize(
    ("gpu", "usage", "tokens", "seqs"),
    [
        ("H100-SXM", "serve", 8192, 1024),
        ("H100-SXM", "llm", 16384, 1024),
        ("A100-80GB", "serve", 2048, 256),  # kept on the small tier by name (vLLM PR #17885)
        ("A100-80GB", "llm", 8192, 256),
        ("L4", "serve", 2048, 256),
        ("H200", "serve", 8192, 1024),
    ],
)
def test_batch_defaults_per_gpu_and_usage_context(gpu, usage, tokens, seqs):
    spec = hardware.get(gpu)
    got = vllm_defaults.batch_defaults(spec.memory_bytes, spec.name, usage)
    assert (got.max_num_batched_tokens, got.max_num_seqs) == (tokens, seqs)


def test_largest_tier_from_160_gib():
    got = vllm_defaults.batch_defaults(180 * GiB, "NVIDIA B200", "serve")
    assert (got.max_num_batched_tokens, got.max_num_seqs) == (16384, 1024)
    assert vllm_defaults.batch_tier(70 * GiB - 1).name == "other"


def test_chunked_prefill_off_takes_a_whole_prompt():
    off = vllm_defaults.batch_defaults(24 * GiB, "L4", enable_chunked_prefill=False, max_model_len=20000)
    assert off.max_num_batched_tokens == 20000 and "chunked prefill off" in off.describe()
    short = vllm_defaults.batch_defaults(24 * GiB, "L4", enable_chunked_prefill=False, max_model_len=512)
    assert short.max_num_batched_tokens == 2048  # never below the tier's figure
    # At most max_num_seqs whole contexts, and never more sequences than tokens.
    tiny = vllm_defaults.batch_defaults(24 * GiB, "L4", max_model_len=4)
    assert (tiny.max_num_batched_tokens, tiny.max_num_seqs) == (1024, 256)


@pytest.mark.parametrize(
    "kwargs",
    [dict(usage_context="batch"), dict(enable_chunked_prefill=False), dict(max_model_len=0)],
)
def test_bad_input(kwargs):
    with pytest.raises(ValueError):
        vllm_defaults.batch_defaults(24 * GiB, "L4", **kwargs)


def test_engine_budget_and_cli_read_the_table():
    assert budget.GPU_MEMORY_UTILIZATION == budget.BudgetSettings().gpu_memory_utilization == 0.92
    assert EngineConfig().block_size == vllm_defaults.BLOCK_SIZE
    assert EngineConfig().enable_chunked_prefill is vllm_defaults.ENABLE_CHUNKED_PREFILL
    assert "0.92" in VLLM_DEFAULTS["num_blocks"] and "arg_utils.py" in VLLM_DEFAULTS["max_num_seqs"]
    assert vllm_defaults.describe("gpu_memory_utilization") == "0.92 (vllm/config/cache.py)"
    with pytest.raises(ValueError, match="no vLLM default"):
        vllm_defaults.describe("swap_space")


# A vLLM default typed outside the table: a utilisation literal, or a line that calls a number vLLM's default.
UTILISATION = re.compile(r"(gpu_memory_)?utili[sz]ation\b.*\b0\.92?\b(?!\d)", re.I)
CALLED_DEFAULT = re.compile(
    r"vllm.*default.*\b(0\.9\d*|128|256|512|1024|2048|8192|16384)\b|\b(0\.9\d*|256|8192)\b.*vllm.*default",
    re.I,
)


def test_no_other_module_types_a_vllm_default():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "vllm_defaults.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if UTILISATION.search(line) or CALLED_DEFAULT.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not offenders, "vLLM defaults typed outside kvlab.specs.vllm_defaults:\n" + "\n".join(offenders)


def test_the_check_finds_a_typed_default():
    assert UTILISATION.search("GPU_MEMORY_UTILIZATION = 0.9  # share of memory")
    assert CALLED_DEFAULT.search("max_num_seqs: int = 256  # vLLM's default --max-num-seqs")
    assert not CALLED_DEFAULT.search("sigma=0.9")
