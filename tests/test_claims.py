import pytest

from kvlab import claims


def test_a_claim_that_holds_stops_at_the_first_passing_attempt():
    values = iter([0.5, 1.05, 9.0])
    lines = []
    verdict = claims.measure_claim(
        "ratio", lambda: next(values), lambda v: [claims.within("ratio", v, 1.0, 0.1)], 3, lines.append
    )
    assert verdict.holds and verdict.count == 2 and verdict.result == 1.05
    assert verdict.require() == 1.05
    assert lines[0].startswith("ratio, attempt 1/3: misses") and lines[1].endswith("holds")
    assert verdict.summary() == "ratio: held at attempt 2 of at most 3"


def test_a_wrong_claim_misses_every_attempt_and_require_names_the_check():
    verdict = claims.measure_claim(
        "doubled", lambda: 2.0, lambda v: [claims.within("step", v, 1.0, 0.4)], 3, None
    )
    assert not verdict.holds and verdict.count == 3
    with pytest.raises(AssertionError, match=r"missed all 3 attempts; last attempt: step: MISSES \(\+100%"):
        verdict.require()


def test_checks():
    assert claims.between("x", 2, 1, 3).holds and not claims.between("x", 4, 1, 3).holds
    assert claims.less("x", 1, 2).holds and not claims.less("x", 2, 2).holds
    assert claims.within("x", 1.4, 1.0, 0.4).holds and not claims.within("x", 1.41, 1.0, 0.4).holds


@pytest.mark.parametrize("attempts", [0, -1, 1.5, True])
def test_bad_attempts(attempts):
    with pytest.raises(ValueError, match="attempts must be"):
        claims.measure_claim("c", lambda: 1, lambda v: [claims.Check("c", True)], attempts)


def test_a_check_with_no_conditions_is_refused():
    with pytest.raises(ValueError, match="could not fail"):
        claims.measure_claim("c", lambda: 1, lambda v: [], 2, None)


def test_bad_bands():
    with pytest.raises(ValueError, match="empty"):
        claims.between("x", 1, 3, 2)
    with pytest.raises(ValueError, match="tolerance"):
        claims.within("x", 1, 1, 0)
    with pytest.raises(ValueError, match="positive number"):
        claims.within("x", 1, 0, 0.1)


def test_the_printed_attempts_parse_back():
    lines = []
    values = iter([3.0, 1.0])
    claims.measure_claim(
        "TTFT, on vs off", lambda: next(values), lambda v: [claims.within("x", v, 1, 0.5)], 2, lines.append
    )
    parsed = claims.parse_attempts("noise\n" + "\n".join(lines) + "\n")
    assert parsed == [
        claims.AttemptLine("TTFT, on vs off", 1, 2, False),
        claims.AttemptLine("TTFT, on vs off", 2, 2, True),
    ]
