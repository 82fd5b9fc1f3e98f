"""User-facing errors and the checks that raise them.

A `SpecdecError` is a problem with the user's input or environment (bad parameter, missing file,
unsupported checkpoint). The CLI prints its message on one line and exits with code 2; the server
turns it into HTTP 400 (its `field` becomes the error's `param`). Internal invariants use
`assert`, never this class.

Every message has one shape: `name=value` first, then what is wrong, then what is allowed, e.g.
"top_p=nan is not a finite number; allowed (0, 1]". The checks below are the only place that
shape is written; each field's range is written once, where the field is defined.
"""

from __future__ import annotations

import math
import numbers


class SpecdecError(ValueError):
    """Bad input or environment, described in one line that names the field and the allowed range."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field  # the offending field's name, when there is one


def show(value, limit: int = 60) -> str:
    """repr(value), shortened: messages stay one line whatever a user passes."""
    try:
        s = repr(value)
    except Exception:  # a repr that raises is still a value we can name
        s = f"<{type(value).__name__}>"
    s = s.replace("\n", "\\n")
    return s if len(s) <= limit else s[:limit - 3] + "..."


def interval(lo=None, hi=None, lo_open=False, hi_open=False) -> str:
    """[lo, hi] with open ends as ( ), and a missing end as -inf / inf."""
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi_open or hi is None else "]"
    return f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"


def _outside(v, lo, hi, lo_open, hi_open) -> bool:
    return ((lo is not None and (v <= lo if lo_open else v < lo))
            or (hi is not None and (v >= hi if hi_open else v > hi)))


def check_float(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """value as a float: a real number (not a bool, a string or None), finite, within the
    interval. NaN fails every comparison, so it is refused by name, not by the range."""
    allowed = interval(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpecdecError(f"{name}={show(value)} is not a number; allowed {allowed}", name)
    try:
        v = float(value)
    except (OverflowError, ValueError, TypeError):  # an int past float's range
        raise SpecdecError(f"{name}={show(value)} is out of range; allowed {allowed}", name) from None
    if not math.isfinite(v):
        raise SpecdecError(f"{name}={show(value)} is not a finite number; allowed {allowed}", name)
    if _outside(v, lo, hi, lo_open, hi_open):
        raise SpecdecError(f"{name}={show(value)} is out of range; allowed {allowed}", name)
    return v


def check_int(name: str, value, lo=None, hi=None, note: str = "") -> int:
    """value as an int: an integer (not a bool, a float or a string) in [lo, hi]. `note` adds
    what a special value means, e.g. "; 0 disables it"."""
    allowed = interval(lo, hi) + note
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SpecdecError(f"{name}={show(value)} is not an integer; allowed {allowed}", name)
    v = int(value)
    if _outside(v, lo, hi, False, False):
        raise SpecdecError(f"{name}={show(value)} is out of range; allowed {allowed}", name)
    return v


def check_bool(name: str, value, optional: bool = False) -> bool | None:
    """True or False (or None when optional); 1, "yes" and the like are refused, not guessed."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    allowed = "True, False or None" if optional else "True or False"
    raise SpecdecError(f"{name}={show(value)} is not a boolean; allowed {allowed}", name)


def check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise SpecdecError(f"{name}={show(value)}; allowed: {', '.join(choices)}", name)
    return value


def check_text(name: str, value, allow_empty: bool = False) -> str:
    """A str that is valid Unicode text (no lone surrogates: what undecodable bytes on the
    command line, or a JSON "\\ud800", turn into) and, unless allowed, not empty."""
    if not isinstance(value, str):
        raise SpecdecError(f"{name}={show(value)} is not a string; allowed: text", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = value[e.start]
        what = f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"U+{ord(ch):04X}"
        raise SpecdecError(f"{name} is not valid UTF-8 ({what} at character {e.start}); "
                           "allowed: UTF-8 text", name) from None
    if not value and not allow_empty:
        raise SpecdecError(f"{name} is empty; it needs at least 1 character", name)
    return value


def lenient_int(text: str):
    """A command-line number: an int when the text is one, else a float, else the text itself,
    so the field's own check (not argparse) names the value with its allowed range."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def lenient_float(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise SpecdecError unless value is a finite number (not a bool, not NaN) with
    lo <= value <= hi (with optional open ends). Kept for callers that check in place."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if _outside(value, lo, hi, lo_open, hi_open):
            raise SpecdecError(f"{name}={show(value)} is out of range; allowed "
                               f"{interval(lo, hi, lo_open, hi_open)}", name)
        return
    check_float(name, value, lo, hi, lo_open, hi_open)
