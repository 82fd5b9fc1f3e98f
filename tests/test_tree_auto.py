"""`draft_tree="auto"` (specdec.engine.tree_auto): the round's shape from measured costs and
acceptances.

- The choice: with a verify forward whose cost grows with its tokens (this AVX2 machine's case)
  and siblings rarely accepted, chains; with a flat verify cost and siblings that are accepted,
  trees; a long run of chains tries the cheapest tree once (exploration).
- The bookkeeping: a tree round's accepted path gives the first child's acceptance per depth and
  each later sibling's, counted by hand on small trees.
- Through the engine: auto stays exact (the joint of the first 3 tokens equals the target's to
  1e-6 while trees are forced) and greedy auto output equals plain greedy, with tree rounds
  asserted to have happened.
"""

from __future__ import annotations

import pytest

from conftest import tiny_model
from engines import make_engine
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import tree_auto as TA
from specdec.loader import Models, build_engine
from specdec.tools.distribution import engine_joint_exact, target_joint_exact
from specdec.tree import tree_from_widths


def _measured(slope: float) -> TA.TreeAuto:
    """Verify forwards measured at 0.040 s x (1 + slope (tokens - 1)); chain rounds whose first
    draft is accepted half the time (and then the whole chain)."""
    t = TA.TreeAuto()
    for tokens in (1, 2, 4, 8, 16, 32):
        t.observe_target(tokens, 0.040 * (1 + slope * (tokens - 1)))
    t.observe_draft((1, 1, 1), 1, 0.006)
    for _ in range(30):
        t.observe_rows([(None, 3, None, 0), (None, 3, None, 3)])
    return t


def _siblings(t: TA.TreeAuto, accepted: bool) -> TA.TreeAuto:
    """30 rounds of a width-4 tree whose first child is rejected and the second accepted or not
    (the rest rejected), beside a chain row that accepts all."""
    for _ in range(30):
        t.observe_rows([(tree_from_widths((4,)).tolist(), 4, [1] if accepted else [], None), (None, 3, None, 3)])
    return t


def test_choice_follows_costs_and_acceptance():
    steep, flat = _measured(0.25), _measured(0.005)
    assert steep.choose([3]) == (1, 1, 1)  # a wider verify costs too much: chains (AVX2 here)
    assert steep.chosen == {(1, 1, 1): 1}
    assert max(flat.choose([3])) > 1  # nearly flat (AVX-512): the prior's siblings pay
    # siblings never accepted: chains even on the flat machine, and untried ones priced no better
    never = _siblings(_measured(0.005), False)
    assert never.betas()[1] < 0.05 and never.betas()[3] <= never.betas()[1]
    assert never.choose([3]) == (1, 1, 1)
    # the second child always accepted: a width-2 tree even on the steep machine
    assert _siblings(_measured(0.25), True).choose([3]) == (2, 1, 1)
    # rows that draft nothing this round: no shape
    assert flat.choose([0, 0]) == ()


def test_exploration_tries_the_cheapest_tree():
    steep = _measured(0.25)
    shapes = [steep.choose([2]) for _ in range(TA.EXPLORE_EVERY)]
    assert shapes[:-1] == [(1, 1)] * (TA.EXPLORE_EVERY - 1) and shapes[-1] == (2, 1)
    assert steep.choose([2]) == (1, 1)


def test_tree_round_bookkeeping():
    t = TA.TreeAuto()
    parents = tree_from_widths((2, 1)).tolist()  # [-1, -1, 0, 1]: two chains of 2
    t.observe_rows([(parents, 4, [1, 3], None)])  # second child at depth 1, then its child
    assert t.tried[1] == 1 and t.hit[1] == 1
    assert t.first.reached[:1] == [1.0] and t.first.accepted[:1] == [0.0]  # the first child missed
    t2 = TA.TreeAuto()
    t2.observe_rows([(parents, 4, [0, 2], None)])  # the first child all the way: the chain's path
    assert t2.tried[1] == 0 and t2.first.accepted[:2] == [1.0, 1.0]
    t3 = TA.TreeAuto()
    t3.observe_rows([(parents, 4, [], None)])  # both children rejected
    assert t3.tried[1] == 1 and t3.hit[1] == 0 and t3.first.accepted[:1] == [0.0]
    t4 = TA.TreeAuto()
    t4.observe_rows([(None, 3, None, 2)])  # a chain: 2 of 3 accepted
    assert t4.first.reached[:3] == [1.0, 1.0, 1.0] and t4.first.accepted[:3] == [1.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def models():
    kw = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    return tiny_model(seed=11, scale=0.5, **kw), tiny_model(seed=12, scale=0.5, **kw)


def _auto_engine(target, draft, k=2, max_batch=1, max_seq_len=64, draft_sampling="probabilistic"):
    models = Models(target, None, draft, target.args.vocab_size, "target", "draft")
    spec = SpeculativeConfig(draft="draft", num_draft_tokens=k, draft_tree="auto", draft_sampling=draft_sampling)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


@pytest.fixture
def trees_pay(monkeypatch):
    """A machine where any tree pays: the verify forward costs the same at any width."""
    monkeypatch.setattr(TA.TreeAuto, "cost", lambda self, widths, rows: 1.0 + 0.001 * TA.nodes(widths))


@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_auto_joint_equals_target_joint(models, monkeypatch, draft_sampling):
    """The auto path (its shape, its observations) through the engine: the enumeration replays
    one round per branch, so the shape must be a function of the past that every replay sees
    alike; the rule here (a width-2 first level, then a chain, for the round's depth) is one,
    and auto's own rule is another, so exactness here is exactness there."""
    monkeypatch.setattr(TA.TreeAuto, "choose", lambda self, ks: (2,) + (1,) * (max(ks) - 1) if max(ks) else ())
    target, draft = models
    params = SamplingParams(max_tokens=16, temperature=1.0)
    engine = _auto_engine(target, draft, draft_sampling=draft_sampling)
    got = engine_joint_exact(engine, PROMPT, params)
    assert max(abs(got.get(x, 0.0) - w) for x, w in target_joint_exact(target, PROMPT, params).items()) < 1e-6
    assert sum(engine.tree_auto.tried) > 0  # tree rounds were drafted, verified and observed


PROMPT = [1, 2, 3]


def test_auto_greedy_equals_plain(trees_pay):
    kw = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=128)
    target, draft = tiny_model(seed=21, scale=0.6, **kw), tiny_model(seed=22, scale=0.6, **kw)
    prompts = [[1, 2, 3], [0, 3, 3, 1, 2, 0, 1], [5], [7, 1, 0, 0, 2, 9, 9, 4]]
    params = SamplingParams(temperature=0, max_tokens=40)
    want = [r.output for r in make_engine(target, None, 0, max_batch=4, max_seq_len=128).generate(prompts, params)]
    engine = _auto_engine(target, draft, k=3, max_batch=4, max_seq_len=128)
    got = engine.generate(prompts, params)
    assert [r.output for r in got] == want
    assert sum(n for s, n in engine.tree_auto.chosen.items() if max(s) > 1) > 0
    assert sum(r.stats.accepted_tokens for r in got) > 0


def test_auto_flag():
    assert SpeculativeConfig(draft="x", draft_tree="auto").draft_tree == "auto"
    assert SpeculativeConfig(draft="x", draft_tree=" AUTO ").draft_tree == "auto"
