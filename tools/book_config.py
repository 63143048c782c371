"""Print a variant of _config.yml: `stored` builds the book from the notebooks' stored outputs; `zh` is the
Chinese edition's config (_config.yml with _config_zh.yml's keys over it, from stored outputs too).

`make test` runs nbval first, which executes every lab and compares it with its stored outputs; the book build
that follows can then render those outputs instead of executing every lab a second time. The Chinese edition
(`make book`, `make book-checked`: `_toc_zh.yml`, built into _build/html/zh) never executes the labs: it glues
their stored outputs, which the English build or nbval checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stored", "zh")


def merged(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys set over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def stored_config() -> dict:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    # The variant lives under _build/, so paths in it must not be relative to the repository root.
    extensions = config.get("sphinx", {}).get("local_extensions", {})
    for name, path in extensions.items():
        extensions[name] = str((ROOT / path).resolve())
    return config


def zh_config() -> dict:
    """The Chinese edition: the stored-outputs config with _config_zh.yml's keys over it."""
    config = merged(stored_config(), yaml.safe_load((ROOT / "_config_zh.yml").read_text()))
    if config["execute"]["execute_notebooks"] != "off":
        raise ValueError(
            "_config_zh.yml must not execute the labs: the Chinese edition glues their stored outputs"
        )
    return config


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: book_config.py {'|'.join(VARIANTS)}")
    config = stored_config() if sys.argv[1] == "stored" else zh_config()
    yaml.safe_dump(config, sys.stdout, sort_keys=False, allow_unicode=True)
