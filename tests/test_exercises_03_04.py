"""The first paragraphs and exercise answers of chapters 3 and 4, recomputed by kvlab.

Each test reads the page as written, takes the text it states (one exercise's folded answer, the takeaways box
or a sentence of the prose) and asserts that the figure kvlab computes now, formatted as the page writes it,
appears there. Everything is computed from datasheets and registry configs (big models on the meta device
through kvlab's own functions); nothing here times a step or runs a lab.
"""

from __future__ import annotations

import json
import re

import pytest
from book_pages import ANSWER, BOOK, TAKEAWAYS, answers, flat, lab_parameters, page

from kvlab.costs import budget, roofline
from kvlab.specs import hardware, sizing
from kvlab.units import format_bytes, format_floor, parse_tokens

LLAMA_8B = "meta-llama/Llama-3.1-8B"
H100 = "H100-SXM"
CHAPTERS = ["03_prefill_decode", "04_bandwidth_bound"]
CHECKED = re.compile(r"```\{dropdown\} How this is checked\n(.*?)\n```\n", re.DOTALL)


def exercises(chapter: str) -> str:
    return flat(page(chapter).split("\n## Exercises\n", 1)[1])


def ms_floor(seconds: float, decimals: int) -> str:
    """A roofline time in ms as the lab glues it: a lower bound, rounded down."""
    return format_floor(seconds * 1e3, decimals)


def test_answers_and_takeaways_are_found():
    text = "x\n```{dropdown} Answer\nIt is **3**\nbytes.\n```\n:::{admonition} Takeaways\n- a\n- b\n:::\n"
    assert [flat(a) for a in ANSWER.findall(text)] == ["It is **3** bytes."]
    assert TAKEAWAYS.findall(text) == ["- a\n- b"]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_ends_with_takeaways_and_answered_exercises(chapter):
    text = page(chapter)
    (box,) = TAKEAWAYS.findall(text)
    bullets = [line for line in box.splitlines() if line.startswith("- ")]
    assert 3 <= len(bullets) <= 5, f"{chapter}: {len(bullets)} takeaways"
    assert ":class: tip kvlab-takeaways" in text
    assert 2 <= len(answers(chapter)) <= 3
    assert text.index(":::{admonition} Takeaways") < text.index("\n## Exercises\n")
    assert "kvlab sweep book/" in exercises(chapter), "one exercise runs the lab over a parameter"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_protocol_is_folded_once(chapter):
    text = page(chapter)
    assert len(CHECKED.findall(text)) == 1, f"{chapter}: one 'How this is checked' block"
    assert "## What is asserted" not in text
    (folded,) = CHECKED.findall(text)
    visible = text.replace(folded, "")
    # The lab's machine string and the asserted list live only in the folded block.
    for key in ("_regime:s", "_ratio_high:s", "_attempts:s"):
        assert key not in visible, f"{chapter}: {key} is outside 'How this is checked'"
    assert "load average" not in visible


def test_ch3_first_paragraph_answers_with_computed_floors():
    lab = lab_parameters("03_prefill_decode")
    answer = flat(page("03_prefill_decode").split("**The answer.**", 1)[1].split("\n## ")[0])
    assert lab["full_model"] == LLAMA_8B and lab["full_gpu"] == H100
    for key in ("ch3_full_ttft_last", "ch3_full_itl0", "ch3_full_itl_last"):
        assert f"lab.ipynb::{key}:s" in answer


def test_ch3_an_h200_leaves_ttft_and_speeds_decode():
    lab = lab_parameters("03_prefill_decode")
    model, short, long = lab["full_model"], lab["full_prompts"][0], lab["full_prompts"][-1]
    assert 'Set `full_gpu = "H200"`' in exercises("03_prefill_decode")
    assert f"--grid full_gpu={lab['full_gpu']},H200" in exercises("03_prefill_decode")
    answer = answers("03_prefill_decode")[0]
    # Prefill is compute-bound and both parts have the same dense bf16 peak: TTFT is the H100's.
    assert hardware.get("H200").flops == hardware.get(H100).flops
    ttft_short = ms_floor(roofline.prefill_time(model, "H200", 1, short, dtype="bf16"), 1)
    ttft_long = format_floor(roofline.prefill_time(model, "H200", 1, long, dtype="bf16"), 1)
    assert ttft_short == ms_floor(roofline.prefill_time(model, H100, 1, short, dtype="bf16"), 1)
    assert f"at least {ttft_short} ms at 1k tokens and {ttft_long} s at 128k" in answer
    step = {
        gpu: [ms_floor(roofline.decode_step_time(model, gpu, 1, c, dtype="bf16"), 2) for c in (short, long)]
        for gpu in (H100, "H200")
    }
    assert f"at least {step['H200'][0]} ms at 1k tokens and {step['H200'][1]} ms at 128k" in answer
    assert f"(from {step[H100][0]} ms and {step[H100][1]} ms)" in answer


def test_ch3_a_32k_document_waits_and_leaves_its_cache():
    tokens = parse_tokens("32k")
    answer = answers("03_prefill_decode")[1]
    assert "32k-token document" in exercises("03_prefill_decode")
    wait = format_floor(roofline.prefill_time(LLAMA_8B, H100, 1, tokens, dtype="bf16"), 2)
    cache = format_bytes(sizing.kv_cache_bytes(LLAMA_8B, tokens, 1, "bf16"))
    assert f"At least {wait} s" in answer
    assert f"and {cache} of cache" in answer


def test_ch4_first_paragraph_answers_with_the_h100_and_h200_steps():
    lab = lab_parameters("04_bandwidth_bound")
    answer = flat(page("04_bandwidth_bound").split("**The answer.**", 1)[1].split("\n## ")[0])
    assert answer.startswith("No.")
    assert (lab["spec_model"], lab["spec_gpu"], lab["spec_more_bandwidth"]) == (LLAMA_8B, H100, "H200")
    for key in ("ch4_itl_h100", "ch4_itl_h200", "ch4_spec_bw_gpu"):
        assert f"lab.ipynb::{key}:s" in answer
    short = lab["spec_contexts"][0]
    h100, h200 = (roofline.decode_step_time(LLAMA_8B, gpu, 1, short, dtype="bf16") for gpu in (H100, "H200"))
    assert h200 < h100, "the part with more bandwidth decodes faster"


def test_ch4_critical_batch_is_the_cheat_sheets_at_one_token():
    """Chapter 4's critical batch (at its short context) and the appendix's (at one token) differ by context."""
    lab = lab_parameters("04_bandwidth_bound")
    one_token = roofline.critical_batch_size(LLAMA_8B, H100, 1, dtype="bf16")
    short = roofline.critical_batch_size(LLAMA_8B, H100, lab["spec_contexts"][0], dtype="bf16")
    assert one_token is not None and short is not None and one_token < short
    assert abs(one_token - hardware.get(H100).ridge_flops_per_byte) < 2, "with an empty cache: the ridge"
    text = flat(page("04_bandwidth_bound"))
    assert f"With a one-token context it is about the ridge, {one_token:.0f} ([cheat sheet]" in text
    appendix = json.loads((BOOK / "appendix_cheat_sheet" / "lab.ipynb").read_text())
    cell = next(c for c in appendix["cells"] if 'glue("app_critical"' in "".join(c["source"]))
    assert "critical_batch_size(model, acc, 1, dtype, dtype)" in "".join(cell["source"]), (
        "the appendix's is at 1"
    )


def test_ch4_the_critical_batch_moves_with_the_model():
    lab = lab_parameters("04_bandwidth_bound")
    short, one_k = lab["spec_contexts"][0], 1024
    assert one_k in lab["spec_contexts"]
    assert f"--grid spec_model={LLAMA_8B},meta-llama/Llama-3.1-70B" in exercises("04_bandwidth_bound")
    answer = answers("04_bandwidth_bound")[0]
    crit = {
        m: roofline.critical_batch_size(m, H100, short, dtype="bf16")
        for m in (LLAMA_8B, "meta-llama/Llama-3.1-70B")
    }
    assert f"the critical batch is {crit[LLAMA_8B]:.0f} sequences for Llama-3.1-8B" in answer
    assert f"and {crit['meta-llama/Llama-3.1-70B']:.0f} for Llama-3.1-70B" in answer
    assert roofline.critical_batch_size(LLAMA_8B, H100, one_k, dtype="bf16") is None
    assert "the 8B model never turns compute-bound" in answer
    big = roofline.critical_batch_size("meta-llama/Llama-3.1-70B", H100, one_k, dtype="bf16")
    assert big is not None and f"the 70B model does from {big:.0f} sequences" in answer


def test_ch4_8k_requests_on_an_h20_with_an_fp8_cache():
    tokens = parse_tokens("8k")
    fp8 = budget.memory_budget(LLAMA_8B, "H20", kv_dtype="fp8")
    bf16 = budget.memory_budget(LLAMA_8B, "H20", kv_dtype="bf16")
    answer = answers("04_bandwidth_bound")[1]
    assert "8k-token requests fit on one H20" in exercises("04_bandwidth_bound")
    assert (
        f"{fp8.max_sequences(tokens)} requests of {tokens:,} tokens, in a KV pool of "
        f"{format_bytes(fp8.kv_pool_bytes)} out of {format_bytes(fp8.capacity_bytes)}, "
        f"against {bf16.max_sequences(tokens)} with a bf16 cache" in answer
    )
