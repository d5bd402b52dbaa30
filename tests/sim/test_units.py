import pytest

from vlmcompile.sim.units import column_decimals, format_ms, ms_decimals


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0.00057002, "0.5700"),
        (0.00058711, "0.5871"),
        (0.0123456, "12.35"),
        (5.7, "5700"),
        (1.2345e-6, "0.001234"),
        (0.0, "0"),
        (None, "-"),
    ],
)
def test_step_times_print_to_four_significant_digits(seconds, text):
    assert format_ms(seconds) == text


def test_a_column_prints_every_row_at_the_precision_of_its_smallest():
    steps = [0.00057, 0.0012, None, 0.0]
    decimals = column_decimals(steps)
    assert decimals == ms_decimals(0.00057) == 4
    assert [format_ms(s, decimals=decimals) for s in steps] == ["0.5700", "1.2000", "-", "0.0000"]
    assert column_decimals([None]) == 0
