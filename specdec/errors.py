"""User-facing errors.

A `SpecdecError` is a problem with the user's input or environment (bad parameter, missing file,
unsupported checkpoint). The CLI prints its message on one line and exits with code 2; the server
turns it into HTTP 400. Internal invariants use `assert`, never this class.
"""


class SpecdecError(ValueError):
    """Bad input or environment, described in one line that names the field and the allowed range."""


def check_range(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise SpecdecError unless lo <= value <= hi (with optional open ends)."""
    bad = False
    if lo is not None:
        bad |= value <= lo if lo_open else value < lo
    if hi is not None:
        bad |= value >= hi if hi_open else value > hi
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise SpecdecError(f"{name}={value!r} is out of range; allowed {left}{lo_s}, {hi_s}{right}")
