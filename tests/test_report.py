"""kvlab.book.report: tables, and greedy agreement that a near-tie cannot flip."""

import pytest

from kvlab.agreement import compare_tokens
from kvlab.book.report import Table, glue_all, keeps_tokens, share_kept, tokens_kept


def test_table_formats_ints_floats_and_rejects_ragged_rows():
    table = Table(["a", "b"], [(1234, 0.012345), (5, 1234.5)])
    assert table.formatted_rows() == [["1,234", "0.0123"], ["5", "1,234"]]
    with pytest.raises(ValueError, match="has 1 cells for 2 columns"):
        Table(["a", "b"], [(1,)])


def test_tokens_kept_counts_up_to_the_first_difference():
    assert tokens_kept(compare_tokens([1, 2, 3], [1, 2, 3])) == 3
    assert tokens_kept(compare_tokens([1, 2, 3, 4], [1, 9, 3, 4])) == 1
    assert tokens_kept(compare_tokens([7], [8])) == 0


def test_share_kept_pools_every_pair_and_ignores_positions_after_a_difference():
    pairs = [compare_tokens([1, 2, 3, 4], [1, 2, 3, 4]), compare_tokens([1, 2, 3, 4], [1, 2, 9, 4])]
    assert share_kept(pairs) == pytest.approx(6 / 8)
    assert share_kept([]) == 1.0


def test_keeps_tokens_by_share_or_by_a_near_tie_at_the_first_difference():
    ref, late, early = (
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 0],
        [1, 0, 3, 4, 5, 6, 7, 8, 9, 10],
    )
    far = [[t, 99] for t in ref]
    assert keeps_tokens(compare_tokens(ref, ref), 0.9)
    assert keeps_tokens(compare_tokens(ref, late, far, far), 0.9), "9 of 10 kept: enough without a near-tie"
    assert not keeps_tokens(compare_tokens(ref, early, far, far), 0.9), "1 of 10 kept and no near-tie"
    # the same early difference as a swap of the two best tokens on both sides: another CPU's rounding
    top_ref = [[t, 99] for t in ref]
    top_early = [[t, 99] for t in early]
    top_ref[1], top_early[1] = [2, 0], [0, 2]
    assert keeps_tokens(compare_tokens(ref, early, top_ref, top_early), 0.9)
    # without the top-k lists a difference is never a near-tie
    assert not keeps_tokens(compare_tokens(ref, early), 0.9)


def test_keeps_tokens_rejects_a_threshold_outside_0_1():
    with pytest.raises(ValueError, match="threshold"):
        keeps_tokens(compare_tokens([1], [1]), 1.5)


def test_glue_all_stores_each_value_under_its_prefixed_name_in_order(monkeypatch):
    import myst_nb

    from kvlab.book.report import glue_all

    stored = []
    monkeypatch.setattr(
        myst_nb, "glue", lambda name, value, display=True: stored.append((name, value, display))
    )
    glue_all({"blocks": 12, "ratio": "1.5"}, prefix="ch7_")
    assert stored == [("ch7_blocks", 12, False), ("ch7_ratio", "1.5", False)]


def test_glue_all_refuses_a_name_the_glue_role_cannot_spell():
    import pytest

    from kvlab.book.report import glue_all

    with pytest.raises(ValueError, match="identifier"):
        glue_all({"two words": 1})


def test_glue_all_refuses_a_figure():
    """A figure glued without display has no image file in the built page; myst_nb.glue(name, fig) shows it."""
    import matplotlib.pyplot as plt

    fig = plt.figure()
    with pytest.raises(ValueError, match="myst_nb.glue"):
        glue_all({"figure": fig})
    plt.close(fig)
