"""Chapter 5's budget tables are kvlab's budget, term by term, under the current vLLM's rule and 0.33's."""

import json
from pathlib import Path

from kvlab.book.report import budget_table
from kvlab.costs.budget import memory_budget
from kvlab.specs import vllm_defaults

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "book" / "05_active_tokens" / "lab.ipynb"
PAGES = (ROOT / "book" / "05_active_tokens" / "index.md", ROOT / "book" / "zh" / "05_active_tokens.md")


def glued_text(name: str) -> str:
    """The text/plain record the lab glued under `name`."""
    for cell in json.loads(LAB.read_text())["cells"]:
        for out in cell.get("outputs", []):
            if out.get("metadata", {}).get("scrapbook", {}).get("name") == name:
                return "".join(out["data"]["text/plain"])
    raise AssertionError(f"lab 5 glues no {name!r}")


def test_both_tables_are_glued_into_both_editions_and_equal_a_fresh_budget():
    for version in (vllm_defaults.VLLM_VERSION, "0.33.0"):
        key = f"ch5_budget_table_{version.replace('.', '_')}"
        for page in PAGES:
            assert f"lab.ipynb::{key}`" in page.read_text(), (page.name, key)
        plan = memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", vllm_version=version)
        fresh = repr(budget_table(plan, caption=f"Llama-3.1-8B on H100-SXM, vLLM {version}"))
        assert " ".join(glued_text(key).split()) == " ".join(fresh.split()), version
