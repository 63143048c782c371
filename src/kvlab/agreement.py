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
from typing import Any, Protocol, cast

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Agreement:
    """How two token sequences compare under the top-k rule."""

    # Positions compared: the shorter sequence's length
    length: int
    # None: identical over `length` positions
    first_difference: int | None
    # Each side's token at the first difference
    token_a: int | None = None
    token_b: int | None = None
    # Side A's token is among side B's top-k candidates there
    a_in_b_topk: bool = True
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


def top_k_ids(logits: torch.Tensor, k: int, first: Sequence[int] | None = None) -> list[list[int]]:
    """Per position, the ids of the `k` largest logits of a (positions, vocab) tensor, best first
    (log-probabilities rank the same way, so logits do).

    `first[i]`, when given, is the token a sampler chose at position i: it is put first and followed by the k - 1
    best others, so a greedy choice leads its list even where `topk` would break an exact tie the other way.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be (positions, vocab), got shape {tuple(logits.shape)}")
    if first is not None and len(first) != logits.shape[0]:
        raise ValueError(f"first has {len(first)} tokens for {logits.shape[0]} positions")
    best: list[list[int]] = logits.float().topk(min(k, logits.shape[-1]), dim=-1).indices.tolist()
    if first is None:
        return best
    return [
        [int(t), *[b for b in row if b != int(t)]][: len(row)] for t, row in zip(first, best, strict=True)
    ]


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
    top_a: Sequence[Sequence[Sequence[int]] | None] | None = None,
    top_b: Sequence[Sequence[Sequence[int]] | None] | None = None,
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


class Generation(Protocol):
    """What `check_outputs_close` reads of an output: the engine's `RequestOutput` has both."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def top_token_ids(self) -> list[list[int]] | None: ...


def check_outputs_close(
    outputs_a: Sequence[Generation], outputs_b: Sequence[Generation], *, names: tuple[str, str]
) -> list[Agreement]:
    """`check_tokens_close` on two runs' outputs, request by request, with the top ids each run recorded."""
    return check_tokens_close(
        [o.token_ids for o in outputs_a],
        [o.token_ids for o in outputs_b],
        [o.top_token_ids for o in outputs_a],
        [o.top_token_ids for o in outputs_b],
        names=names,
    )


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    """The token ids that end a sequence in `model`'s generation config (none where it names none)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


@torch.inference_mode()
def generate_with_top_k(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    k: int,
    *,
    stop_at_eos: bool = True,
    **generate_kwargs: Any,
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Greedy `model.generate` with, per generated position, the ids of the `k` largest logits.

    `input_ids` is (batch, prompt_len) without padding (one prompt per call when lengths differ). Returns, per
    row, the generated ids and their top-k lists (`top_k_ids` of the raw logits, the chosen token first), the
    other side of a `check_tokens_close` against `LLMEngine` outputs with `SamplingParams(logprobs=k)`. With
    `stop_at_eos`, a row ends at its first end-of-sequence token (kept), as the engine's requests do.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, prompt_len), got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    kwargs: dict[str, Any] = {"do_sample": False, **generate_kwargs}
    # GenerationMixin's method; mypy sees nn.Module's __getattr__.
    out = cast(Any, model).generate(
        input_ids.to(model.device),
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    generated = out.sequences[:, input_ids.shape[1] :].tolist()
    # (batch, steps, vocab): raw logits, before any logits processor
    logits = torch.stack(out.logits, dim=1)
    eos_ids = eos_token_ids(model) if stop_at_eos else set()
    tokens, tops = [], []
    for row, row_logits in zip(generated, logits, strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        tokens.append(row[:end])
        tops.append(top_k_ids(row_logits[:end], k, first=row[:end]))
    return tokens, tops
