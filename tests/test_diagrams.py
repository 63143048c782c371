"""The book's diagrams (kvlab.book.diagrams): drawn from the state they are given, readable, and committed as built."""

from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from kvlab.book import diagrams
from kvlab.costs.budget import memory_budget
from kvlab.specs.shape import shape
from kvlab.specs.sizing import kv_bytes_per_token
from kvlab.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]


def texts(fig: Figure) -> list[Text]:
    """Every visible, non-empty text of the figure, laid out."""
    FigureCanvasAgg(fig).draw()
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def by_gid(fig: Figure) -> dict[str, str]:
    return {t.get_gid(): t.get_text() for t in texts(fig) if t.get_gid()}


@pytest.fixture(scope="module")
def built() -> dict[str, Figure]:
    return {name: d.build() for name, d in diagrams.DIAGRAMS.items()}


def test_committed_svgs_equal_a_fresh_run(built):
    for name, fig in built.items():
        committed = ROOT / "book" / "diagrams" / f"{name}.svg"
        assert committed.is_file(), f"{committed} missing: run `make diagrams`"
        fresh = diagrams.svg_bytes(fig)
        assert fresh == committed.read_bytes(), f"{name}.svg differs from a fresh run: run `make diagrams`"
        assert fresh == diagrams.svg_bytes(fig), f"{name}: two renderings differ"
        assert b"<text" in fresh and b"Date" not in fresh, f"{name}: text not kept as text, or dated"


def test_every_diagram_is_on_its_page():
    for d in diagrams.DIAGRAMS.values():
        page = (ROOT / "book" / d.chapter / "index.md").read_text()
        assert f"../diagrams/{d.name}.svg" in page, f"book/{d.chapter}/index.md does not show {d.name}.svg"


def test_text_is_large_inside_the_figure_and_never_overlaps(built):
    for name, fig in built.items():
        width, _ = fig.get_size_inches()
        assert width <= diagrams.WIDTH_INCHES <= 7.17
        items = texts(fig)
        frame = fig.bbox
        boxes = []
        for t in items:
            assert t.get_fontsize() >= diagrams.MIN_FONT_PT, (
                f"{name}: {t.get_text()!r} at {t.get_fontsize()} pt"
            )
            box = t.get_window_extent()
            assert box.x0 >= frame.x0 and box.y0 >= frame.y0 and box.x1 <= frame.x1 and box.y1 <= frame.y1, (
                f"{name}: {t.get_text()!r} leaves the figure"
            )
            boxes.append((t.get_text(), box.expanded(1.0, 1.0).shrunk(0.98, 0.9)))
        for i, (a, box_a) in enumerate(boxes):
            for b, box_b in boxes[i + 1 :]:
                assert not box_a.overlaps(box_b), f"{name}: {a!r} overlaps {b!r}"


def test_cache_contents_follows_the_config():
    for name in ("meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B"):
        model = shape(name)
        layer = model.spec.layers[0]
        labels = by_gid(diagrams.cache_contents(model, kv_bytes_per_token(name)))
        assert labels["bytes-per-token"].endswith(format_bytes(kv_bytes_per_token(name)))
        assert f"{model.spec.num_layers} layers × 2 × {layer.kv_heads} heads" in labels["bytes-per-token"]
        assert f"layer-{model.spec.num_layers - 1}" in labels
        assert labels["hidden-size"] == f"{model.hidden_size:,} values"
    with pytest.raises(ValueError, match="full-attention"):
        diagrams.cache_contents(shape("google/gemma-2-9b"), kv_bytes_per_token("google/gemma-2-9b"))


def test_budget_bar_is_the_budget():
    budget = memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    terms = diagrams.budget_terms(budget)
    assert sum(value for _, value, _ in terms) == budget.capacity_bytes
    labels = by_gid(diagrams.budget_stack(budget, "t"))
    assert labels["term-KV pool"].endswith(format_bytes(budget.kv_pool_bytes))
    assert labels["term-weights"].endswith(format_bytes(budget.weight_bytes))
    # vLLM 0.34's measured rule keeps a margin and the transient peak free; 0.33's took an engine cap first
    assert {"term-margin", "term-transient peak"} <= set(labels) and "term-engine cap" not in labels
    older = memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM", vllm_version="0.33.0")
    assert sum(value for _, value, _ in diagrams.budget_terms(older)) == older.capacity_bytes
    squeezed = memory_budget(
        "meta-llama/Llama-3.1-8B", "H100-SXM", gpu_memory_utilization=0.8, vllm_version="0.33.0"
    )
    changed = by_gid(diagrams.budget_stack(squeezed, "t"))
    assert changed["term-engine cap"] == f"engine cap (1 − 0.8): {format_bytes(squeezed.engine_cap_bytes)}"
    assert changed["term-KV pool"] != by_gid(diagrams.budget_stack(older, "t"))["term-KV pool"]
    with pytest.raises(ValueError, match="does not fit"):
        diagrams.budget_terms(memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM"))


def test_block_table_shows_the_managers_tables_and_pool():
    manager, seqs = diagrams.paged_state()
    labels = by_gid(diagrams.block_table(manager, seqs))
    for seq in seqs:
        for logical, block_id in enumerate(manager.get_block_ids(seq.request_id)[0]):
            assert labels[f"table-{seq.request_id}-{logical}"] == f"#{block_id}"
            assert labels[f"pool-{block_id}"] == f"{seq.request_id} {logical}"
    states = [labels[f"pool-{b}"] for b in range(manager.num_blocks)]
    pool = manager.block_pool
    cached = [b for b in range(manager.num_blocks) if not pool.ref_cnt[b] and pool.block_keys[b]]
    assert cached and [b for b, s in enumerate(states) if s == "cached"] == cached
    assert states.count("free") == manager.num_free_blocks - len(cached)
    # Another state, another drawing: B finishes, its full block stays cached, its partial one is free.
    b = seqs[1]
    blocks = list(manager.get_block_ids(b.request_id)[0])
    manager.free(b)
    after = by_gid(diagrams.block_table(manager, [seqs[0], seqs[2]]))
    assert [after[f"pool-{block}"] for block in blocks] == ["cached", "free"]
    assert "table-B-0" not in after


def test_hash_chain_marks_where_the_hashes_first_differ():
    manager, admissions = diagrams.shared_prompts()
    first, second = admissions[0].seq, admissions[1].seq
    diverge = next(
        i for i, (a, b) in enumerate(zip(first.block_hashes, second.block_hashes, strict=False)) if a != b
    )
    labels = by_gid(diagrams.hash_chain(manager, admissions))
    assert labels["divergence"] == f"B diverges at block {diverge}"
    for a in admissions:
        for i, digest in enumerate(a.seq.block_hashes):
            assert labels[f"hash-{a.seq.request_id}-{i}"] == f"#{diagrams.short_hash(digest)}"
    statuses = [labels[f"status-C-{i}"] for i in range(3)]
    # C is A's first three blocks, all cached: the last is computed again (one token always is).
    assert admissions[2].hit_blocks == 2 and statuses == ["hit", "hit", "recomputed"]
    assert [labels[f"status-B-{i}"] for i in range(4)] == ["hit", "hit", "computed", "computed"]
    assert labels["hash-A-3"] == "no hash"  # the partial block
    # A prompt diverging in its first block shares nothing.
    fresh = diagrams.BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    other = diagrams.admit_in_order(fresh, [("A", list(range(8))), ("B", [99] + list(range(1, 8)))])
    assert by_gid(diagrams.hash_chain(fresh, other))["divergence"] == "B diverges at block 0"
    assert other[1].hit_blocks == 0


def test_batching_timeline_is_the_runs():
    runs = diagrams.batching_runs()
    (_, static), (_, continuous) = runs
    static_spans, continuous_spans = diagrams.request_steps(static), diagrams.request_steps(continuous)
    # Static: the second batch starts only once the whole first batch has finished.
    assert min(s for s, _ in static_spans[4:]) == max(e for _, e in static_spans[:4]) + 1
    # Continuous: a freed slot is filled at the next step (R2, 3 tokens, frees one after step 3).
    assert continuous_spans[4][0] == continuous_spans[1][1] + 1 < static_spans[4][0]
    for (_, result), (start, end) in zip(runs, [static_spans[0], continuous_spans[0]], strict=True):
        assert end - start + 1 == result.requests[0].num_output_tokens
    labels = by_gid(diagrams.batching_timeline(runs))
    assert labels["panel-0"].startswith(f"static: {len(static.step_stats)} steps")
    assert labels["panel-1"].startswith(f"continuous: {len(continuous.step_stats)} steps")


def test_tp_heads_split_then_copied():
    labels = by_gid(diagrams.tp_heads(8, [(4, 1), (16, 2)], "t"))
    assert [labels[f"tp4-rank{r}"] for r in range(4)] == [
        "heads 0, 1",
        "heads 2, 3",
        "heads 4, 5",
        "heads 6, 7",
    ]
    sixteen = [labels[f"tp16-rank{r}"] for r in range(16)]
    assert all(sixteen.count(f"head {h}") == 2 for h in range(8))
    assert labels["plan-16"] == "TP=16: each head on 2 GPUs"
    two = by_gid(diagrams.tp_heads(2, [(8, 4)], "t"))
    assert sorted(two[f"tp8-rank{r}"] for r in range(8)) == ["head 0"] * 4 + ["head 1"] * 4


def test_a_diagram_does_not_depend_on_the_style_left_in_rcparams():
    import matplotlib as mpl

    diagram = diagrams.DIAGRAMS["continuous_batching"]
    clean = diagrams.svg_bytes(diagram.build())
    with mpl.rc_context({"font.size": 20, "legend.fontsize": 14, "lines.linewidth": 3}):
        assert diagrams.svg_bytes(diagram.build()) == clean


def test_kept_tokens_marks_the_first_block_that_lost_a_token():
    full = list(range(64))
    streaming = [0, 1, 2, 3, *range(36, 64)]
    # Two whole blocks of 16, then a gap at position 40
    prefix = [*range(32), *range(41, 64)]
    fig = diagrams.kept_tokens([("full", full), ("sinks", streaming), ("prefix", prefix)], 64, 16)
    labels = by_gid(fig)
    assert labels["row-0"] == "full: 64 kept, every block whole"
    assert labels["row-1"] == "sinks: 32 kept, 0 of 4 blocks whole"
    assert labels["row-2"] == "prefix: 55 kept, 2 of 4 blocks whole"
    assert all(t.get_fontsize() >= diagrams.MIN_FONT_PT for t in texts(fig))
    with pytest.raises(ValueError, match="distinct and below 64"):
        diagrams.kept_tokens([("bad", [0, 64])], 64, 16)
    with pytest.raises(ValueError, match="1 to 16 blocks"):
        diagrams.kept_tokens([("long", full)], 512, 16)
