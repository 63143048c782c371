"""vLLM's defaults per release: the per-GPU batch table, the chunked-prefill-off rule, the version resolution, and
one table read everywhere.

Provenance (each release's wheel, read with `unzip` of vllm-X-cp38-abi3-manylinux*.whl):
- vllm/config/cache.py: gpu_memory_utilization Field(default=0.9) in 0.19.0, 0.92 in 0.20.0, 0.22.0 and 0.33.0;
  0.34.0: Field(default=None), `resolved_gpu_memory_utilization` 1.0 with enable_extensible_kv_cache else
  DEFAULT_GPU_MEMORY_UTILIZATION 0.92; DEFAULT_BLOCK_SIZE 16 through 0.33.0, 64 in 0.34.0.
- vllm/envs.py: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "0" in 0.19.0 and "1" from 0.20.0 (its log
  line says "default since v0.21.0"; the 0.20.0 wheel already sets "1").
- vllm/engine/arg_utils.py get_batch_defaults: 0.19.0, 0.20.0 and 0.22.0 have the >= 70 GiB row (not A100) and
  the rest; 0.33.0 and 0.34.0 add the >= 160 GiB row and keep GB10 off the big one (identical functions).
- 0.6.4 (v0): vllm/engine/arg_utils.py gpu_memory_utilization 0.90, max_num_seqs 256, block_size 16, chunked
  prefill on by default only when max_model_len > 32768; vllm/config.py SchedulerConfig: 512 tokens with
  chunked prefill, else max(max_model_len, 2048).
"""

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
    # 0.34.0: unset resolves to 1.0 with the extensible cache (on by default), 0.92 without it
    assert budget.BudgetSettings().gpu_memory_utilization == 1.0
    assert budget.BudgetSettings().block_size == 64
    assert budget.BudgetSettings(extensible_kv_cache=False).gpu_memory_utilization == 0.92
    assert (
        budget.BudgetSettings(vllm_version="0.33.0").gpu_memory_utilization == budget.GPU_MEMORY_UTILIZATION
    )
    assert budget.BudgetSettings(vllm_version="0.33.0").block_size == 16
    assert budget.BudgetSettings(vllm_version="0.19.0").gpu_memory_utilization == 0.9
    assert EngineConfig().block_size == vllm_defaults.BLOCK_SIZE
    assert EngineConfig().enable_chunked_prefill is vllm_defaults.ENABLE_CHUNKED_PREFILL
    assert "0.92" in VLLM_DEFAULTS["num_blocks"] and "arg_utils.py" in VLLM_DEFAULTS["max_num_seqs"]
    assert "1 with the extensible KV cache" in vllm_defaults.describe("gpu_memory_utilization")
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


@pytest.mark.parametrize(
    ("asked", "rule", "said"),
    [
        (None, "0.34.0", "vLLM 0.34.0"),
        ("0.34.0", "0.34.0", "vLLM 0.34.0"),
        ("0.34", "0.34.0", "vLLM 0.34.0"),
        ("0.33", "0.33.0", "vLLM 0.33.0"),
        ("0.27.1", "0.20.0", "nearest older release"),
        ("0.21.0", "0.20.0", "nearest older release"),
        ("0.19.1", "0.19.0", "nearest older release"),
        ("0.10.1.1", "0.19.0", "kvlab read no older one"),
        ("0.6.3", "0.6.4", "v0 engine's rule"),
        ("v0", "0.6.4", "v0 engine"),
        ("v1", "0.19.0", "v1 engine"),
        ("0.20.1rc1.dev16+g7a1eb8ac2", "0.20.0", "nearest older release"),
        ("0.40.0", "0.34.0", "nearest older release"),
    ],
)
def test_a_version_gets_the_nearer_older_rule_and_says_which(asked, rule, said):
    found = vllm_defaults.resolve(asked)
    assert found.release.version == rule and said in found.note


@pytest.mark.parametrize("bad", ["0.4.3", "latest", "1", ""])
def test_a_version_kvlab_cannot_place_is_one_line(bad):
    with pytest.raises(ValueError, match="vLLM|release") as err:
        vllm_defaults.resolve(bad)
    assert "\n" not in str(err.value)


def test_each_release_row_as_its_source_sets_it():
    rows = {r.version: r for r in vllm_defaults.RELEASES}
    assert [(r.sizing, r.gpu_memory_utilization, r.block_size) for r in rows.values()] == [
        ("v0", 0.9, 16),
        ("v1", 0.9, 16),
        ("v1+graphs", 0.92, 16),
        ("v1+graphs", 0.92, 16),
        ("measured", 1.0, 64),
    ]
    assert rows["0.34.0"].estimate_gpu_memory_utilization == 0.92 and rows["0.34.0"].extensible_kv_cache
    assert not rows["0.19.0"].estimate_cuda_graphs and rows["0.20.0"].estimate_cuda_graphs
    # v0 chunks prefill only above 32k tokens; v1 always
    assert not rows["0.6.4"].chunked_prefill(32768) and rows["0.6.4"].chunked_prefill(32769)
    assert rows["0.19.0"].chunked_prefill(1024)


def test_v0_and_early_v1_batch_defaults():
    v0 = vllm_defaults.resolve("v0").release
    on = vllm_defaults.batch_defaults(80 * GiB, "H100", release=v0, max_model_len=65536)
    assert (on.max_num_batched_tokens, on.max_num_seqs) == (512, 256) and "v0" in on.describe()
    off = vllm_defaults.batch_defaults(
        24 * GiB, "RTX 3090", release=v0, enable_chunked_prefill=False, max_model_len=20000
    )
    assert (off.max_num_batched_tokens, off.max_num_seqs) == (20000, 256)
    short = vllm_defaults.batch_defaults(
        24 * GiB, "", release=v0, enable_chunked_prefill=False, max_model_len=512
    )
    assert short.max_num_batched_tokens == 2048
    # 0.19.0 had no 160 GiB row: a B200 gets the 70 GiB row's 8,192 serve tokens, 0.33.0 16,384
    early = vllm_defaults.resolve("0.19.0").release
    assert vllm_defaults.batch_defaults(180 * GiB, "B200", release=early).max_num_batched_tokens == 8192
    assert vllm_defaults.batch_defaults(180 * GiB, "B200").max_num_batched_tokens == 16384
