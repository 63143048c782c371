"""`kvlab sweep`: a small real sweep of chapter 1 (CSV, resume, a failing point), bad input, interrupts, and
`--jobs N` (the same rows as one job, resume, interrupts, a GPU per worker)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab import cli
from kvlab.book import sweep

ROOT = Path(__file__).resolve().parents[1]
LAB1 = ROOT / "book/01_cache_contents/lab.ipynb"
# Chapter 1 shrunk to seconds: 2 layers of 8 heads (head_dim 16), a short and a long history (recomputing 1024
# tokens outweighs the fixed per-step overhead, which the lab asserts on CPU).
TINY = [
    "-p",
    "layers=2",
    "-p",
    "hidden=128",
    "-p",
    "heads=8",
    "-p",
    "new_tokens=4",
    "-p",
    "history_lengths=[16, 1024]",
]
TINY += ["-p", "repeat=2", "--no-progress"]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


# It executes lab 1, a timed lab, so it runs with the timed checks, alone on the machine.
@pytest.mark.slow
@pytest.mark.timed
def test_real_sweep_csv_resume_and_a_failing_point(tmp_path, capsys):
    out = tmp_path / "ch1"
    argv = ["sweep", str(LAB1), "--grid", "kv_heads=1,4", *TINY, "--out", str(out)]
    assert cli.main([*argv, "--plot", "ch1_bytes_per_token"]) == 0
    rows = read_csv(out / "results.csv")
    assert [r["kv_heads"] for r in rows] == ["1", "4"] and {r["status"] for r in rows} == {"ok"}
    for row in rows:  # layers x 2 (K and V) x kv_heads x head_dim 16 x 4 B (fp32)
        assert int(row["ch1_bytes_per_token"]) == 2 * 2 * int(row["kv_heads"]) * 16 * 4
        assert row["ch1_layers"] == "2"
    assert (out / "ch1_bytes_per_token.png").stat().st_size > 0
    assert "2 run, 0 already done" in capsys.readouterr().out

    # Resume: the same command runs nothing and leaves the same CSV.
    before = (out / "results.csv").read_text()
    assert cli.main(argv) == 0
    assert "0 run, 2 already done" in capsys.readouterr().out
    assert (out / "results.csv").read_text() == before

    # kv_heads=3 does not divide heads=8: the lab fails there; the point is recorded, the others kept.
    grown = ["sweep", str(LAB1), "--grid", "kv_heads=1,3,4", *TINY, "--out", str(out)]
    assert cli.main(grown) == 1
    printed = capsys.readouterr().out
    assert "1 run, 2 already done, 1 failed" in printed and "failed: kv_heads=3" in printed
    rows = read_csv(out / "results.csv")
    assert [(r["kv_heads"], r["status"]) for r in rows] == [("1", "ok"), ("3", "failed"), ("4", "ok")]
    assert "ValueError" in rows[1]["error"] and "divide" in rows[1]["error"]
    assert rows[0]["ch1_bytes_per_token"] == "256" and rows[1]["ch1_bytes_per_token"] == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--grid", "kv_hedas=1,2"],
            "unknown parameter 'kv_hedas'; the notebook's parameters are: family, layers",
        ),
        ([], "the grid is empty"),
        (["--grid", "kv_heads="], "has an empty value"),
        (["--grid", "kv_heads=1,,2"], "has an empty value"),
        (["--grid", "kv_heads"], "--grid expects name=values, got 'kv_heads'"),
        (["--grid", "kv_heads=1,two"], "cannot read 'two' as the int that parameter 'kv_heads' takes"),
        (["--grid", "kv_heads=1", "-p", "kv_heads=2"], "both a --grid axis and a -p parameter"),
        (["--grid", "kv_heads=1", "-p", "seed"], "-p expects name=value"),
        (["--grid", "kv_heads=1", "--x", "layers"], "--x 'layers' is not a grid axis"),
        (["--grid", "kv_heads=1", "--plot", "nope"], "the lab glues no scalar 'nope'; it glues: ch1_layers"),
        (["--grid", "kv_heads=1", "--jobs", "0"], "--jobs must be at least 1, got 0"),
        (["--grid", "kv_heads=1", "--jobs", "-2"], "--jobs must be at least 1, got -2"),
        (
            ["--grid", "kv_heads=1", "--jobs", "1.5"],
            "--jobs takes a whole number of points to run at once, got '1.5'",
        ),
        (
            ["--grid", "kv_heads=1", "--jobs", "all"],
            "--jobs takes a whole number of points to run at once, got 'all'",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    assert cli.main(["sweep", str(LAB1), *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_missing_notebook_from_the_command_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "sweep", "no/lab.ipynb", "--grid", "a=1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == "kvlab: error: no such notebook: no/lab.ipynb\n"


def test_values_take_the_type_of_the_default():
    defaults = {"n": 4, "x": 0.5, "flag": False, "name": "llama", "lens": [16, 32], "model": None}
    parsed = sweep.parse_assignments(
        [
            "n=1,2,2",
            "x=1e-3",
            "flag=true,0",
            "name=qwen,2,'2',1.5,1e3",
            "lens=[8, 64],[16]",
            "model=None,abc",
        ],
        defaults,
        many=True,
        flag="--grid",
    )
    assert parsed == {
        "n": [1, 2],
        "x": [0.001],
        "flag": [True, False],
        "name": [
            "qwen",
            2,
            "2",
            1.5,
            1000.0,
        ],  # a str default: numbers as papermill -y reads them, quotes keep text
        "lens": [[8, 64], [16]],
        "model": [None, "abc"],
    }
    with pytest.raises(sweep.SweepError, match="cannot read 'yes please' as the bool"):
        sweep.parse_value("flag", "yes please", False)


def test_a_string_parameter_takes_numbers_as_numbers():
    """`kvlab sweep book/02_sizing/lab.ipynb --grid weight_dtype=4,bf16`: 4-bit weights, an int, beside bf16."""
    defaults = sweep.notebook_parameters(ROOT / "book/02_sizing/lab.ipynb")
    assert defaults["weight_dtype"] == "bf16"
    grid = sweep.parse_assignments(["weight_dtype=4,bf16,'8'"], defaults, many=True, flag="--grid")
    assert grid == {"weight_dtype": [4, "bf16", "8"]}
    fixed = sweep.parse_assignments(
        ["weight_dtype=8", "large_model=Qwen/Qwen2.5-7B"], defaults, many=False, flag="-p"
    )
    assert fixed == {"weight_dtype": 8, "large_model": "Qwen/Qwen2.5-7B"}
    for text in ("yes", "null", "1.2.3", "8b", "fp8"):  # text, not YAML's bool/None
        assert sweep.parse_value("weight_dtype", text, "bf16") == text


def test_glued_scalars_of_a_stored_lab():
    values = sweep.glued_scalars(ROOT / "book/02_sizing/lab.ipynb")
    assert values["ch2_min_model"] == "tiiuae/falcon-7b"  # strings without their quotes
    assert all(isinstance(v, (int, float, str, bool)) for v in values.values())
    nb = {
        "cells": [
            {"outputs": [_glue("f", "<Figure size 700x420 with 1 Axes>"), _glue("r", "np.float64(0.25)")]}
        ]
    }
    assert sweep.glued_scalars(nb) == {"r": 0.25}  # figures are not scalars; numpy reprs are
    assert [sweep.as_number(v) for v in (3, 0.5, "1,025", "0.0001", "8 KiB", True)] == [
        3,
        0.5,
        1025,
        1e-4,
        None,
        None,
    ]


def _glue(name: str, text: str) -> dict:
    return {"data": {sweep.GLUE_MIME: text}, "metadata": {"scrapbook": {"name": name}}}


def test_interrupt_loses_no_finished_point_and_failures_run_again(tmp_path, monkeypatch):
    calls = []

    def fake(s, point):  # no kernel: point 2 is interrupted, point 3 fails the first time
        calls.append(point["n"])
        if point["n"] == 2 and calls.count(2) == 1:
            raise KeyboardInterrupt
        ok = not (point["n"] == 3 and calls.count(3) == 1)
        values = {"y": 10 * point["n"]} if ok else {}
        status, error = ("ok", "") if ok else ("failed", "RuntimeError: boom")
        return {"point": point, "parameters": point, "status": status, "error": error, "values": values}

    monkeypatch.setattr(sweep, "run_point", fake)
    plan = sweep.Sweep(LAB1, {"n": [1, 2, 3]}, out=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(plan, progress=False)
    assert [r["n"] for r in read_csv(tmp_path / "results.csv")] == ["1"]
    assert json.loads((tmp_path / "runs/n=1.json").read_text())["values"] == {"y": 10}

    first = sweep.run_sweep(plan, progress=False)
    assert (first.ran, first.skipped, first.failed) == (2, 1, 1)
    assert [r["status"] for r in read_csv(tmp_path / "results.csv")] == ["ok", "ok", "failed"]
    second = sweep.run_sweep(plan, progress=False)  # the failed point is retried, the finished ones are not
    assert (second.ran, second.skipped, second.failed) == (1, 2, 0)
    assert calls == [1, 2, 2, 3, 3]
    rows = read_csv(tmp_path / "results.csv")
    assert [(r["n"], r["status"], r["y"]) for r in rows] == [
        ("1", "ok", "10"),
        ("2", "ok", "20"),
        ("3", "ok", "30"),
    ]
    plotted = sweep.plot(plan, second.rows, "y")
    assert plotted == tmp_path / "y.png" and plotted.stat().st_size > 0
    with pytest.raises(sweep.SweepError, match="glued no scalar 'z'"):
        sweep.plot(plan, second.rows, "z")


# ---------------------------------------------------------------------------------------------------------------
# --jobs N: several points at once, in worker processes.

# Workers are forked, so a stand-in for run_point set by monkeypatch reaches them; elsewhere they are spawned.
forked = pytest.mark.skipif(sys.platform != "linux", reason="workers are forked on Linux only")


def tiny_lab(folder: Path) -> Path:
    """A lab of two cells that runs in a kernel's start-up time: it glues 10 n and the kernel's
    CUDA_VISIBLE_DEVICES ('unset' when it has none), and fails at n = 3."""
    cells = [
        ("n = 1", ["parameters"]),
        (
            "import os\n"
            "from myst_nb import glue\n"
            "assert n != 3, 'three fails'\n"
            "glue('y', 10 * n, display=False)\n"
            "glue('cuda', os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), display=False)",
            [],
        ),
    ]
    nb = {
        "cells": [
            {
                "id": f"cell-{i}",
                "cell_type": "code",
                "execution_count": None,
                "metadata": {"tags": tags},
                "outputs": [],
                "source": src,
            }
            for i, (src, tags) in enumerate(cells)
        ],
        "metadata": json.loads(LAB1.read_text())["metadata"],  # the kernel the book's labs run in
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = folder / "tiny.ipynb"
    path.write_text(json.dumps(nb))
    return path


# Each point starts a Jupyter kernel: seconds each.
@pytest.mark.slow
def test_jobs_2_gives_the_rows_of_jobs_1_and_resumes(tmp_path, capsys, monkeypatch):
    lab = tiny_lab(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(sweep, "gpu_count", lambda: 2)  # a 2-GPU box, as far as the parent can tell
    argv = ["sweep", str(lab), "--grid", "n=1,2,3", "--no-progress"]
    assert cli.main([*argv, "--out", str(tmp_path / "one")]) == 1
    assert cli.main([*argv, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 1
    printed = capsys.readouterr().out
    assert printed.count("3 points: 3 run, 0 already done, 1 failed") == 2
    one, two = read_csv(tmp_path / "one/results.csv"), read_csv(tmp_path / "two/results.csv")
    # The kernel sees the variable its worker set: slot 0 runs n=1, slot 1 n=2, n=3 whichever frees first.
    assert [r.pop("cuda") for r in one] == ["unset", "unset", ""]
    cuda = [r.pop("cuda") for r in two]
    assert cuda[:2] == ["0", "1"] and cuda[2] == ""  # n=3 failed before it glued
    assert one == two
    assert [(r["n"], r["status"], r["y"]) for r in two] == [
        ("1", "ok", "10"),
        ("2", "ok", "20"),
        ("3", "failed", ""),
    ]
    assert "AssertionError: three fails" in two[2]["error"]

    # Resume: the finished points are skipped, the failed one and the new one run.
    before = (tmp_path / "two/runs/n=1.json").read_text()
    assert (
        cli.main(
            [
                "sweep",
                str(lab),
                "--grid",
                "n=1,2,3,4",
                "--no-progress",
                "--out",
                str(tmp_path / "two"),
                "--jobs",
                "2",
            ]
        )
        == 1
    )
    assert "4 points: 2 run, 2 already done, 1 failed" in capsys.readouterr().out
    assert (tmp_path / "two/runs/n=1.json").read_text() == before
    rows = read_csv(tmp_path / "two/results.csv")
    assert [(r["n"], r["status"], r["y"]) for r in rows] == [
        ("1", "ok", "10"),
        ("2", "ok", "20"),
        ("3", "failed", ""),
        ("4", "ok", "40"),
    ]


def test_gpu_slots():
    assert sweep.worker_devices(4, 2, {}) == ["0", "1", "0", "1"]
    assert sweep.worker_devices(2, 8, {}) == ["0", "1"]
    # the ids the user made visible, in their order
    assert sweep.worker_devices(3, 2, {"CUDA_VISIBLE_DEVICES": "6,7"}) == ["6", "7", "6"]
    # no GPU: an empty variable where it is unset, the user's value (None: untouched) where it is set
    assert sweep.worker_devices(2, 0, {}) == ["", ""]
    assert sweep.worker_devices(2, 0, {"CUDA_VISIBLE_DEVICES": "3"}) == [None, None]
    assert sweep.worker_devices(2, 0, {"CUDA_VISIBLE_DEVICES": ""}) == [None, None]


def _env_point(s, point):
    """run_point's stand-in: records the CUDA_VISIBLE_DEVICES its worker runs under."""
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    return {"point": point, "parameters": point, "status": "ok", "error": "", "values": {"cuda": cuda}}


@forked
@pytest.mark.parametrize(
    "gpus, user, expected, shared",
    [
        (2, None, ["0", "1", "0", "1"], "kvlab: 4 jobs on 2 GPUs: several jobs share a GPU\n"),
        (4, None, ["0", "1", "2", "3"], ""),
        (0, None, ["", "", "", ""], ""),
        (0, "5", ["5", "5", "5", "5"], ""),
    ],
)
def test_each_worker_runs_under_its_gpu(tmp_path, capsys, monkeypatch, gpus, user, expected, shared):
    monkeypatch.setattr(sweep, "run_point", _env_point)
    monkeypatch.setattr(sweep, "gpu_count", lambda: gpus)
    if user is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", user)
    outcome = sweep.run_sweep(sweep.Sweep(LAB1, {"n": [1, 2, 3, 4]}, out=tmp_path), progress=False, jobs=4)
    assert [r["cuda"] for r in outcome.rows] == expected  # all four start at once, slots in grid order
    assert capsys.readouterr().out == shared
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == user  # the parent's own environment is untouched


@forked
def test_jobs_interrupt_keeps_finished_points_and_starts_no_more(tmp_path, monkeypatch):
    def fake(s, point):  # in a worker: calls are counted in files. n=2 is interrupted, n=3 fails, both once
        n = point["n"]
        with (tmp_path / f"calls-{n}").open("a") as calls:
            calls.write("x")
        first = (tmp_path / f"calls-{n}").read_text() == "x"
        if n == 1 and first:
            while not (tmp_path / "calls-2").exists():
                time.sleep(0.01)
            time.sleep(0.5)  # the interrupt reaches the parent first, and n=1, still in flight, is kept
        if n == 2 and first:
            raise KeyboardInterrupt
        ok = not (n == 3 and first)
        values = {"y": 10 * n} if ok else {}
        status, error = ("ok", "") if ok else ("failed", "RuntimeError: boom")
        return {"point": point, "parameters": point, "status": status, "error": error, "values": values}

    monkeypatch.setattr(sweep, "run_point", fake)
    monkeypatch.setattr(sweep, "gpu_count", lambda: 0)
    plan = sweep.Sweep(LAB1, {"n": [1, 2, 3, 4]}, out=tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(plan, progress=False, jobs=2)
    assert [(r["n"], r["y"]) for r in read_csv(tmp_path / "out/results.csv")] == [("1", "10")]
    assert (
        not (tmp_path / "calls-3").exists() and not (tmp_path / "calls-4").exists()
    )  # pending: never started

    first = sweep.run_sweep(plan, progress=False, jobs=2)
    assert (first.ran, first.skipped, first.failed) == (3, 1, 1)
    second = sweep.run_sweep(plan, progress=False, jobs=3)  # only the failed point runs again
    assert (second.ran, second.skipped, second.failed) == (1, 3, 0)
    assert [len((tmp_path / f"calls-{n}").read_text()) for n in (1, 2, 3, 4)] == [1, 2, 2, 1]
    rows = read_csv(tmp_path / "out/results.csv")
    assert [(r["n"], r["status"], r["y"]) for r in rows] == [
        ("1", "ok", "10"),
        ("2", "ok", "20"),
        ("3", "ok", "30"),
        ("4", "ok", "40"),
    ]


@forked
def test_a_killed_worker_fails_its_point_and_the_sweep_goes_on(tmp_path, monkeypatch):
    def fake(s, point):  # in a worker: n=2 kills its worker every time; calls are counted in files
        n = point["n"]
        with (tmp_path / f"calls-{n}").open("a") as calls:
            calls.write("x")
        if n == 2:
            # n=1 is in flight in the other worker when this one dies
            while not (tmp_path / "calls-1").exists():
                time.sleep(0.01)
            os._exit(9)
        if n == 1 and (tmp_path / "calls-1").read_text() == "x":
            time.sleep(5)  # lost with the pool, unless the sweep waited for it
        return {"point": point, "parameters": point, "status": "ok", "error": "", "values": {"y": 10 * n}}

    monkeypatch.setattr(sweep, "run_point", fake)
    monkeypatch.setattr(sweep, "gpu_count", lambda: 0)
    plan = sweep.Sweep(LAB1, {"n": [1, 2, 3, 4]}, out=tmp_path / "out")
    outcome = sweep.run_sweep(plan, progress=False, jobs=2)
    assert (outcome.ran, outcome.failed) == (4, 1)
    rows = {r["n"]: r for r in read_csv(tmp_path / "out/results.csv")}
    assert [(n, rows[n]["status"], rows[n]["y"]) for n in "134"] == [
        ("1", "ok", "10"),
        ("3", "ok", "30"),
        ("4", "ok", "40"),
    ]
    assert rows["2"]["status"] == "failed" and rows["2"]["error"] == sweep.WORKER_DIED
    # The culprit and its partner ran twice: together, then each alone
    assert [len((tmp_path / f"calls-{n}").read_text()) for n in (1, 2, 3, 4)] == [2, 2, 1, 1]
