"""Small engines on tiny random models for the distribution tests, built the one way engines are
built (specdec.loader.build_engine)."""

from __future__ import annotations

from specdec.config import SpeculativeConfig
from specdec.loader import Models, build_engine


def make_engine(target, draft, k, draft_sampling="probabilistic", max_batch=1, max_seq_len=64):
    """Plain decoding without a draft, else the draft model proposer with a fixed k (or "auto")."""
    models = Models(target, None, draft, target.args.vocab_size, "target", None if draft is None else "draft")
    spec = None if draft is None else SpeculativeConfig(draft="draft", num_draft_tokens=k,
                                                        draft_sampling=draft_sampling)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)
