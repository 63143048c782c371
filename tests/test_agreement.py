"""kvlab.agreement: exact equality, and vLLM's rule for near-tied tokens (first difference within top-k)."""

import pytest
import torch
from transformers import LogitsProcessorList

from kvlab.agreement import (
    check_outputs_close,
    check_tokens_close,
    compare_tokens,
    generate_with_top_k,
    top_k_ids,
)
from kvlab.models import tiny_model


def test_identical_sequences_are_exact():
    result = compare_tokens([1, 2, 3], [1, 2, 3])
    assert result.exact and result.close and result.first_difference is None and result.length == 3


def test_shorter_sequence_bounds_the_comparison():
    assert compare_tokens([1, 2, 3, 9], [1, 2, 3]).exact


def test_near_tie_at_first_difference_is_close_and_later_positions_are_ignored():
    # position 1 differs: 5 vs 6, each among the other's top-2; afterwards the texts diverge freely
    top_a = [[1, 0], [5, 6], [0, 1]]
    top_b = [[1, 0], [6, 5], [9, 8]]
    result = compare_tokens([1, 5, 0], [1, 6, 9], top_a, top_b)
    assert not result.exact and result.close
    assert (result.first_difference, result.token_a, result.token_b) == (1, 5, 6)


@pytest.mark.parametrize(
    ("top_a", "top_b"),
    [
        ([[1], [5, 7]], [[1], [6, 5]]),  # A's top-k lacks B's token
        ([[1], [5, 6]], [[1], [6, 7]]),  # B's top-k lacks A's token
    ],
)
def test_a_difference_outside_either_top_k_is_not_close(top_a, top_b):
    result = compare_tokens([1, 5], [1, 6], top_a, top_b)
    assert not result.close
    with pytest.raises(AssertionError, match="request 0: A vs B: identical up to position 1"):
        check_tokens_close([[1, 5]], [[1, 6]], [top_a], [top_b])


def test_without_top_k_any_difference_fails():
    assert not compare_tokens([1, 2], [1, 3]).close


def test_top_k_ids_from_logits():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 0.0, 4.9]])
    assert top_k_ids(logits, 2) == [[1, 2], [0, 3]]
    with pytest.raises(ValueError, match="k must be >= 1"):
        top_k_ids(logits, 0)
    with pytest.raises(ValueError, match="positions, vocab"):
        top_k_ids(logits[0], 2)


def test_check_returns_every_request_and_rejects_mismatched_counts():
    results = check_tokens_close([[1, 2], [3]], [[1, 2], [3]])
    assert [r.exact for r in results] == [True, True]
    with pytest.raises(ValueError, match="A has 2 outputs, B has 1"):
        check_tokens_close([[1], [2]], [[1]])
    with pytest.raises(ValueError, match="top_a has 1 positions for 2"):
        compare_tokens([1, 2], [1, 2], [[1]], None)


def test_greedy_decoding_under_a_perturbation_is_close():
    # Two "schedules" of one toy model: logits equal up to a tiny perturbation that flips a near-tie.
    torch.manual_seed(0)
    logits = torch.randn(6, 32)
    logits[3, 7], logits[3, 8] = 4.0, 4.0 - 1e-6  # a near-tie at position 3
    other = logits.clone()
    other[3, 8] += 2e-6
    a, b = logits.argmax(-1).tolist(), other.argmax(-1).tolist()
    assert a[3] == 7 and b[3] == 8
    (result,) = check_tokens_close([a], [b], [top_k_ids(logits, 2)], [top_k_ids(other, 2)])
    assert result.first_difference == 3 and result.close


def test_top_k_ids_puts_the_chosen_token_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert top_k_ids(logits, 2, first=[2, 0]) == [[2, 1], [0, 3]]
    with pytest.raises(ValueError, match="first has 1 tokens for 2 positions"):
        top_k_ids(logits, 2, first=[1])


class _Force:
    """A logits processor that makes `generate` choose the `rank`-th best token at generated position `step`."""

    def __init__(self, prompt_len, step, rank):
        self.position, self.rank = prompt_len + step, rank

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.position:
            scores = scores.clone()
            chosen = scores.argsort(dim=-1, descending=True)[:, self.rank]
            scores[torch.arange(scores.shape[0]), chosen] = scores.max(dim=-1).values + 1.0
        return scores


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)


def _forced(model, prompt, step, rank, k=5, new=8):
    processors = LogitsProcessorList([_Force(len(prompt), step, rank)])
    return generate_with_top_k(
        model, torch.tensor([prompt]), new, k, stop_at_eos=False, logits_processor=processors
    )


def test_a_forced_near_tie_is_close_and_a_far_off_token_is_not(tiny):
    prompt = list(range(10, 22))
    tokens, top = generate_with_top_k(tiny, torch.tensor([prompt]), 8, 5, stop_at_eos=False)
    assert len(tokens[0]) == len(top[0]) == 8 and all(
        len(t) == 5 and t[0] == x for t, x in zip(top[0], tokens[0], strict=True)
    )
    # The runner-up at position 3 chosen instead: the two sides first differ there, each token in the other's top-5.
    tie_tokens, tie_top = _forced(tiny, prompt, 3, 1)
    (result,) = check_tokens_close(tokens, tie_tokens, top, tie_top, names=("greedy", "forced"))
    assert (result.first_difference, result.token_b) == (3, top[0][3][1]) and result.close
    # The 200th best token chosen instead: in neither top-5, so the rule rejects it.
    far_tokens, far_top = _forced(tiny, prompt, 3, 200)
    assert far_tokens[0][:3] == tokens[0][:3] and far_tokens[0][3] not in top[0][3]
    with pytest.raises(AssertionError, match="NOT a near-tie"):
        check_tokens_close(tokens, far_tokens, top, far_top, names=("greedy", "forced"))


def test_generate_with_top_k_rejects_bad_input(tiny):
    with pytest.raises(ValueError, match="batch, prompt_len"):
        generate_with_top_k(tiny, torch.tensor([1, 2, 3]), 4, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate_with_top_k(tiny, torch.tensor([[1, 2, 3]]), 0, 2)


def test_check_outputs_close_reads_each_runs_tokens_and_top_ids():
    from types import SimpleNamespace

    a = [SimpleNamespace(token_ids=[1, 2, 3], top_token_ids=[[1, 9], [2, 9], [3, 4]])]
    near = [SimpleNamespace(token_ids=[1, 2, 4], top_token_ids=[[1, 9], [2, 9], [4, 3]])]
    far = [SimpleNamespace(token_ids=[1, 2, 7], top_token_ids=[[1, 9], [2, 9], [7, 8]])]
    (result,) = check_outputs_close(a, near, names=("a", "near"))
    assert result.close and not result.exact
    with pytest.raises(AssertionError, match="request 0: a vs far"):
        check_outputs_close(a, far, names=("a", "far"))
    untracked = [SimpleNamespace(token_ids=[1, 2, 4], top_token_ids=None)]
    with pytest.raises(AssertionError):
        check_outputs_close(a, untracked, names=("a", "untracked"))
