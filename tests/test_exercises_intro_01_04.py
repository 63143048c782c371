"""The numbers of the intro's first screen and the exercise answers of chapters 1-4, recomputed by kvlab.

Each test reads the page as written, takes the text it states (the intro's answer, or one exercise's folded
answer) and asserts that the figure kvlab computes now, formatted as the page writes it, appears there. A
change in kvlab or in a registry config that moves an answer fails here instead of leaving the page wrong.
"""

from __future__ import annotations

import json

import torch
from book_pages import ANSWER, BOOK, answers, lab_parameters, page

from kvlab import models
from kvlab.costs import budget
from kvlab.specs import sizing
from kvlab.specs.shape import shape
from kvlab.units import format_bytes, parse_tokens

LLAMA_8B = "meta-llama/Llama-3.1-8B"


def first_screen(name: str) -> str:
    """The page from its title to its first second-level heading, line breaks folded to spaces."""
    text = page(name).split("\n## ", 1)[0]
    return " ".join(text.split())


def test_answers_are_found():
    text = (
        "x\n```{dropdown} Answer\nIt is **3**\nbytes.\n```\ny\n```{dropdown} How this is checked\nno\n```\n"
    )
    assert [" ".join(a.split()) for a in ANSWER.findall(text)] == ["It is **3** bytes."]


def test_intro_works_the_formula_for_llama_8b():
    layers = shape(LLAMA_8B).spec.layers
    kv_heads, head_dim = layers[0].kv_heads, layers[0].head_dim
    assert all((layer.kv_heads, layer.head_dim) == (kv_heads, head_dim) for layer in layers)
    per_token = sizing.kv_bytes_per_token(LLAMA_8B, "bf16")
    screen = first_screen("intro.md")
    worked = f"{len(layers)} layers × 2 (K and V) × {kv_heads} KV heads × {head_dim} dimensions × 2 bytes"
    assert worked in screen
    assert len(layers) * 2 * kv_heads * head_dim * 2 == per_token
    assert f"**{format_bytes(per_token)} per token**" in screen


def test_intro_states_what_32_users_hold_and_the_h100_pool():
    screen = first_screen("intro.md")
    # Chapter 5's long documents: one number for one quantity across the book.
    tokens = 10_000
    assert "32 × 10,000" in page("05_active_tokens/index.md")
    held = sizing.kv_cache_bytes(LLAMA_8B, tokens, 32, "bf16")
    weights = sizing.weight_bytes(LLAMA_8B, "bf16")
    assert f"users at {tokens:,} tokens each" in screen
    assert f"**{format_bytes(held)}**" in screen
    assert f"{held / weights:.1f} times the model's {format_bytes(weights)} of weights" in screen

    pool = budget.memory_budget(LLAMA_8B, "H100-SXM")
    reserve = pool.capacity_bytes - pool.weight_bytes - pool.kv_pool_bytes
    assert f"H100 SXM ({format_bytes(pool.capacity_bytes)})" in screen
    assert f"**KV pool of {format_bytes(pool.kv_pool_bytes)}**" in screen
    assert f"{format_bytes(reserve)} of reserve" in screen
    assert f"holds {pool.max_tokens():,} tokens: {pool.max_sequences(tokens)} such users" in screen


def test_intro_budget_table_is_term_by_term():
    pool = budget.memory_budget(LLAMA_8B, "H100-SXM")
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in page("intro.md").splitlines()
        if line.startswith("| ") and line.count("|") == 3
    }
    # vLLM 0.34's measured rule: at the defaults no utilisation or reservation cap binds, so these are all the terms
    assert pool.sizing == "measured" and pool.utilization_cap_bytes == pool.reservation_cap_bytes == 0
    expected = [
        ("Memory the driver reports", pool.capacity_bytes),
        ("driver reserve", pool.driver_reserved_bytes + pool.context_bytes),
        ("memory outside PyTorch", pool.runtime_bytes),
        ("weights", pool.weight_bytes),
        ("CUDA graphs", pool.cuda_graph_bytes),
        ("margin", pool.margin_bytes),
        ("transient peak", pool.transient_bytes),
        ("KV pool", pool.kv_pool_bytes),
    ]
    terms = sum(value for _, value in expected[1:-1])
    assert pool.capacity_bytes - terms - pool.kv_pool_bytes == pool.rounding_bytes, (
        "the table is the whole budget"
    )
    for label, value in expected:
        cells = [cell for row, cell in rows.items() if label in row]
        assert cells, f"intro.md: no budget row for {label!r}"
        assert format_bytes(value) in cells[0], (label, cells[0], format_bytes(value))
    assert f"{pool.num_blocks:,} blocks of {pool.block_size} tokens" in page("intro.md")


def test_intro_lists_every_chapter_with_its_question():
    intro = page("intro.md")
    for chapter in sorted(BOOK.glob("[01]*/index.md")):
        title = chapter.read_text().splitlines()[0].removeprefix("# ")
        link = f"[{title}]({chapter.parent.name}/index.md)"
        row = [line for line in intro.splitlines() if link in line]
        assert row, f"intro.md: no table row links {link}"
        assert row[0].rstrip(" |").endswith("?"), f"intro.md: the row of {title} asks no question"


def test_intro_credits_the_source_article():
    assert "KV Cache 为什么会占用大量 GPU 显存，它到底保存了什么数据" in first_screen("intro.md")
    assert "128 bytes per token" in first_screen("intro.md")
    ratio = sizing.kv_bytes_per_token(LLAMA_8B, "bf16") // 128
    assert f"{ratio:,} times larger" in first_screen("intro.md")


def test_ch1_more_kv_heads_grow_each_step():
    lab = lab_parameters("01_cache_contents")
    knobs = {k: lab[k] for k in ("layers", "hidden", "heads", "vocab")}
    default = sizing.kv_bytes_per_token(
        models.tiny_config(lab["family"], kv_heads=lab["kv_heads"], **knobs), torch.float32
    )
    changed = sizing.kv_bytes_per_token(models.tiny_config(lab["family"], kv_heads=8, **knobs), torch.float32)
    answer = answers("01_cache_contents/index.md")[0]
    assert (
        f"{changed:,} bytes per token, against {default:,} with the default {lab['kv_heads']} KV heads"
        in answer
    )
    assert f"{changed // default} times more" in answer


def test_ch1_a_conversation_is_not_its_cache():
    tokens = parse_tokens("8k")
    cache = sizing.kv_cache_bytes(LLAMA_8B, tokens, 1, "bf16")
    ids = tokens * 4
    answer = answers("01_cache_contents/index.md")[1]
    assert f"The cache is {format_bytes(cache)}; the token ids are {format_bytes(ids)}" in answer
    assert f"{cache // ids:,} times less" in answer


QWEN_7B = "Qwen/Qwen2.5-7B"


def worked_example() -> str:
    text = page("02_sizing/index.md")
    section = text.split("## Worked example", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())


def test_ch2_worked_example_bytes_per_token():
    config = json.loads(
        (BOOK.parent / "src" / "kvlab" / "specs" / "configs" / "Qwen--Qwen2.5-7B.json").read_text()
    )
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = sizing.kv_bytes_per_token(QWEN_7B, "bf16")
    assert layers * 2 * kv_heads * head_dim * 2 == per_token
    text = worked_example()
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size"):
        assert f'"{field}": {config[field]}' in text
    assert f"{layers} layers × 2 × {kv_heads} KV heads × {head_dim} × 2 bytes = {per_token:,} bytes" in text
    assert f"or {format_bytes(per_token)}" in text
    tokens = parse_tokens("8k")
    assert f"{tokens:,} tokens × {format_bytes(per_token)} = {format_bytes(tokens * per_token)}" in text


def largest_max_num_seqs(model: str, gpu: str, context: int) -> int:
    """The --max-num-seqs whose own budget holds that many sequences of `context` tokens (a fixed point)."""
    seqs = budget.memory_budget(model, gpu).max_sequences(context)
    while (fit := budget.memory_budget(model, gpu, max_num_seqs=seqs).max_sequences(context)) != seqs:
        assert fit > seqs, "a smaller max_num_seqs never shrinks the pool"
        seqs = fit
    return seqs


def test_ch2_worked_example_pool_and_max_num_seqs():
    tokens = parse_tokens("8k")
    default = budget.memory_budget(QWEN_7B, "H100-SXM")
    text = worked_example()
    assert f"the {format_bytes(default.weight_bytes)} of weights" in text
    assert (
        f"{format_bytes(default.kv_pool_bytes)} pool: {default.max_sequences(tokens)} requests of 8k" in text
    )
    seqs = largest_max_num_seqs(QWEN_7B, "H100-SXM", tokens)
    tuned = budget.memory_budget(QWEN_7B, "H100-SXM", max_num_seqs=seqs)
    assert f"`--max-num-seqs {seqs}`" in text
    assert f"the pool grows to {format_bytes(tuned.kv_pool_bytes)}, and exactly {seqs} requests" in text
    assert f"max_num_seqs={seqs})" in text
    assert f"{seqs} sequences of {tokens:,} tokens fit" in text


def test_ch2_fp8_halves_llama():
    answer = answers("02_sizing/index.md")[0]
    per_token = format_bytes(sizing.kv_bytes_per_token(LLAMA_8B, "fp8"))
    full = format_bytes(sizing.kv_cache_bytes(LLAMA_8B, parse_tokens("128k"), 1, "fp8"))
    assert f"{per_token} per token and {full} at 128k tokens" in answer


def test_ch2_qwen_crossover_at_batch_8():
    answer = answers("02_sizing/index.md")[1]
    crossover = sizing.crossover_context(QWEN_7B, 8, "bf16", "bf16")
    assert crossover is not None
    assert f"At {crossover:,} tokens each" in answer
    assert f"the {format_bytes(sizing.weight_bytes(QWEN_7B, 'bf16'))} of weights" in answer
    assert f'crossover_context("{QWEN_7B}", 8)' in answer
