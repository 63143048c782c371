"""The engine's shape (issue 48): one owner for each piece of a request's state, small modules.

- The scheduler alone assigns a request's progress (`num_computed_tokens`); every other engine module reads it.
- A `Request` carries no allocator state: its block tables and what was offered to the prefix cache live in the
  KV-cache manager, keyed by request id, and the KV-cache modules write no attribute of any object but their own.
- No module of `kvlab.engine` passes 450 lines; each module's docstring is short and ends with its chapters, and
  the vLLM files and versions behind the rules live in docs/vllm-fidelity.md, not in the code.
- No manager for state layers: nothing in the engine allocates for them, and the model runner refuses them.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from pathlib import Path

import pytest

from kvlab.engine.block_manager import BlockManager
from kvlab.engine.request import Request

ENGINE = Path(__file__).resolve().parents[1] / "src" / "kvlab" / "engine"
KV_CACHE_MODULES = ("block_manager.py", "single_type_kv_cache_manager.py", "block_pool.py")


def assigned_attributes(path: Path) -> list[tuple[str, str, int]]:
    """(base, attribute, line) of every attribute an assignment in the module writes (`a.b = ...`, `a.b += ...`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target)]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = list(ast.walk(node.target))
        else:
            continue
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                out.append((ast.unparse(t.value), t.attr, t.lineno))
    return out


def writers_of(attribute: str) -> set[str]:
    return {p.name for p in ENGINE.glob("*.py") for _, attr, _ in assigned_attributes(p) if attr == attribute}


def test_only_the_scheduler_assigns_a_requests_progress():
    assert writers_of("num_computed_tokens") == {"scheduler.py"}
    assert writers_of("num_preemptions") == {"scheduler.py"}
    assert writers_of("shared_prefix_boundary") == {"scheduler.py"}


def test_the_check_sees_a_block_manager_that_assigns_progress(tmp_path):
    """Proof the scan can fail: the old block manager's line, put back, is found."""
    mutant = tmp_path / "block_manager.py"
    mutant.write_text(
        (ENGINE / "block_manager.py").read_text() + "\n\ndef f(seq):\n    seq.num_computed_tokens = 0\n"
    )
    assert ("seq", "num_computed_tokens") in {(base, attr) for base, attr, _ in assigned_attributes(mutant)}


@pytest.mark.parametrize("module", KV_CACHE_MODULES)
def test_kv_cache_modules_write_only_their_own_attributes(module):
    foreign = [
        (base, attr, line) for base, attr, line in assigned_attributes(ENGINE / module) if base != "self"
    ]
    assert foreign == [], f"{module} writes another object's state"


def test_a_request_carries_no_allocator_state():
    bm = BlockManager(8, 2, enable_prefix_caching=True, windows=[None, 4])
    allocator_state = set(vars(bm)) | set(vars(bm.block_pool)) | {a for m in bm.managers for a in vars(m)}
    allocator_state |= {"block_tables", "block_table", "slot_limit", "num_published_blocks"}
    request_state = {f.name for f in dataclasses.fields(Request)} | {
        name for name, value in vars(Request).items() if isinstance(value, property)
    }
    assert request_state & allocator_state == set()
    # What the manager keeps per request is keyed by its id
    seq = Request([1, 2, 3, 4, 5])
    hit = bm.get_computed_blocks(seq)
    assert bm.allocate_slots(seq, 5, 0, hit)
    assert all(set(m.req_to_blocks) == set(m.num_cached_block) == {seq.request_id} for m in bm.managers)
    bm.free(seq)
    assert all(not m.req_to_blocks and not m.num_cached_block for m in bm.managers)


def test_no_engine_module_passes_450_lines():
    lengths = {p.name: len(p.read_text().splitlines()) for p in ENGINE.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 450} == {}


def provenance(path: Path) -> list[str]:
    """Comments and docstrings of the module that cite a vLLM file or release (string values are output)."""
    text = path.read_text()
    notes = [
        t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            notes.append(ast.get_docstring(node) or "")
    return [note for note in notes if re.search(r"vllm/|vLLM \d", note)]


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: p.name)
def test_module_docstrings_end_with_their_chapters_and_cite_no_vllm_file(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert re.search(r"Chapters? [0-9][0-9, -]*(and [0-9]+)?\.$", doc), f"{path.name}: no chapter at the end"
    # The package docstring holds the name table; every other module says what it is in about ten lines
    assert path.name == "__init__.py" or len(doc.splitlines()) <= 12, f"{path.name}: docstring too long"
    # The package's name table gives vLLM's paths (vllm/v1/...); the rules' files and versions are in the docs
    assert path.name == "__init__.py" or provenance(path) == []


def test_the_provenance_check_can_fail(tmp_path):
    mutant = tmp_path / "block_pool.py"
    mutant.write_text(
        (ENGINE / "block_pool.py").read_text() + "\n# as vLLM 0.33.0 does (vllm/v1/core/block_pool.py)\n"
    )
    assert provenance(mutant) == ["# as vLLM 0.33.0 does (vllm/v1/core/block_pool.py)"]


def test_no_engine_path_allocates_for_state_layers():
    """vLLM v1 gives Mamba and linear-attention layers their own manager (MambaManager); kvlab's engine has none
    because its model runner refuses such layers at start-up, and the cost runner holds one full-attention group."""
    from kvlab.engine.cost_runner import CostRunner
    from kvlab.engine.kv_pool import KVShape
    from kvlab.engine.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from kvlab.specs.shape import shape

    hybrid = "Qwen/Qwen3-Next-80B-A3B-Thinking"
    assert shape(hybrid).spec.has_state
    with pytest.raises(ValueError, match=r"full and sliding-window attention layers only, not state layers"):
        KVShape.from_config(hybrid)
    assert CostRunner(lambda n, c: 0.0, 8).windows == [None]
    assert {m.kind for m in SingleTypeKVCacheManager.__subclasses__()} == {"full", "sliding"}
