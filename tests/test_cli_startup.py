"""The CLI answers without importing what it does not need, and fails fast and quietly on bad input."""

import json
import subprocess
import sys

import pytest

from kvlab import cli
from kvlab.book import sweep
from kvlab.specs import arch

ENV = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}


def _imports_after(code: str, env: dict[str, str] = ENV) -> list[str]:
    probe = f"import sys\n{code}\nprint([m for m in ('torch', 'transformers') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_import_kvlab_and_the_cli_import_no_torch():
    assert _imports_after("import kvlab, kvlab.cli") == []


def test_help_imports_no_torch():
    code = "from kvlab import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass"
    assert _imports_after(code) == []


def test_sizing_a_registry_model_imports_no_torch():
    code = "from kvlab import cli\ncli.main(['size', 'meta-llama/Llama-3.1-8B', '--gpu', 'H100-SXM', '--tp', '2'])"
    assert _imports_after(code) == []


def test_lazy_env_exports_still_resolve():
    import kvlab
    from kvlab import env

    assert kvlab.pick_device is env.pick_device and kvlab.env_report is env.env_report


def test_one_sequence_is_singular():
    text = cli.size_report("meta-llama/Llama-3.1-8B", 8192, 1, gpu="H100-SXM")
    assert "for 1 sequence\n" in text and "  1 sequence of 8k tokens" in text
    assert "1 sequences" not in text
    assert "for 2 sequences" in cli.size_report("meta-llama/Llama-3.1-8B", 8192, 2)


def test_unknown_model_offline_is_one_line_without_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(arch.UnknownModelError, match="not a local path.*offline") as err:
        arch.get("no-such-org/no-such-model")
    assert "\n" not in str(err.value)


def test_unknown_model_with_the_hub_unreachable_asks_once_without_retries(monkeypatch):
    import huggingface_hub.utils._http as hub_http

    def no_retry(seconds: float) -> None:
        raise AssertionError(f"huggingface_hub retried (slept {seconds} s)")

    monkeypatch.setattr(hub_http.time, "sleep", no_retry)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    # A closed local port: the connection is refused at once, as with no network.
    template = "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE", template)
    with pytest.raises(arch.UnknownModelError, match="could not be reached") as err:
        arch.get("no-such-org/no-such-model")
    assert "\n" not in str(err.value) and "meta-llama/Llama-3.1-8B" in str(err.value)


def test_unknown_model_from_the_command_line_is_one_line_and_imports_no_torch():
    code = (
        "from kvlab import cli\n"
        "assert cli.main(['plan', 'no/such', '--gpu', 'H100-SXM', '--rate', '1', '--ttft', '1s']) == 2\n"
        "assert cli.main(['size', 'no/such']) == 2"
    )
    env = ENV | {"HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE")
    probe = f"import sys\n{code}\nprint('torch' in sys.modules, file=sys.stdout)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("kvlab: error: unknown model 'no/such'") for line in lines)
    assert "Retrying" not in proc.stderr


def _notebook(tmp_path, parameters: str):
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": parameters, "outputs": []},
        ],
        "metadata": {"kernelspec": {"name": "python3", "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "lab.ipynb"
    path.write_text(json.dumps(nb))
    return path


def test_a_comment_with_an_equals_sign_keeps_its_parameter(tmp_path, caplog):
    path = _notebook(tmp_path, "top_k = 5  # candidates (vLLM's logprobs=k)\nname: str = 'a'\nx = y = 2\n")
    assert sweep.notebook_parameters(path) == {"top_k": 5, "name": "a", "x": 2, "y": 2}
    assert not caplog.records


def test_sweep_bad_value_is_kvlabs_one_line_without_papermills_warning(tmp_path):
    path = _notebook(tmp_path, "top_k = 5  # candidates (vLLM's logprobs=k)\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlab.cli",
            "sweep",
            str(path),
            "--grid",
            "top_k=a,b",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Unable to parse" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
