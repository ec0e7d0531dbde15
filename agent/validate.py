"""Typed, bounded numbers from untrusted JSON/TOML.

`True` is an int in Python and JSON's `Infinity`/`NaN` parse to floats, so a plain
isinstance check lets `"deadline_s": true` or `"duration_s": Infinity` through.
"""

from __future__ import annotations

import math
from typing import Any


def is_number(v: Any) -> bool:
    """A real, finite int or float; never a bool."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int with hundreds of digits
        return False


def bounded_number(v: Any, lo: float, hi: float) -> float | None:
    """`v` as a float if it is a finite number in lo..hi, else None."""
    if not is_number(v):
        return None
    f = float(v)
    return f if lo <= f <= hi else None
