"""Typed, bounded numbers from untrusted JSON/TOML, TOML files read with an error that
names the file and the problem (never a traceback), and unknown keys named.

`True` is an int in Python and JSON's `Infinity`/`NaN` parse to floats, so a plain
isinstance check lets `"deadline_s": true` or `"duration_s": Infinity` through.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def is_number(v: Any) -> bool:
    """A real, finite int or float; never a bool."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int with hundreds of digits
        return False


def is_digits(text: str) -> bool:
    """Whether `text` is a whole number >= 0 as int() reads it: ASCII digits only.
    str.isdigit() alone also takes '²' (and other digits int() refuses), so an
    environment variable, a label or a port of them raised where it was parsed."""
    return text.isascii() and text.isdigit()


def host_port(text: str) -> tuple[str, int] | None:
    """HOST:PORT (brackets around the host taken off, an empty host is loopback), or
    None where `text` is not of that form."""
    host, sep, port = text.rpartition(":")
    if not sep or not is_digits(port) or int(port) > 65535:
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def is_string_map(v: Any) -> bool:
    """A mapping of text to text (labels, annotations as their APIs give them)."""
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                       for k, x in v.items())


def bounded_number(v: Any, lo: float, hi: float) -> float | None:
    """`v` as a float if it is a finite number in lo..hi, else None."""
    if not is_number(v):
        return None
    f = float(v)
    return f if lo <= f <= hi else None


def read_toml(path: Path, what: str, error: type[Exception]) -> dict[str, Any]:
    """The TOML file at `path` as a dict; `error` ("cannot read <what> ...", "<what> ...
    is not valid TOML: ...") if it cannot be read or parsed."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise error(f"{what} {path} is not valid TOML: {err}") from None


def unknown_keys(table: dict[str, Any], known: Iterable[str]) -> str | None:
    """None when every key of `table` is known; else "unknown keys K (did you mean
    KNOWN?), ...; known: ...". A misspelt key must be an error, not ignored: the
    default it leaves in place may be the opposite of what was meant (`dry-run = true`
    loaded a policy that acted)."""
    known = sorted(known)
    unknown = sorted(set(table) - set(known))
    if not unknown:
        return None
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        named.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return f"unknown keys {', '.join(named)}; known: {', '.join(known)}"
