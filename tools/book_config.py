"""Print a variant of _config.yml: `stored` builds the book from the notebooks' stored outputs.

`make test` runs nbval first, which executes every lab and compares it with its stored outputs; the book build
that follows can then render those outputs instead of executing every lab a second time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def stored_config() -> dict:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    # The variant lives under _build/, so paths in it must not be relative to the repository root.
    extensions = config.get("sphinx", {}).get("local_extensions", {})
    for name, path in extensions.items():
        extensions[name] = str((ROOT / path).resolve())
    return config


if __name__ == "__main__":
    if sys.argv[1:] != ["stored"]:
        sys.exit("usage: book_config.py stored")
    yaml.safe_dump(stored_config(), sys.stdout, sort_keys=False)
