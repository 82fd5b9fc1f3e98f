"""The engine: requests in rounds of propose -> verify -> commit (core.py), and how many drafts
each row gets (adaptive.py)."""

from specdec.engine.core import Engine

__all__ = ["Engine"]
