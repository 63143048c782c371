import pytest

from kvlab.checks import check_count


def test_a_count_is_returned_as_is():
    assert check_count("tp", 4) == 4
    assert check_count("seq_len", 0, 0) == 0


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "2", None])
def test_bools_floats_and_small_values_are_not_counts(value):
    with pytest.raises(ValueError, match=r"^tp must be an integer >= 1, got "):
        check_count("tp", value)


def test_the_error_type_is_the_callers():
    class WorkloadError(ValueError):
        pass

    with pytest.raises(WorkloadError, match="prefix_len must be an integer >= 0, got -3"):
        check_count("prefix_len", -3, 0, WorkloadError)
