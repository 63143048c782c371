"""Speculative decoding in the memory budget (kvlab issue 25, item 4): the drafter's cache layers and weights, and
the lookahead slots vLLM reserves per running sequence (`kvlab.specs.sizing`'s speculative section)."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab import cli
from kvlab.costs import budget
from kvlab.costs.workloads import Workload
from kvlab.planning import plan as P
from kvlab.specs import sizing

LLAMA8 = "meta-llama/Llama-3.1-8B"
LLAMA70 = "meta-llama/Llama-3.1-70B"
# Llama-3.1-8B by hand: 32 layers × (K + V) × 8 KV heads × 128 head_dim × 2 B (bf16).
TARGET_8B = 32 * 2 * 8 * 128 * 2  # 131,072 B
HEAD_LAYER_8B = 2 * 8 * 128 * 2  # one EAGLE layer of that shape: 4,096 B
# One Llama-3.1-8B decoder layer's parameters: q and o (4096²), k and v (4096 × 1024), gate, up and down
# (4096 × 14336) and two RMSNorms (4096); EAGLE's fc fuses embedding and hidden state: 2 × 4096².
LAYER_PARAMS_8B = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
FC_PARAMS_8B = 2 * 4096 * 4096


def test_eagle_head_per_token_bytes_hand_worked():
    assert (
        sizing.speculative_kv_bytes_per_token(LLAMA8, 3, draft_layers=1)
        == TARGET_8B + HEAD_LAYER_8B
        == 135_168
    )
    spec = sizing.speculation(LLAMA8, 3, draft_layers=1)
    assert spec is not None and spec.method == "eagle" and spec.lookahead_slots == 6
    assert sizing.draft_kv_bytes_per_token(LLAMA8, spec) == 4096
    assert (
        sizing.draft_kv_bytes_per_token(LLAMA8, dataclasses.replace(spec, draft_layers=2), "fp8") == 2 * 2048
    )
    assert sizing.draft_weight_bytes_per_gpu(LLAMA8, spec, "bf16") == (LAYER_PARAMS_8B + FC_PARAMS_8B) * 2


def test_registry_draft_model_per_token_bytes_hand_worked():
    # Llama-3.1-70B (80 layers, 8 KV heads × 128) drafted by Llama-3.1-8B: the same 128,256-token vocabulary.
    target_70b = 80 * 2 * 8 * 128 * 2
    assert sizing.speculative_kv_bytes_per_token(LLAMA70, 4, LLAMA8) == target_70b + TARGET_8B == 458_752
    # At tp=4 each GPU keeps 2 of the 8 KV heads of both models (the drafter runs at the target's tp).
    assert sizing.speculative_kv_bytes_per_token(LLAMA70, 4, LLAMA8, tp=4) == (target_70b + TARGET_8B) // 4
    spec = sizing.speculation(LLAMA70, 4, LLAMA8, tp=4)
    assert spec is not None and spec.method == "draft_model"
    assert sizing.draft_weight_bytes_per_gpu(LLAMA70, spec, "bf16", tp=4) == sizing.weight_bytes_per_gpu(
        LLAMA8, "bf16", tp=4
    )


def test_eagle_pool_and_concurrency_on_h100():
    # vLLM 0.33's estimate rule and blocks of 16, whose arithmetic the counts below work by hand
    plain = budget.memory_budget(LLAMA8, "H100-SXM", vllm_version="0.33.0")
    eagle = budget.memory_budget(LLAMA8, "H100-SXM", speculative=3, draft_layers=1, vllm_version="0.33.0")
    head_weights = (LAYER_PARAMS_8B + FC_PARAMS_8B) * 2
    assert eagle.draft_weight_bytes == head_weights
    assert eagle.kv_headroom_bytes == plain.kv_headroom_bytes - head_weights
    assert eagle.kv_bytes_per_token == 135_168 and eagle.target_kv_bytes_per_token == TARGET_8B
    assert eagle.num_blocks == (plain.kv_headroom_bytes - head_weights) // (16 * 135_168)
    assert eagle.num_blocks < plain.num_blocks
    # 8k tokens + 6 lookahead slots take 513 blocks, not 512 (max_model_len is the model's 131,072).
    assert eagle.blocks_per_sequence(8192) == 513 and plain.blocks_per_sequence(8192) == 512
    assert eagle.max_sequences(8192) == eagle.num_blocks // 513 < plain.max_sequences(8192)
    # Everything else in the budget is the plain one's.
    for name in ("weight_bytes", "activation_bytes", "sampler_bytes", "cuda_graph_bytes", "runtime_bytes"):
        assert getattr(eagle, name) == getattr(plain, name)


def test_draft_model_pool_at_tp4():
    plain = budget.memory_budget(LLAMA70, "H100-SXM", tp=4, vllm_version="0.33.0")
    spec = budget.memory_budget(LLAMA70, "H100-SXM", tp=4, speculative=4, draft=LLAMA8, vllm_version="0.33.0")
    draft_weights = sizing.weight_bytes_per_gpu(LLAMA8, "bf16", tp=4)
    assert spec.draft_weight_bytes == draft_weights
    assert spec.num_blocks == (plain.kv_headroom_bytes - draft_weights) // (16 * (81_920 + 32_768))
    assert spec.lookahead_slots == 8 and spec.blocks_per_sequence(8192) == 513


def test_lookahead_slots_alone_change_max_concurrency():
    """The same pool, with and without 2K lookahead slots: whole blocks per sequence decide."""
    kw = dict(
        capacity_bytes=10 * 2**30,
        gpu_memory_utilization=1.0,
        runtime_bytes=0,
        weight_bytes=0,
        activation_bytes=0,
        block_size=16,
        kv_bytes_per_token=2**20,
    )
    plain = budget.MemoryBudget(**kw)
    ahead = budget.MemoryBudget(**kw, speculative_tokens=3, lookahead_slots=6)
    assert plain.num_blocks == ahead.num_blocks == 640
    assert plain.max_sequences(16) == 640 and ahead.max_sequences(16) == 320  # 22 slots: 2 blocks
    assert plain.max_sequences(10) == ahead.max_sequences(10) == 640  # 16 slots: still 1 block
    # vLLM never allocates past max_model_len: a sequence at the limit holds no lookahead.
    capped = dataclasses.replace(ahead, max_model_len=16)
    assert capped.max_sequences(16) == 640 and capped.slots_per_sequence(16) == 16
    assert sizing.speculative_blocks_per_sequence(16, 3, 16) == 2
    assert sizing.speculative_blocks_per_sequence(16, 3, 16, max_model_len=16) == 1
    assert sizing.speculative_blocks_per_sequence(8192, 0, 16) == 512


def test_speculation_off_is_todays_budget_exactly():
    cases: list[tuple[str, str, dict]] = [
        (LLAMA8, "H100-SXM", {}),
        (LLAMA8, "L4", dict(kv_dtype="fp8")),
        (LLAMA70, "H100-SXM", dict(tp=2)),
    ]
    for model, gpu, kw in cases:
        before = budget.memory_budget(model, gpu, **kw)
        assert budget.memory_budget(model, gpu, speculative=0, draft=None, draft_layers=0, **kw) == before
        assert before.lines(8192) == budget.memory_budget(model, gpu, speculative=0, **kw).lines(8192)
    assert budget.BudgetSettings(speculative=0) == budget.BudgetSettings()
    assert sizing.speculative_kv_bytes_per_token(LLAMA8, 0) == sizing.kv_bytes_per_token(LLAMA8)
    assert sizing.speculation(LLAMA8, 0) is None
    text = cli.size_report(LLAMA8, 8192, 1, budget.BudgetSettings(speculative=0), gpu="H100-SXM")
    assert text == cli.size_report(LLAMA8, 8192, 1, gpu="H100-SXM") and "draft" not in text


def test_estimates_are_labelled():
    lines = budget.memory_budget(
        LLAMA8, "H100-SXM", speculative=3, draft_layers=1, vllm_version="0.33.0"
    ).lines(8192)
    (weights,) = [line for line in lines if "- draft weights" in line]
    (per_token,) = [line for line in lines if "KV per token" in line]
    assert "estimate" in weights and "estimate" in per_token and "4,096 B" in per_token
    assert any("not counted" in line and "drafter" in line for line in lines)
    assert any("scheduler.py" in line for line in lines)
    assert any("+ 6 speculative slots (513 blocks each)" in line for line in lines)
    exact = budget.memory_budget(LLAMA70, "H100-SXM", tp=4, speculative=2, draft=LLAMA8).lines(8192)
    assert "estimate" not in next(line for line in exact if "- draft weights" in line)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(speculative=-1, draft_layers=1), "speculative tokens \\(K\\) must be >= 0, got -1"),
        (dict(draft=LLAMA8), "needs speculative tokens"),
        (dict(draft_layers=1), "needs speculative tokens"),
        (dict(speculative=3), "needs a drafter"),
        (dict(speculative=3, draft=LLAMA8, draft_layers=1), "not both"),
        (dict(speculative=3, draft="Qwen/Qwen2.5-0.5B"), "vocabulary of 151,936 tokens .* 128,256"),
        (dict(speculative=3, draft="no/such-draft"), "draft no/such-draft cannot be sized by kvlab"),
        (dict(speculative=3, draft_layers=1, pp=2), "pp=1 only"),
        (dict(speculative=3, draft_layers=-2), "draft_layers must be an integer >= 0"),
    ],
    ids=[
        "negative-k",
        "draft-no-k",
        "layers-no-k",
        "k-no-drafter",
        "both",
        "vocab",
        "unknown",
        "pp",
        "neg-layers",
    ],
)
def test_bad_speculative_input_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        budget.memory_budget(LLAMA8, "H100-SXM", **kwargs)
    assert "\n" not in str(err.value)


def test_draft_must_shard_at_the_targets_tp():
    # Llama-3.1-8B drafting Llama-3.1-70B at tp=16: the 8B's 32 query heads divide, its 8 KV heads copy; at
    # tp=64 the 70B's 64 heads divide but the 8B's 32 do not.
    assert sizing.speculation(LLAMA70, 2, LLAMA8, tp=16) is not None
    with pytest.raises(ValueError, match="draft meta-llama/Llama-3.1-8B at the target's tp=64"):
        sizing.speculation(LLAMA70, 2, LLAMA8, tp=64)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--draft", LLAMA8], "needs speculative tokens: give --speculative K >= 1"),
        (["--speculative", "2", "--draft", "Qwen/Qwen2.5-0.5B"], "same vocabulary size"),
        (["--speculative", "2"], "needs a drafter"),
    ],
)
def test_cli_bad_speculative_input(capsys, argv, message):
    for command in (
        ["size", LLAMA8, "--gpu", "H100-SXM"],
        ["plan", LLAMA8, "--gpu", "H100-SXM", "--rate", "1/s"],
    ):
        assert cli.main([*command, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvlab: error:") and message in err[0]


def test_cli_negative_k_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["size", LLAMA8, "--speculative", "-3", "--draft-layers", "1"])
    assert stop.value.code == 2
    assert "argument --speculative: expected an integer >= 0, got '-3'" in capsys.readouterr().err


def test_cli_size_with_speculation(capsys):
    argv = [
        "size",
        LLAMA8,
        "--context",
        "8k",
        "--gpu",
        "H100-SXM",
        "--speculative",
        "3",
        "--draft-layers",
        "1",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "draft        K=3, drafter an EAGLE-style head of 1 layer(s)" in out
    assert "+ draft KV 4 KiB (4,096 B) per token" in out and "- draft weights" in out
    plain = budget.memory_budget(LLAMA8, "H100-SXM")
    eagle = budget.memory_budget(LLAMA8, "H100-SXM", speculative=3, draft_layers=1)
    assert f"room for {eagle.max_sequences(8192)})" in out and eagle.max_sequences(
        8192
    ) < plain.max_sequences(8192)


def test_plan_pool_shrinks_and_says_throughput_is_not_speculative():
    kw = dict(
        context=8192,
        workload=Workload(rate=2.0, num_requests=20, mean_input=200, mean_output=20),
        targets=P.Targets(ttft_ms=500, itl_ms=50),
        dp=1,
    )
    plain = P.plan(LLAMA8, "H100-SXM", **kw)
    eagle = P.plan(LLAMA8, "H100-SXM", speculative=3, draft_layers=1, **kw)
    expected = budget.memory_budget(LLAMA8, "H100-SXM", speculative=3, draft_layers=1)
    assert eagle.budget == dataclasses.replace(expected, max_model_len=8192)
    assert eagle.budget.num_blocks == expected.num_blocks < plain.budget.num_blocks
    # At max_model_len = context the lookahead is capped: concurrency falls with the pool alone.
    assert (
        eagle.max_sequences
        == expected.num_blocks // eagle.budget.blocks_per_sequence(8192)
        < plain.max_sequences
    )
    text = eagle.report()
    assert "modelled WITHOUT speculation" in text and "K=3" in text
    assert "speculation" not in plain.report()
    with pytest.raises(P.PlanError, match="same vocabulary size"):
        P.plan(LLAMA8, "H100-SXM", speculative=2, draft="Qwen/Qwen2.5-0.5B", **kw)
