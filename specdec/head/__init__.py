"""Draft heads: a small network trained on the target's own hidden states (specdec.head.model),
its training (specdec.head.train, `specdec train-head`) and loading it for a target."""

from __future__ import annotations

from pathlib import Path

from specdec.errors import SpecdecError
from specdec.head.model import DraftHead, HeadConfig

__all__ = ["DraftHead", "HeadConfig", "attach", "load_head", "shipped_head"]


def attach(head: DraftHead, model) -> DraftHead:
    """Give the head the target's embedding and output rows (fp32, borrowed)."""
    a, c = model.args, head.cfg
    mine = (a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.vocab_size)
    theirs = (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size)
    if mine != theirs:
        raise SpecdecError(f"the head was trained for a target with (dim, heads, kv heads, head dim, vocabulary) "
                           f"= {theirs}; this target has {mine}", "head")
    if c.taps and max(c.taps) > a.n_layers - 2:
        raise SpecdecError(f"the head reads target layers {c.taps}; this target has {a.n_layers} layers", "head")
    return head.attach(model.embed, model.lm_head.dense)


def load_head(path, model, target_sha256: str | None = None) -> DraftHead:
    """A saved head, checked against the target (its shape; its weights' sha256 when known)."""
    head = DraftHead.load(Path(path))
    if target_sha256 is not None and head.cfg.target_sha256 not in ("", target_sha256):
        raise SpecdecError(f"head {path} was trained on target weights with sha256 {head.cfg.target_sha256[:12]}..., "
                           f"not this target's ({target_sha256[:12]}...): train one for it with `specdec train-head`",
                           "head")
    return attach(head, model)


SHIPPED = Path(__file__).resolve().parent.parent / "heads"  # specdec/heads/<registry name>/


def shipped_head(model: str) -> str:
    """The head shipped in the package for a registry model."""
    path = SHIPPED / str(model)
    if not (path / "head.json").is_file():
        have = sorted(p.name for p in SHIPPED.iterdir() if (p / "head.json").is_file()) if SHIPPED.is_dir() else []
        raise SpecdecError(f"no head is shipped for model {model!r} (shipped: {', '.join(have) or 'none'}); "
                           f"train one with `specdec train-head --model {model} --out DIR` and pass --head DIR",
                           "head")
    return str(path)
