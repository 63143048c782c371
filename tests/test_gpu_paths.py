"""Code paths that only a GPU runs, checked on CPU: the dtype each device computes in, and where the
benchmarks put their inputs."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import torch

from kvlab.env import compute_dtype

ROOT = Path(__file__).resolve().parents[1]
# A dtype picked by a condition on bf16 (`... else torch.bfloat16`, `torch.bfloat16 if ...`), or bf16 support
# asked of torch: the book picks a device's dtype in one place, kvlab.env.compute_dtype.
GPU_DTYPE_CHOICE = re.compile(
    r"\b(if|else)\b[^\n#]*torch\.bfloat16|torch\.bfloat16[^\n#]*\bif\b|is_bf16_supported"
)


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def code_sources() -> dict[str, str]:
    """Every Python source and lab code cell of the repository, by name."""
    files = [
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "tools").rglob("*.py"),
    ]
    files += [p for p in (ROOT / "scripts").iterdir() if p.is_file()]
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    for lab in sorted((ROOT / "book").glob("*/lab.ipynb")):
        cells = json.loads(lab.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                sources[f"{lab.relative_to(ROOT)} cell {i}"] = "".join(cell["source"])
    return sources


def test_compute_dtype_gives_fp16_on_a_gpu_without_bf16_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert compute_dtype("cuda") == torch.float16  # a T4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert compute_dtype("cuda") == torch.bfloat16  # an H100
    assert compute_dtype("cpu") == torch.float32


def test_only_compute_dtype_picks_a_dtype_for_a_gpu():
    assert GPU_DTYPE_CHOICE.search('dtype = torch.float32 if device.type == "cpu" else torch.bfloat16')
    assert GPU_DTYPE_CHOICE.search("torch.cuda.is_bf16_supported()")
    found = {
        name: line.strip()
        for name, text in code_sources().items()
        if name != "src/kvlab/env.py"
        for line in text.splitlines()
        if GPU_DTYPE_CHOICE.search(line)
    }
    assert not found, f"use kvlab.env.compute_dtype(device): {found}"


def test_bench_engine_puts_generate_s_inputs_on_the_model_s_device():
    bench = load(ROOT / "benchmarks" / "bench_engine.py")
    trace = [bench.TraceRequest(0.0, [5, 6, 7], 2), bench.TraceRequest(0.0, [8], 3)]
    seen = []

    class Model:
        # where the model's weights are; meta stands for cuda, which this machine lacks
        device = torch.device("meta")

        def generate(self, input_ids, attention_mask, **kwargs):
            seen.append((input_ids.device, attention_mask.device, tuple(input_ids.shape)))

    bench.run_generate(Model(), trace, 2)
    assert seen == [(torch.device("meta"), torch.device("meta"), (2, 3))]


def test_allocator_slack_is_a_reused_cuda_block_s_and_none_on_cpu():
    """Chapters 5 and 7 assert what building an engine leaves allocated: exactly on CPU; on CUDA a cached block
    reused for the pool may be up to 1 MiB larger than asked (the allocator splits it only past 1 MiB)."""
    from kvlab import measure

    assert measure.allocator_slack_bytes("cpu") == 0
    assert measure.allocator_slack_bytes("cuda:0") == measure.CUDA_REUSED_BLOCK_SLACK == 2**20


def test_lab_17_sizes_every_engine_it_builds():
    """On one GPU, lab 17's own engine and the two processes of pd.run_disaggregated share cuda:0: an engine
    sized from memory takes 92 % of the device, and the next one has none left. Each gets `num_blocks`."""
    import ast

    cells = json.loads((ROOT / "book" / "17_cluster" / "lab.ipynb").read_text())["cells"]
    calls = [
        node
        for cell in cells
        if cell["cell_type"] == "code" and "google.colab" not in "".join(cell["source"])
        for node in ast.walk(ast.parse("".join(cell["source"])))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("LLMEngine", "EngineConfig")
    ]
    assert len(calls) >= 3
    unsized = [ast.unparse(c) for c in calls if "num_blocks" not in {k.arg for k in c.keywords}]
    assert not unsized, f"engines sized from memory: {unsized}"


def test_lab_17_s_gpu_prompts_fit_its_model():
    """At gpu_params.yaml's sizes, lab 17's longest prompt and its outputs fit the tiny Llama's positions:
    the engines refuse a request longer than max_model_len, and the split run would fail at prefill."""
    from kvlab.book.gpu import PARAMS, load_params
    from kvlab.book.sweep import notebook_parameters
    from kvlab.models import tiny_config

    lab = ROOT / "book" / "17_cluster" / "lab.ipynb"
    for stub in (False, True):
        values = notebook_parameters(lab) | load_params(PARAMS, ROOT / "book", stub)["17_cluster"]
        knobs = {k: values[k] for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
        limit = tiny_config("llama", **knobs).max_position_embeddings
        assert max(values["prompt_lens"]) + values["max_tokens"] <= limit, (stub, limit)
