"""Draft trees through the real engine (specdec.engine.trees): the draft model drafts a tree of its
top candidates, the target scores it in one forward with tree attention, the tree verifier keeps a
path, the target's KV for that path is compacted into place.

  - exact enumeration (V = 4): the engine's joint of the first 3 tokens equals the target's to
    1e-6 under every sampling transform, for several shapes; the same test catches two bugs a tree
    invites (a sibling's candidate accepted against the parent's p, i.e. no residual; and every
    node's RoPE position equal to its slot, i.e. no tree positions);
  - greedy speculative output equals plain greedy, batched, with rows that take the chain path
    (penalties) beside tree rows, and accepted paths that went through later siblings;
  - a 200,000-sample chi-square test of the real loop with its negative control.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from engines import make_engine
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import trees
from specdec.errors import SpecdecError
from specdec.loader import Models, build_engine
from specdec.tools.distribution import (chi_square, engine_joint_exact, noncentrality, sample_engine,
                                        target_joint_exact)

PROMPT = [1, 2, 3]
SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp0.6_topk2": dict(temperature=0.6, top_k=2),
    "topp0.7": dict(temperature=1.2, top_p=0.7),
    "minp0.3": dict(temperature=0.9, min_p=0.3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4),
}


@pytest.fixture(scope="module")
def models():
    kw = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    return tiny_model(seed=11, scale=0.5, **kw), tiny_model(seed=12, scale=0.5, **kw)


def tree_engine(target, draft, widths, k=None, max_batch=1, max_seq_len=64):
    models = Models(target, None, draft, target.args.vocab_size, "target", "draft")
    spec = SpeculativeConfig(draft="draft", num_draft_tokens=k or len(widths), draft_tree=widths)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("widths", [(2,), (3, 2), (2, 2, 1), (1, 3)])
def test_tree_joint_equals_target_joint(models, setting, widths):
    target, draft = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = tree_engine(target, draft, widths)
    got = engine_joint_exact(engine, PROMPT, params)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) < 1e-6
    assert engine.proposer.forwards > 0


def test_exact_test_catches_a_missing_residual(models, monkeypatch):
    """Control 1: every candidate accepted with probability p(c) under the parent's p, as if the
    earlier siblings had not been tried (no residual): the joint is off and the test says so."""
    target, draft = models
    real = tree_mod.residual_distribution
    monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    got = engine_joint_exact(tree_engine(target, draft, (3, 2)), PROMPT, params)
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3
    assert real is not None


def test_exact_test_catches_positions_equal_to_slots(models, monkeypatch):
    """Control 2: the tree forward without tree positions (each node's RoPE position = its slot,
    as a chain's): siblings are scored as if they followed one another."""
    target, draft = models
    real = trees.forward_inputs

    def no_tree_positions(reqs, prop, device):
        feed, positions, slots, mask = real(reqs, prop, device)
        return feed, slots.clone(), slots, mask
    monkeypatch.setattr(trees, "forward_inputs", no_tree_positions)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    got = engine_joint_exact(tree_engine(target, draft, (3, 2)), PROMPT, params)
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3


def test_greedy_tree_equals_plain_batched():
    """Greedy rows of different prompts decode to exactly plain greedy's tokens with trees; a row
    with a repetition penalty (chain path) rides in the same batch; some accepted paths went
    through a later sibling (so the KV compaction was exercised)."""
    kw = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=128)
    target, draft = tiny_model(seed=21, scale=0.6, **kw), tiny_model(seed=22, scale=0.6, **kw)
    prompts = [[1, 2, 3], [0, 3, 3, 1, 2, 0, 1], [5], [7, 1, 0, 0, 2, 9, 9, 4]]
    params = [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3)
    plain = make_engine(target, None, 0, max_batch=4, max_seq_len=128)
    want = [r.output for r in plain.generate(prompts, params)]
    engine = tree_engine(target, draft, (3, 2, 2), max_batch=4, max_seq_len=128)
    later = []
    real = trees.verify_rows

    def spy(*a, **k):
        paths = real(*a, **k)
        prop = a[3]
        for b, path in paths.items():
            later.extend(j for j in path if tree_mod.sibling_rank(prop.parents[b, : int(prop.num_draft[b])])[j] > 0)
        return paths
    trees.verify_rows = spy
    try:
        got = engine.generate(prompts, params)
    finally:
        trees.verify_rows = real
    assert [r.output for r in got] == want
    assert sum(r.stats.draft_tokens for r in got) > 0 and sum(r.stats.accepted_tokens for r in got) > 0
    assert later, "no accepted path went through a later sibling"


def test_draft_tree_flag_is_checked():
    with pytest.raises(SpecdecError, match="draft_tree"):
        SpeculativeConfig(draft="x", draft_tree="3,0")
    with pytest.raises(SpecdecError, match="nodes"):
        SpeculativeConfig(draft="x", draft_tree="4,4,4")
    with pytest.raises(SpecdecError, match="needs proposer='draft'"):
        SpeculativeConfig(proposer="ngram", draft_tree="2,2")
    assert SpeculativeConfig(draft="x", draft_tree="off").draft_tree is None
    assert SpeculativeConfig(draft="x", draft_tree="3, 2").draft_tree == (3, 2)


N_SAMPLES, BATCH = 200_000, 4000
STAT = SamplingParams(temperature=1.0, max_tokens=3)


@pytest.mark.parametrize("control", [None, "no_residual"])
def test_tree_samples_match_target(models, control, monkeypatch):
    """200,000 samples of the first 3 tokens from the real batched loop with a (3, 2) tree; Pearson
    chi-square against the target's exact joint: pass at p > 1e-3. The control's exact joint gives
    its noncentrality; >= 400 with ~60 degrees of freedom is rejected at p < 1e-6 with probability
    > 1 - 1e-9 (tests/test_statistical.py), and the sampled control must be."""
    target, draft = models
    want = target_joint_exact(target, PROMPT, STAT)
    if control:
        monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
        alt = engine_joint_exact(tree_engine(target, draft, (3, 2)), PROMPT, STAT)
        assert noncentrality(N_SAMPLES, alt, want) >= 400
    engine = tree_engine(target, draft, (3, 2), max_batch=BATCH)
    counts = sample_engine(engine, PROMPT, STAT, N_SAMPLES, BATCH, seed=5)
    _, _, p = chi_square(counts, want)
    assert engine.proposer.forwards > 0
    assert (p < 1e-6) if control else (p > 1e-3)
