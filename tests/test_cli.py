import subprocess
import sys

import pytest

from kvlab import cli
from kvlab.costs import budget
from kvlab.specs import arch


def test_size_report(capsys):
    assert (
        cli.main(
            [
                "size",
                "meta-llama/Llama-3.1-8B",
                "--context",
                "32k",
                "--batch",
                "16",
                "--kv-dtype",
                "fp8",
                "--gpu",
                "H100-SXM",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "64 KiB (65,536 B, fp8)" in out
    assert "2 GiB at 32k tokens" in out and "32 GiB for 16 sequences" in out
    assert "fits" in out and "room for" in out
    # vLLM 0.34's measured rule by default: the context, the margin and the transient peak kept free
    for term in (
        "capacity",
        "rule: vLLM 0.34.0",
        "CUDA context",
        "weights",
        "margin",
        "transient peak",
        "block rounding",
        "KV pool (expected)",
        "KV pool floor",
    ):
        assert term in out


def test_budget_lines_for_the_issue_example():
    text = cli.size_report("meta-llama/Llama-3.1-8B", 8192, 1, gpu="H100-SXM")
    assert "79.6 GiB" in text  # 81,559 MiB as the driver reports, not 80e9 B
    # 0.34's blocks of 64 tokens; 0.33's of 16
    assert "sequences that fit" in text and "(128 blocks each)" in text
    older = cli.size_report(
        "meta-llama/Llama-3.1-8B", 8192, 1, budget.BudgetSettings(vllm_version="0.33"), gpu="H100-SXM"
    )
    assert "(512 blocks each)" in older and "engine cap" in older and "rule: vLLM 0.33.0" in older


def test_size_takes_a_vllm_version(capsys):
    argv = ["size", "meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--context", "8k"]
    assert cli.main([*argv, "--vllm-version", "0.27.1"]) == 0
    assert "0.20.0's rule, the nearest older release kvlab read" in capsys.readouterr().out
    assert cli.main([*argv, "--no-extensible-kv-cache"]) == 0
    assert "extensible KV cache off" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([*argv, "--vllm-version", "0.4"])


def test_does_not_fit():
    text = cli.size_report("meta-llama/Llama-3.1-70B", 131072, 64, gpu="L4")
    assert "does NOT fit" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["size", "no/such-model"], "unknown model 'no/such-model'"),
        (["size", "Qwen/Qwen2.5-7B", "--context", "32q"], "cannot read '32q'"),
        (["size", "Qwen/Qwen2.5-7B", "--context", "0"], "must be positive"),
        (["size", "Qwen/Qwen2.5-7B", "--batch", "-3"], "positive integer"),
        (["size", "Qwen/Qwen2.5-7B", "--gpu", "X1"], "unknown accelerator 'X1'"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", *argv],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].count("error") >= 1


def test_size_per_gpu_with_tp_and_pp(capsys):
    argv = [
        "size",
        "meta-llama/Llama-3.1-70B",
        "--context",
        "32k",
        "--tp",
        "8",
        "--pp",
        "2",
        "--gpu",
        "H100-SXM",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "tp=8, pp=2: 16 GPUs" in out
    assert "20 KiB (20,480 B, bf16)" in out  # 80 layers / 2 stages × 1 KV head × 256 × 2 B
    assert "KV pool" in out and "fits" in out


def test_size_reports_kv_head_copies():
    text = cli.size_report("meta-llama/Llama-3.1-8B", 4096, 1, budget.BudgetSettings(tp=16), per_gpu=True)
    assert "copied on 2 GPUs" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["size", "meta-llama/Llama-3.1-70B", "--tp", "1", "--gpu", "H100-SXM"],
            "smallest tensor-parallel size",
        ),
    ],
)
def test_bad_parallel_plan_is_one_line(argv, message):
    test_bad_input_is_one_line_and_nonzero(argv, message)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["size", "Qwen/Qwen2.5-7B", "--tp", "8"], "does not divide the 28 query heads"),
        (["size", "meta-llama/Llama-3.1-8B", "--pp", "33"], "exceeds the 32 layers"),
        (["size", "deepseek-ai/DeepSeek-V3", "--tp", "8", "--gpu", "H200"], "fits is --tp 16"),
    ],
)
def test_bad_parallel_sizes_in_process(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("kvlab: error:")


# --- kvlab plan (issue 12) ------------------------------------------------------------------------------------------


def test_plan_report(capsys):
    argv = ["plan", "meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--context", "8k", "--ttft", "500ms"]
    argv += ["--itl", "50ms", "--rate", "2/s", "--requests", "40", "--input-len", "200", "--output-len", "40"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for term in (
        "memory budget",
        "KV pool",
        "sequences of 8,192 tokens",
        "vLLM's",
        "TTFT",
        "E2EL",
        "goodput",
    ):
        assert term in out
    assert "targets      TTFT <= 500 ms, TPOT <= 50 ms for 99% of requests: met" in out
    assert "1 × H100-SXM" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["meta-llama/Llama-3.1-70B", "--gpu", "H100-SXM", "--ttft", "500ms", "--rate", "1/s"],
            "does not fit one",
        ),
        (
            [
                "meta-llama/Llama-3.1-8B",
                "--gpu",
                "H100-SXM",
                "--itl",
                "1ms",
                "--rate",
                "1/s",
                "--requests",
                "10",
            ],
            "no GPU count meets",
        ),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--rate=-2/s"], "positive request rate"),
        (
            ["meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--rate", "1/s", "--requests", "0"],
            "positive integer",
        ),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H100-SXM", "--rate", "1/s", "--ttft", "fast"], "duration"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "Z100", "--rate", "1/s"], "unknown accelerator"),
    ],
    ids=["no-fit", "unreachable", "negative-rate", "empty", "bad-target", "bad-gpu"],
)
def test_plan_bad_input(capsys, argv, message):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as stop:  # argparse's own checks of argument types
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_models_groups_the_registry_by_what_holds_the_cache(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    groups: dict[str, list[str]] = {}
    header = ""
    for line in out.splitlines():
        if line.startswith("  "):
            groups[header].append(line.strip())
        else:
            header = line.rstrip(":").rsplit(" (", 1)[0]
            groups[header] = []
    assert sorted(n for names in groups.values() for n in names) == sorted(arch.registry())
    assert "meta-llama/Llama-3.1-8B" in groups["full, GQA"]
    assert "meta-llama/Llama-2-7b-hf" in groups["full, MHA"]
    assert "deepseek-ai/DeepSeek-V3" in groups["MLA latent"]
    assert "google/gemma-2-9b" in groups["sliding window + full, GQA"]
    assert "mistralai/Mistral-7B-v0.1" in groups["sliding window, GQA"]
