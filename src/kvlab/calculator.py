"""The book's calculator (book/calculator): `kvlab size --json` called from the reader's browser.

The page runs this module on Pyodide, with kvlab's own source and nothing else (no torch, no transformers):
`calculate(args)` turns `kvlab size`'s long flags, named without their dashes, into its command line, runs
`kvlab.cli.main` and returns the object `kvlab size ... --json` prints. A pasted config.json (`args["config"]`)
is written to `config.json` in the working folder and sized as `kvlab size config.json ...`: the registry
model it is a twin of answers (`kvlab.specs.arch.registry_twin`); another config needs transformers, which the
page does not load, and gets a one-line refusal naming the nearest registry model.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

from kvlab import cli
from kvlab.specs import arch

# The file a pasted config is written to, and the model name the CLI then sizes.
PASTED = "config.json"
# Flags that take no value: true adds the flag, false leaves it out.
SWITCHES = frozenset({"json"})


def command_line(args: dict[str, Any]) -> list[str]:
    """`kvlab size`'s argv for `args` ({"model": ..., "context": "32k", "kv-dtype": "fp8", ...}); None or ""
    leaves a flag out, as does false for a switch."""
    flags = {k: v for k, v in args.items() if k not in ("model", "config")}
    argv = ["size", str(args.get("model", ""))]
    for name, value in flags.items():
        if value is None or value == "" or value is False:
            continue
        if name in SWITCHES or value is True:
            argv.append(f"--{name}")
        else:
            argv += [f"--{name}", str(value)]
    if "--json" not in argv:
        argv.append("--json")
    return argv


def calculate(args: dict[str, Any]) -> dict[str, Any]:
    """What `kvlab size ... --json` prints for `args`, as an object; input it refuses is {"error": one line}."""
    args = dict(args)
    if args.get("config"):
        if args.get("model") not in (None, "", PASTED):
            return {"error": f"give a model or a pasted config.json, not both (model {args['model']!r})"}
        Path(PASTED).write_text(str(args["config"]))
        args["model"] = PASTED
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli.main(command_line(args))
    except ImportError as err:
        # Only a config that is no registry model's twin reaches transformers (or torch).
        if args.get("model") == PASTED:
            return {
                "error": f"config.json is no registry model but for its non-sizing keys "
                f"({arch.nearest_twin(PASTED)}); sizing it needs transformers, which this page does not load: "
                "run kvlab size config.json --json"
            }
        return {"error": f"this setting needs {err.name}, which this page does not load: run kvlab size"}
    result: dict[str, Any] = json.loads(out.getvalue())
    return result


def calculate_json(args_json: str) -> str:
    """`calculate` between JSON texts: what the page's JavaScript calls."""
    return json.dumps(calculate(json.loads(args_json)))
