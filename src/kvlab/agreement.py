"""Do two generations agree? Exact equality where it holds, and the check serving engines use where it cannot.

Two schedules of the same model (one request alone and the same request in a batch, paged against contiguous
attention, a prefix served from cache against one recomputed) run matmuls of different shapes. On a GPU their
logits differ in the last bits, and where two tokens are nearly tied the greedy choice can flip; after that the
two continuations are different texts and comparing them further says nothing. vLLM's tests therefore accept
two outputs when they agree up to the first position where they differ and, at that position, each side's
token is among the other side's top-k candidates (its `check_logprobs_close` helper). This module implements
that rule, written for kvlab's own outputs: token ids and, per position, the top-k token ids of each side.

Chapters that compare schedules token by token: *Paged KV cache*, *Continuous batching*, *Prefix caching*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """How two token sequences compare under the top-k rule."""

    length: int  # positions compared: the shorter sequence's length
    first_difference: int | None  # None: identical over `length` positions
    token_a: int | None = None  # each side's token at the first difference
    token_b: int | None = None
    a_in_b_topk: bool = True  # side A's token is among side B's top-k candidates there
    b_in_a_topk: bool = True

    @property
    def exact(self) -> bool:
        return self.first_difference is None

    @property
    def close(self) -> bool:
        """Identical, or differing first at a near-tie: each token is among the other side's top k."""
        return self.exact or (self.a_in_b_topk and self.b_in_a_topk)

    def describe(self) -> str:
        if self.exact:
            return f"identical over {self.length} tokens"
        verdict = "a near-tie" if self.close else "NOT a near-tie"
        return (
            f"identical up to position {self.first_difference}, then {self.token_a} vs {self.token_b}: {verdict} "
            f"(A's token in B's top-k: {self.a_in_b_topk}, B's in A's: {self.b_in_a_topk})"
        )


def top_k_ids(logits: torch.Tensor, k: int) -> list[list[int]]:
    """Per position, the ids of the `k` largest logits of a (positions, vocab) tensor (log-probabilities rank the
    same way, so logits do)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be (positions, vocab), got shape {tuple(logits.shape)}")
    return logits.float().topk(min(k, logits.shape[-1]), dim=-1).indices.tolist()


def compare_tokens(
    tokens_a: Sequence[int],
    tokens_b: Sequence[int],
    top_a: Sequence[Sequence[int]] | None = None,
    top_b: Sequence[Sequence[int]] | None = None,
) -> Agreement:
    """Compare two generations position by position, stopping at the first difference.

    `top_a[i]` lists side A's top-k token ids at position i (the candidates it chose token i among); likewise
    `top_b`. Without them a difference is never close. Positions past the shorter sequence are not compared.
    """
    tokens_a, tokens_b = [int(t) for t in tokens_a], [int(t) for t in tokens_b]
    length = min(len(tokens_a), len(tokens_b))
    for name, top in (("top_a", top_a), ("top_b", top_b)):
        if top is not None and len(top) < length:
            raise ValueError(f"{name} has {len(top)} positions for {length} compared tokens")
    for i in range(length):
        a, b = tokens_a[i], tokens_b[i]
        if a == b:
            continue
        a_in_b = top_b is not None and a in {int(t) for t in top_b[i]}
        b_in_a = top_a is not None and b in {int(t) for t in top_a[i]}
        return Agreement(length, i, a, b, a_in_b, b_in_a)
    return Agreement(length, None)


def check_tokens_close(
    outputs_a: Sequence[Sequence[int]],
    outputs_b: Sequence[Sequence[int]],
    top_a: Sequence[Sequence[Sequence[int]]] | None = None,
    top_b: Sequence[Sequence[Sequence[int]]] | None = None,
    *,
    names: tuple[str, str] = ("A", "B"),
) -> list[Agreement]:
    """`compare_tokens` for each request; raises AssertionError naming the first request that is not close.

    Returns every request's `Agreement`, so a lab can count how many were exact and how many near-ties.
    """
    if len(outputs_a) != len(outputs_b):
        raise ValueError(f"{names[0]} has {len(outputs_a)} outputs, {names[1]} has {len(outputs_b)}")
    results = []
    for i, (a, b) in enumerate(zip(outputs_a, outputs_b, strict=True)):
        result = compare_tokens(
            a, b, None if top_a is None else top_a[i], None if top_b is None else top_b[i]
        )
        if not result.close:
            raise AssertionError(f"request {i}: {names[0]} vs {names[1]}: {result.describe()}")
        results.append(result)
    return results
