"""Small engines on tiny random models for the distribution tests, built the one way engines are
built (specdec.loader.build_engine)."""

from __future__ import annotations

from contextlib import contextmanager

from conftest import tiny_model
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig
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
    spec = None if draft is None else SpeculativeConfig(draft="draft", proposer="draft", num_draft_tokens=k,
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


def tiny_pair():
    """A tiny target and draft (V = 4) for exact enumeration."""
    kw = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    return tiny_model(seed=11, scale=0.5, **kw), tiny_model(seed=12, scale=0.5, **kw)


def repeating_batch(max_tokens: int = 48):
    """(prompts, params) of four greedy rows over V = 8 whose suffixes recur (n-gram matches with
    several continuations), the third with a repetition penalty (the chain path)."""
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2] * 3, [0, 3, 3, 1, 2, 0, 3, 3, 1, 0, 3, 3], [5, 6, 5, 7, 5],
               [7, 1, 0, 0, 2, 7, 1, 0, 2, 7, 1]]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=1.3)
    return prompts, params


def tree_paths(parents, toks) -> list[list[int]]:
    """Every root-to-node token path of a tree (parents -1 at the root)."""
    out = []
    for j in range(len(toks)):
        path, i = [], j
        while i >= 0:
            path.append(int(toks[i]))
            i = int(parents[i])
        out.append(path[::-1])
    return out

