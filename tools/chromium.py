"""Headless Chromium for the browser tests: Debian's `chromium` driven by Playwright (no browser download).

Both browser tests (JupyterLab and the rendered book) launch the same browser with the same flags. The
background-networking flags keep Chromium from calling home, which this closed network refuses.
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "_build" / "screenshots"
INSTALL_HINT = (
    "no Chromium found: install one with `apt-get install -y chromium` (Debian/Ubuntu) "
    "or set KVLAB_CHROMIUM=/path/to/chromium"
)
FLAGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
]


def executable() -> str | None:
    """Path of the Chromium to use: $KVLAB_CHROMIUM, else the first chromium-like command on PATH."""
    wanted = os.environ.get("KVLAB_CHROMIUM")
    if wanted:
        return wanted if os.access(wanted, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


@contextmanager
def browser():
    """A headless Chromium (Playwright `Browser`); the test stops with a one-line hint when none is installed."""
    path = executable()
    if path is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:  # Playwright gives the browser a fresh, temporary profile
        chromium = pw.chromium.launch(executable_path=path, args=FLAGS, headless=True, timeout=60_000)
        try:
            yield chromium
        finally:
            chromium.close()
