"""JupyterLab, for real: the server `make lab` starts, one lab run through a kernel it owns, and a browser.

The lab is executed cell by cell over the server's REST and websocket API (the path JupyterLab itself takes),
then opened in headless Chromium, and a screenshot of JupyterLab showing it is saved under
_build/screenshots/. The server is always shut down and no process it started is left behind.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import websocket
from chromium import ROOT, SCREENSHOTS, browser

LAB = "book/05_active_tokens/lab.ipynb"  # fast (about 8 s of cells on CPU) and no wall-clock asserts
BIN = Path(sys.executable).parent
SETTINGS = ROOT / "jupyterlab"  # overrides.json: .md opens as MyST preview, no news pop-up (as in `make lab`)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (kernels run in their own session, so a process group is not enough)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Server:
    def __init__(self, tmp: Path):
        self.port, self.token = free_port(), uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(BIN / "jupyter-lab"), "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--port-retries=0", f"--ServerApp.root_dir={ROOT}", f"--IdentityProvider.token={self.token}",
               f"--LabApp.app_settings_dir={SETTINGS}", f"--LabApp.user_settings_dir={tmp / 'user-settings'}",
               f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
               f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}"]  # fmt: skip
        # Checkpoints go to tmp, not .ipynb_checkpoints/ beside the labs.
        if os.geteuid() == 0:
            cmd.append("--allow-root")  # CI runs as root; JupyterLab refuses root without it
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), "JUPYTER_DATA_DIR": str(tmp / "data"),
               "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_PREFER_ENV_PATH": "1"}  # fmt: skip
        subprocess.run(
            [str(BIN / "jupyter"), "trust", str(ROOT / LAB)], env=env, check=True, capture_output=True
        )
        self.log = open(tmp / "server.log", "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.children: set[int] = set()

    def api(self, path: str, method: str = "GET", body: dict | None = None, timeout: float = 10):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        return json.loads(text) if text else None

    def wait_ready(self, timeout: float = 60) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"jupyter lab exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                return self.api("/api/status", timeout=2)
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("jupyter lab did not answer /api/status")

    def stop(self):
        self.children |= descendants(self.proc.pid)
        if self.proc.poll() is None:
            try:
                self.api("/api/shutdown", method="POST", timeout=5)  # also shuts down its kernels
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for pid in self.children:  # a kernel that outlived its server
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


class Kernel:
    """A kernel of the server, spoken to over its websocket as JupyterLab does."""

    def __init__(self, server: Server, kernel_id: str):
        url = f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels?token={server.token}"
        self.ws = websocket.create_connection(url, timeout=120)
        self.session = uuid.uuid4().hex

    def execute(self, code: str, timeout: float = 120) -> tuple[dict, list[dict]]:
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "username": "test", "session": self.session, "msg_type": "execute_request",
                  "version": "5.3", "date": ""}  # fmt: skip
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": True}  # fmt: skip
        self.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                 "channel": "shell", "buffers": []}))  # fmt: skip
        reply, outputs, idle = None, [], False
        end = time.monotonic() + timeout
        while reply is None or not idle:
            assert time.monotonic() < end, f"no reply in {timeout} s to:\n{code[:300]}"
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "execute_reply":
                reply = msg["content"]
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            elif kind in ("stream", "display_data", "execute_result", "error"):
                outputs.append(msg["content"])
        return reply, outputs

    def close(self):
        self.ws.close()


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()
        left = [pid for pid in srv.children | {srv.proc.pid} if alive(pid)]
        assert not left, f"processes left behind by jupyter lab: {left}"


def test_lab_runs_in_jupyterlab_and_shows_in_chromium(server):
    status = server.wait_ready()
    assert "started" in status
    notebook = json.loads((ROOT / LAB).read_text())["cells"]
    cells = [c for c in notebook if c["cell_type"] == "code"]
    cells_md = [c for c in notebook if c["cell_type"] == "markdown"]
    assert "parameters" in cells[0]["metadata"].get("tags", []), (
        "the parameters cell must be the first code cell"
    )

    # A session for the notebook, as JupyterLab makes when it opens it: the kernel starts in the lab's folder.
    session = server.api("/api/sessions", "POST",
                         {"path": LAB, "type": "notebook", "name": "lab.ipynb", "kernel": {"name": "python3"}})  # fmt: skip
    kernel = Kernel(server, session["kernel"]["id"])
    try:
        reply, outputs = kernel.execute("import os, sys; print(sys.prefix, os.getcwd(), __debug__)")
        assert reply["status"] == "ok"
        prefix, cwd, debug = outputs[0]["text"].split()
        assert Path(prefix) == Path(sys.prefix), "the kernel must be the venv's, where kvlab is installed"
        assert Path(cwd) == (ROOT / LAB).parent and debug == "True"  # asserts are live (no python -O)

        asserts = 0
        for i, cell in enumerate(cells):
            source = "".join(cell["source"])
            started = time.monotonic()
            reply, outputs = kernel.execute(source)
            print(f"cell {i}: {time.monotonic() - started:.1f} s")
            errors = [f"{o['ename']}: {o['evalue']}" for o in outputs if "ename" in o]
            assert reply["status"] == "ok", f"code cell {i} of {LAB} failed: {errors}"
            asserts += sum(line.lstrip().startswith("assert ") for line in source.splitlines())
        assert asserts >= 5, f"{LAB} ran only {asserts} assert statements"
        # The kernel really stops on a failed assert (so the lab's passing asserts were checked).
        reply, _ = kernel.execute("assert 1 == 2, 'kvlab: an assert that must fail'")
        assert reply["status"] == "error" and reply["ename"] == "AssertionError"
    finally:
        kernel.close()

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "jupyterlab-lab05.png"
    with browser() as chromium:
        page = chromium.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{server.url}/lab/tree/{LAB}?token={server.token}", timeout=60_000)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        page.wait_for_selector(".jp-Notebook .jp-OutputArea-output", timeout=60_000)  # stored outputs visible
        page.wait_for_timeout(1500)  # let the kernel indicator and the rest of the layout settle
        figure = page.locator(".jp-Notebook .jp-OutputArea-output img").first
        figure.scroll_into_view_if_needed(timeout=30_000)  # show a stored figure beside its code
        page.wait_for_timeout(500)
        page.screenshot(path=str(shot))
        shown = page.locator(".jp-Notebook").inner_text()

        # The chapter's explanation opens as a MyST preview (jupyterlab-myst): math typeset, and the
        # JupyterLab-only note links to the rendered page, since glue roles show only as their keys here.
        chapter = str(Path(LAB).parent)
        page.goto(f"{server.url}/lab/tree/{chapter}/index.md?token={server.token}", timeout=60_000)
        note = page.locator(f'a[href="/files/_build/html/{chapter}/index.html"]')
        note.wait_for(timeout=60_000)
        page.wait_for_selector(".jp-MainAreaWidget .katex", timeout=30_000)
        page.wait_for_timeout(500)
        page.screenshot(path=str(SCREENSHOTS / f"jupyterlab-{Path(chapter).name}-index.png"))
    heading = cells_md[0]["source"][0].lstrip("# ").strip()
    assert heading in shown, f"JupyterLab does not show the lab's title {heading!r}"
    assert not errors, f"JavaScript errors in JupyterLab: {errors}"
    assert shot.stat().st_size > 10_000
