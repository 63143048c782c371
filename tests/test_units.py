"""kvlab.units: the formats every page and CLI line prints numbers in."""

import pathlib

import pytest

from kvlab.units import cdiv, format_bytes


def test_format_bytes_keeps_significant_digits():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(-1536) == "-1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"


def test_format_bytes_never_prints_an_exponent_below_a_tebibyte():
    # 1,032,192 B is 1008 KiB: `.3g` alone printed '1.01e+03 KiB' in `kvlab size`'s block rounding line
    assert format_bytes(1_032_192) == "1008 KiB"
    assert format_bytes(1023.6 * 2**20) == "1 GiB"
    for n in (999.6, 1000, 1012.5, 1023.4):
        for scale in (2**10, 2**20, 2**30):
            assert "e" not in format_bytes(n * scale), n * scale


def test_join_words_says_a_list_in_either_edition():
    from kvlab.units import join_words

    assert join_words(["2"]) == join_words(["2"], "zh") == "2"
    assert join_words(["2", "1"]) == "2 and 1" and join_words(["2", "1"], "zh") == "2 和 1"
    assert join_words(["2", "3", "4", "10"]) == "2, 3, 4 and 10"
    assert join_words(["2", "3", "4", "10"], "zh") == "2、3、4 和 10"
    with pytest.raises(ValueError, match="unknown language 'fr'"):
        join_words(["a", "b"], "fr")


def test_cdiv_rounds_up_and_is_the_only_one():
    """The blocks `a` tokens fill: exact multiples stay, anything past one more block; no module writes its own."""
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    src = pathlib.Path(__file__).resolve().parents[1] / "src" / "kvlab"
    inline = [str(f) for f in src.rglob("*.py") if "-(-" in f.read_text() and f.name != "units.py"]
    assert inline == []
