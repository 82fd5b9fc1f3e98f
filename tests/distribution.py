"""Test helpers: the distribution machinery lives in the package (specdec.distribution, also used
by `specdec verify`); this module re-exports it and builds small engines for the tests."""

from __future__ import annotations

from specdec.distribution import (EnumRng, chi_square, engine_joint_exact,  # noqa: F401
                                  enumerate_outcomes, noncentrality, sample_engine, target_joint_exact)
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer


def make_engine(target, draft, k, draft_sampling="probabilistic", max_batch=1, max_seq_len=64):
    V = target.args.vocab_size
    proposer = None if draft is None else DraftModelProposer(draft, V, max_seq_len, draft_sampling)
    return Engine(target, None, proposer, num_draft_tokens=k, max_batch=max_batch,
                  max_seq_len=max_seq_len, vocab_size=V)
