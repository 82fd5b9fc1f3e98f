"""Models loaded once, engines built per setting: the shared set-up of `specdec bench` and
`specdec verify`. A model argument is a registry name, a GGUF file, an HF directory, or an
already loaded (Transformer, Tokenizer) pair (tests pass tiny random models this way)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.engine import Engine
from specdec.errors import SpecdecError


@dataclass
class Models:
    target: object  # Transformer (or anything with its forward / new_cache / args)
    tokenizer: object  # Tokenizer
    draft: object | None  # the draft model, when one was asked for
    vocab: int  # the real vocabulary shared by target and draft
    name: str
    draft_name: str | None


def _load(model, dtype, device, progress):
    from specdec.api import load_model

    if isinstance(model, tuple):
        return model
    return load_model(model, dtype, device, progress)


def load_models(model, draft=None, dtype="fp32", draft_dtype="fp32", device=None, progress=None) -> Models:
    from specdec.api import check_draft_compatible

    target, tok = _load(model, dtype, device, progress)
    vocab = min(target.args.vocab_size, tok.vocab_size)
    dm = None
    if draft is not None:
        dm, dtok = _load(draft, draft_dtype, device, progress)
        vocab = min(check_draft_compatible(tok, dtok, str(model), str(draft)), vocab, dm.args.vocab_size)
    return Models(target, tok, dm, vocab, str(model) if isinstance(model, str) else "model",
                  None if draft is None else (str(draft) if isinstance(draft, str) else "draft"))


def make_proposer(kind: str | None, draft_model, vocab: int, max_seq_len: int,
                  draft_sampling: str = "probabilistic", ngram_min: int = 1, ngram_max: int = 4):
    """A fresh proposer (proposers keep per-request state: one per engine). kind: draft | ngram |
    composite | None (plain decoding)."""
    from specdec.proposers import DraftModelProposer, NgramProposer
    from specdec.proposers.composite import CompositeProposer

    if kind is None:
        return None
    if kind in ("draft", "composite") and draft_model is None:
        raise SpecdecError(f"proposer={kind!r} needs a draft model (--draft MODEL)")
    if kind == "ngram":
        return NgramProposer(ngram_min, ngram_max)
    dm = DraftModelProposer(draft_model, vocab, max_seq_len, draft_sampling)
    if kind == "draft":
        return dm
    if kind == "composite":
        return CompositeProposer([NgramProposer(ngram_min, ngram_max), dm])
    raise SpecdecError(f"proposer={kind!r}; allowed: draft, ngram, composite")


def make_engine(target, tokenizer, vocab: int, proposer, k, max_draft_tokens: int, max_seq_len: int,
                max_batch: int = 1) -> Engine:
    """k: an int, or "auto" (adaptive k in [0, max_draft_tokens])."""
    extra = {"max_draft_tokens": max_draft_tokens} if k == "auto" else {}
    return Engine(target, tokenizer, proposer, num_draft_tokens=k if proposer is not None else 0,
                  max_batch=max_batch, max_seq_len=max_seq_len, vocab_size=vocab, **extra)
