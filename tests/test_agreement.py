"""kvlab.agreement: exact equality, and vLLM's rule for near-tied tokens (first difference within top-k)."""

import pytest
import torch

from kvlab.agreement import check_tokens_close, compare_tokens, top_k_ids


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
