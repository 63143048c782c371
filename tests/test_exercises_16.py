"""The exercise answers of chapter 16 (keeping fewer tokens), recomputed by kvlab now.

As in tests/test_exercises_10_15.py: the answers are read from the page's ```{dropdown} Answer``` blocks, and the
numbers kvlab computes today, formatted as the page writes them, must appear there. Offline and fast: token
counts, registry configs and position tensors, no forward passes.
"""

from __future__ import annotations

import torch
from book_pages import answers

from kvlab.experiments import evict
from kvlab.specs import sizing
from kvlab.units import format_bytes

CHAPTER = "16_fewer_tokens"
MODEL = "meta-llama/Llama-3.1-8B"


def assert_in(answer: str, *numbers: str) -> None:
    for number in numbers:
        assert number in answer, f"the answer should say {number!r}: {answer!r}"


def test_two_or_three_answered_exercises() -> None:
    assert 2 <= len(answers(CHAPTER)) <= 3


def test_tokens_each_policy_holds_after_generation() -> None:
    h2o = evict.kept_tokens("h2o", 1000, 200, keep_ratio=0.5)
    snapkv = evict.kept_tokens("snapkv", 1000, 200, keep_ratio=0.5)
    uniform = evict.kept_tokens("uniform", 1000, 200, keep_ratio=0.5)
    assert snapkv == uniform != h2o
    assert_in(answers(CHAPTER)[0], f"H2O holds {h2o:,}", f"hold {snapkv:,}", "1,200", "500")


def test_streaming_bytes_at_128k() -> None:
    kept = sizing.evicted_context(131072, sinks=4, window=2044)
    stored = sizing.kv_cache_bytes(MODEL, kept)
    full = sizing.kv_cache_bytes(MODEL, 131072)
    per_token = format_bytes(sizing.kv_cache_bytes(MODEL, 1))
    assert_in(
        answers(CHAPTER)[1],
        f"{kept:,} tokens of {per_token}",
        f"{format_bytes(stored)} per sequence",
        f"{format_bytes(full)} for the full cache",
        f"{full // stored}× less",
    )


def test_blocks_a_prefix_cache_still_serves() -> None:
    four = torch.tensor([*range(4), *range(128 - 60, 128)])[None, None]
    sixteen = torch.tensor([*range(16), *range(128 - 48, 128)])[None, None]
    assert evict.reusable_prefix_blocks(four, 16) == 0
    assert evict.reusable_prefix_blocks(sixteen, 16) == 1
    assert_in(answers(CHAPTER)[2], "None: token 4", "token 16", "1 block")
