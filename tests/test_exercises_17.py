"""The exercise answers of chapter 17 (the cache across a cluster), recomputed by kvlab now.

As in tests/test_exercises_16.py: the answers are read from the page's ```{dropdown} Answer``` blocks, and the
numbers kvlab computes today, formatted as the page writes them, must appear there. Offline and fast: registry
configs, the cited link table and the roofline.
"""

from __future__ import annotations

from book_pages import answers

from kvlab.offload.reload import recompute_vs_reload
from kvlab.offload.tiers import link
from kvlab.planning.cluster import Transfer
from kvlab.planning.router import prefix_affinity
from kvlab.specs import hardware, sizing
from kvlab.units import format_bytes

CHAPTER = "17_cluster"
MODEL = "meta-llama/Llama-3.1-8B"
NDR = "400 Gb InfiniBand NDR"


def assert_in(answer: str, *numbers: str) -> None:
    for number in numbers:
        assert number in answer, f"the answer should say {number!r}: {answer!r}"


def test_two_or_three_answered_exercises() -> None:
    assert 2 <= len(answers(CHAPTER)) <= 3


def test_the_bytes_and_time_of_one_transfer() -> None:
    per_token = sizing.kv_bytes_per_token(MODEL, "bf16")
    total = sizing.kv_cache_bytes(MODEL, 4000, 1, "bf16")
    seconds = Transfer.over(link(NDR), per_token).seconds(4000)
    assert_in(
        answers(CHAPTER)[0],
        f"4,000 tokens of {format_bytes(per_token)}",
        f"{format_bytes(total)}, or {total:,} bytes",
        f"At {link(NDR).bytes_per_s / 1e9:g} GB/s",
        f"{seconds * 1e3:.1f} ms",
    )


def test_prefill_against_transfer() -> None:
    estimate = recompute_vs_reload(MODEL, hardware.get("H100-SXM"), link(NDR), 4000, "bf16", "bf16")
    longer = recompute_vs_reload(MODEL, hardware.get("H100-SXM"), link(NDR), 16000, "bf16", "bf16")
    assert longer.speedup > estimate.speedup  # attention's FLOPs: the ratio rises with length
    assert_in(
        answers(CHAPTER)[1],
        f"prefill at {estimate.recompute_s * 1e3:.1f} ms ({estimate.prefill_flops / 1e12:.0f} TFLOP)",
        f"transfer at {estimate.reload_s * 1e3:.1f} ms",
        f"{estimate.speedup:.1f}× longer",
    )


def test_prefills_of_a_system_prompt() -> None:
    """Affinity hashes a tenant's prompt to one replica whatever follows its first blocks."""
    system = list(range(2, 2002))
    picks = {prefix_affinity(system + [9000 + i] * 40, 4, 16, 8) for i in range(20)}
    assert len(picks) == 1
    assert_in(answers(CHAPTER)[2], "four times, once per replica", "once, on the one replica")
