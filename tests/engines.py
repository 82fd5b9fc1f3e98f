"""Small engines on tiny random models for the distribution tests, built the one way engines are
built (specdec.loader.build_engine)."""

from __future__ import annotations

from contextlib import contextmanager

from specdec import tree as tree_mod
from specdec.config import SpeculativeConfig
from specdec.engine import trees
from specdec.loader import Models, build_engine

# sampling settings for tree rows (the transforms a tree verifier serves) and one on the chain path
TREE_SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp0.6_topk2": dict(temperature=0.6, top_k=2),
    "topp0.7": dict(temperature=1.0, top_p=0.7),
    "minp0.3": dict(temperature=0.9, min_p=0.3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4),  # (the chain path)
}


def make_engine(target, draft, k, draft_sampling="probabilistic", max_batch=1, max_seq_len=64):
    """Plain decoding without a draft, else the draft model proposer with a fixed k (or "auto")."""
    models = Models(target, None, draft, target.args.vocab_size, "target", None if draft is None else "draft")
    spec = None if draft is None else SpeculativeConfig(draft="draft", num_draft_tokens=k,
                                                        draft_sampling=draft_sampling)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


@contextmanager
def later_siblings():
    """Collects the accepted nodes that were not their parent's first child (a path the chain
    would not have drafted: the KV compaction moved it)."""
    later, real = [], trees.verify_rows

    def spy(reqs, rows, logits, prop, *rest):
        paths = real(reqs, rows, logits, prop, *rest)
        for b, path in paths.items():
            rank = tree_mod.sibling_rank(prop.parents[b, : int(prop.num_draft[b])])
            later.extend(j for j in path if rank[j] > 0)
        return paths
    trees.verify_rows = spy
    try:
        yield later
    finally:
        trees.verify_rows = real
