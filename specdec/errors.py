"""User-facing errors.

A `SpecdecError` is a problem with the user's input or environment (bad parameter, missing file,
unsupported checkpoint). The CLI prints its message on one line and exits with code 2; the server
turns it into HTTP 400. Internal invariants use `assert`, never this class.
"""


class SpecdecError(ValueError):
    """Bad input or environment, described in one line that names the field and the allowed range."""


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise SpecdecError unless value is a number (not a bool, not NaN) with lo <= value <= hi
    (with optional open ends). NaN fails every comparison, so it must be refused by name."""
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    allowed = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise SpecdecError(f"{name}={value!r} is not a number; allowed {allowed}")
    bad = False
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        raise SpecdecError(f"{name}={value!r} is out of range; allowed {allowed}")
