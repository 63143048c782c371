"""`kvlab size --json`, the calculator's driver (kvlab.calculator), a pasted config.json sized as its registry
twin, and the stored image rules that let both run without transformers (book/calculator)."""

import json
import subprocess
import sys

import pytest

from kvlab import calculator, cli
from kvlab.costs import budget, sglang
from kvlab.specs import arch, images, shape, vllm_serve
from kvlab.units import format_bytes


def size_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli.main(["size", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_the_json_holds_the_reports_figures_and_the_budget_term_by_term(capsys):
    code, out = size_json(capsys, "meta-llama/Llama-3.1-8B", "--context", "32k", "--batch", "16", "--kv-dtype",
                          "fp8", "--gpu", "H100-SXM")  # fmt: skip
    assert code == 0
    plan = budget.BudgetSettings(kv_dtype="fp8").memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    assert out["kv_bytes_per_token"] == 65536 and out["kv_bytes_per_sequence"] == 65536 * 32768
    assert out["kv_bytes_total"] == 16 * out["kv_bytes_per_sequence"]
    assert (
        out["budget"]["kv_pool_bytes"] == plan.kv_pool_bytes
        and out["budget"]["num_blocks"] == plan.num_blocks
    )
    assert out["sequences_fit"] == plan.max_sequences(32768) and out["batch_fits"] is True
    terms = out["budget"]["terms"]
    assert sum(t["bytes"] for t in terms) == plan.capacity_bytes
    assert [t["text"] for t in terms] == [format_bytes(t["bytes"]) for t in terms]
    # the text report is the same run's
    assert f"room for {out['sequences_fit']}" in out["report"]
    assert out["vllm_serve"]["command"].startswith("vllm serve meta-llama/Llama-3.1-8B --max-model-len 32768")
    assert "--kv-cache-dtype fp8" in out["vllm_serve"]["command"]


def test_every_public_property_of_the_budget_is_in_the_json(capsys):
    _, out = size_json(capsys, "Qwen/Qwen3-8B", "--gpu", "H100-SXM")
    props = [n for n in dir(budget.MemoryBudget) if not n.startswith("_")
             and isinstance(getattr(budget.MemoryBudget, n), property)]  # fmt: skip
    assert props and set(props) <= set(out["budget"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nobody/nothing"], "unknown model"),
        (["meta-llama/Llama-3.1-8B", "--context", "abc"], "argument --context"),
        (["meta-llama/Llama-3.1-8B", "--gpu", "H101"], "unknown accelerator"),
        (["meta-llama/Llama-3.1-405B", "--gpu", "H100-SXM", "--tp", "2"], "does not fit one H100-SXM"),
    ],
)
def test_a_refusal_is_one_json_line_and_exit_2(capsys, argv, message):
    code, out = size_json(capsys, *argv)
    assert code == 2 and list(out) == ["error"] and message in out["error"] and "\n" not in out["error"]


def test_the_sglang_json_holds_the_pool_the_text_prints(capsys):
    argv = ["meta-llama/Llama-3.1-8B", "--context", "32k", "--batch", "16", "--gpu", "H100-SXM", "--tp", "2"]
    code, out = size_json(capsys, *argv, "--engine", "sglang")
    assert code == 0 and out["settings"]["engine"] == "sglang" and out["vllm_serve"] is None
    pool = sglang.sglang_pool("meta-llama/Llama-3.1-8B", "H100-SXM", tp=2)
    assert out["budget"]["kv_pool_bytes"] == pool.kv_pool_bytes
    assert out["budget"]["max_total_num_tokens"] == pool.max_total_num_tokens
    assert out["budget"]["mem_fraction_static"] == pool.mem_fraction_static
    assert out["sequences_fit"] == pool.max_sequences(32768) and out["batch_fits"] is True
    terms = out["budget"]["terms"]
    assert sum(t["bytes"] for t in terms) == pool.capacity_bytes and terms[-1]["name"] == "KV pool"
    # the same figures as the text the command prints without --json
    assert cli.main(["size", *argv, "--engine", "sglang"]) == 0
    text = capsys.readouterr().out
    assert out["report"] == text.rstrip("\n") and f"room for {out['sequences_fit']})" in text
    assert f"{pool.max_total_num_tokens:,}" in text and out["texts"]["kv_pool_bytes"] in text


def test_an_sglang_pool_the_weights_fill_has_no_terms(capsys):
    code, out = size_json(capsys, "meta-llama/Llama-3.1-70B", "--gpu", "H100-SXM", "--engine", "sglang")
    assert code == 0 and out["budget"]["fits"] is False and out["budget"]["terms"] is None
    assert out["sequences_fit"] == 0 and out["budget"]["min_mem_fraction_static"] > 0.83


@pytest.mark.parametrize(
    "argv, message",
    [
        (["meta-llama/Llama-3.1-8B"], "--engine sglang sizes SGLang's pool on a GPU: give --gpu"),
        (["google/gemma-3-27b-it", "--gpu", "H200"], "separate full and SWA pools"),
    ],
)
def test_sglang_refusals_are_one_json_line(capsys, argv, message):
    code, out = size_json(capsys, *argv, "--engine", "sglang")
    assert code == 2 and list(out) == ["error"] and message in out["error"] and "\n" not in out["error"]


def test_the_serve_command_says_what_no_flag_reproduces():
    common = dict(max_model_len=4096, tp=1, pp=1, gpu_memory_utilization=0.9, block_size=16)
    fp8 = vllm_serve.serve_command("m", kv_dtype="fp8", weight_dtype="fp8", **common)
    assert "--quantization fp8" in fp8.command and "--kv-cache-dtype fp8" in fp8.command and not fp8.unmatched
    int8 = vllm_serve.serve_command("m", kv_dtype="int8", weight_dtype=4, evicts=True, **common)
    assert "--kv-cache-dtype" not in int8.command and len(int8.unmatched) == 3
    mixed = vllm_serve.serve_command("m", kv_dtype="fp16", weight_dtype="bf16", **common)
    assert mixed.unmatched and "--dtype bfloat16" in mixed.command
    draft = vllm_serve.serve_command(
        "m", kv_dtype="bf16", weight_dtype="bf16", speculative=3, draft="d", **common
    )
    assert json.loads(draft.flags[draft.flags.index("--speculative-config") + 1]) == {
        "method": "draft_model", "model": "d", "num_speculative_tokens": 3}  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        {"model": "google/gemma-3-27b-it", "context": "8k", "batch": 4, "gpu": "H200", "tp": 2, "kv-dtype": "fp8",
         "images": 2},
        {"model": "meta-llama/Llama-3.1-8B", "context": "128k", "gpu": "L40S", "window": 4096, "sinks": 4,
         "weight-dtype": "4", "json": True},
    ],
)  # fmt: skip
def test_the_calculator_returns_what_the_cli_prints(capsys, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    _, printed = size_json(capsys, *calculator.command_line(args)[1:-1])
    assert calculator.calculate(args) == printed and "error" not in printed
    assert json.loads(calculator.calculate_json(json.dumps(args))) == printed


def twin_file(tmp_path, name: str, **changes) -> str:
    config = json.loads(arch.config_path(name).read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | changes))
    return str(path)


def test_a_pasted_registry_config_sizes_as_its_twin_without_transformers(tmp_path):
    pasted = twin_file(tmp_path, "meta-llama/Llama-3.1-8B", _name_or_path="me/tuned", eos_token_id=[7, 8])
    assert arch.registry_twin(pasted) == "meta-llama/Llama-3.1-8B"
    assert shape.prepare(pasted) == "meta-llama/Llama-3.1-8B"
    code = "import sys; from kvlab import cli; cli.main(['size', sys.argv[1], '--gpu', 'H100-SXM']); "
    code += "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code, pasted], capture_output=True, text=True, check=True)
    assert run.stdout.strip().endswith("[]"), run.stdout


def test_a_config_that_differs_in_a_sizing_key_is_no_twin(tmp_path, monkeypatch):
    pasted = twin_file(tmp_path, "meta-llama/Llama-3.1-8B", vocab_size=1000)
    assert arch.registry_twin(pasted) is None
    assert "meta-llama/Llama-3.1-8B, differs in vocab_size" in arch.nearest_twin(pasted)
    # the calculator, whose Python has no transformers, refuses it in one line
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = calculator.calculate({"config": (tmp_path / "config.json").read_text(), "gpu": "H100-SXM"})
    assert list(out) == ["error"] and "differs in vocab_size" in out["error"]


def test_pasted_text_that_is_no_config_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "is not JSON" in calculator.calculate({"config": "{nope"})["error"]
    assert "no model_type" in calculator.calculate({"config": "[1, 2]"})["error"]


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        # a token id stays inside the vocabulary
        return value // 2 if value > 1 else value + 1
    if isinstance(value, float):
        return value / 2
    if isinstance(value, str):
        return value + "-tuned"
    return None  # lists, objects, nulls: dropped


def _with_non_sizing_keys_changed(config: dict) -> dict:
    out = {}
    for key, value in config.items():
        if key in arch.NON_SIZING_KEYS:
            value = _changed(value)
            if value is None:
                continue
        elif isinstance(value, dict):
            value = _with_non_sizing_keys_changed(value)
        out[key] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", arch.twin_candidates())
def test_non_sizing_keys_change_neither_the_cache_nor_the_parameters(name, tmp_path):
    # transformers builds the model from the changed file: the same shape and weight groups as stored.
    config = _with_non_sizing_keys_changed(json.loads(arch.config_path(name).read_text()))
    (tmp_path / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig

    rebuilt = shape._encode(AutoConfig.from_pretrained(tmp_path / "config.json"))
    rebuilt["spec"]["name"] = name  # the path it was read from
    stored = json.loads(shape.SHAPES.read_text())["models"][name]
    assert json.loads(json.dumps(rebuilt)) == stored


def test_the_stored_image_rules_are_the_ones_transformers_gives():
    stored = json.loads(images.RULES.read_text())["models"]
    fresh = {name: rule.__dict__ for name, rule in images.registry_rules().items()}
    assert stored == fresh, "configs/image_rules.json is stale: run python -m kvlab.specs.images"
