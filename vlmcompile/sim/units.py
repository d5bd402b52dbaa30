"""Times as reports print them: milliseconds to a number of significant digits, so that the step
of a model that runs in 0.57 ms and one that runs in 5.7 s are both told apart from their
neighbours (a fixed 0.1 ms prints every plan of a small model as 0.6)."""

from __future__ import annotations

import math
from collections.abc import Iterable

DIGITS = 4
"""Significant digits of a printed step time: plans a tenth of a percent apart print apart."""


def ms_decimals(seconds: float, digits: int = DIGITS) -> int:
    """Decimals that print ``seconds`` in milliseconds to ``digits`` significant digits (0 for
    whole milliseconds and above that)."""
    ms = abs(seconds) * 1e3
    if ms == 0 or not math.isfinite(ms):
        return 0
    return max(0, digits - 1 - math.floor(math.log10(ms)))


def column_decimals(seconds: Iterable[float | None], digits: int = DIGITS) -> int:
    """Decimals for a column of times: the smallest nonzero one to ``digits`` significant digits,
    so that the whole column lines up and every row can be compared with the others."""
    values = [abs(s) for s in seconds if s is not None and s != 0 and math.isfinite(s)]
    return ms_decimals(min(values), digits) if values else 0


def format_ms(seconds: float | None, *, decimals: int | None = None) -> str:
    """``seconds`` in milliseconds (no unit): to :data:`DIGITS` significant digits, or to
    ``decimals`` (one column's, :func:`column_decimals`); "-" for None."""
    if seconds is None:
        return "-"
    places = ms_decimals(seconds) if decimals is None else decimals
    return f"{seconds * 1e3:.{places}f}"
