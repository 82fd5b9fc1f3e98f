"""Dynamic draft trees (`draft_tree="dynamic[:N]"`, specdec.proposers.dynamic_tree): each row's tree
grown by the draft's own confidence, its nodes deterministic candidates.

  - the selection is a tree: the N best-scored candidates, ancestors included, breadth-first;
  - exact enumeration (V = 4): the engine's joint of the first 3 tokens equals the target's to
    1e-6 under the sampling transforms, for node budgets that make trees and chains, draft
    model and head; the same test catches a verifier without the residual on these trees;
  - a row of deterministic candidates is verified without q even when a chain row beside it has
    one (Proposal.deterministic);
  - greedy output equals plain greedy, batched, with a penalty row on the chain path and
    accepted paths through later siblings; seed-stable text equals plain for 50 seeds.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from engines import TREE_SETTINGS as SETTINGS, later_siblings, make_engine, tiny_pair
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig, dynamic_nodes
from specdec.errors import SpecdecError
from specdec.loader import Models, build_engine
from specdec.proposers.dynamic_tree import Pool, select
from specdec.tools.distribution import engine_joint_exact, target_joint_exact

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return tiny_pair()


def dynamic_engine(target, draft, tree, k=3, max_batch=1, max_seq_len=64):
    models = Models(target, None, draft, target.args.vocab_size, "target", "draft")
    spec = SpeculativeConfig(draft="draft", proposer="draft", num_draft_tokens=k, draft_tree=tree)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


def test_selection_is_a_tree_of_the_best_candidates():
    pool = Pool()
    for parent, token, score, depth in [(-1, 5, -0.1, 1), (-1, 6, -1.0, 1), (-1, 7, -3.0, 1),  # 0, 1, 2
                                        (0, 8, -0.1, 2), (0, 9, -2.0, 2), (1, 5, -1.2, 2),  # 3 (p = 1), 4, 5
                                        (3, 1, -0.5, 3), (5, 2, -5.0, 3)]:  # 6, 7
        pool.add(parent, token, score, depth)
    parents, tokens = select(pool, 5)  # best: 0 (-0.1), 3 (-0.1, deeper), 6 (-0.5), 1 (-1.0), 5 (-1.2)
    assert tokens.tolist() == [5, 6, 8, 5, 1] and parents.tolist() == [-1, -1, 0, 1, 2]
    for n in range(1, 9):  # every budget: parents come first, every parent is selected
        parents, tokens = select(pool, n)
        assert len(parents) == n and all(-1 <= int(p) < j for j, p in enumerate(parents))
    assert dynamic_nodes("dynamic", 3) == 6 and dynamic_nodes("dynamic:5", 3) == 5
    assert dynamic_nodes("dynamic", 30) == 32 and dynamic_nodes((2, 1), 3) is None


CASES = [("dynamic:4", s) for s in SETTINGS] + [("dynamic:7", "plain"), ("dynamic:2", "topp0.7"),
                                                 ("dynamic:1", "plain"), ("dynamic", "minp0.3")]


@pytest.mark.parametrize("tree, setting", CASES)
def test_dynamic_joint_equals_target_joint(models, tree, setting):
    target, draft = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = dynamic_engine(target, draft, tree)
    got = engine_joint_exact(engine, PROMPT, params)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert max(abs(got.get(x, 0.0) - p) for x, p in target_joint_exact(target, PROMPT, params).items()) < 1e-6
    assert set(got) <= set(target_joint_exact(target, PROMPT, params)) | {x for x in got if got[x] < 1e-12}
    assert engine.proposer.forwards > 0


def test_exact_test_catches_a_missing_residual_on_dynamic_trees(models, monkeypatch):
    """Control: a later candidate accepted against the parent's p (the earlier siblings' rejection
    forgotten): the joint is off and the same test says so."""
    target, draft = models
    monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    got = engine_joint_exact(dynamic_engine(target, draft, "dynamic:6"), PROMPT, params)
    want = target_joint_exact(target, PROMPT, params)
    assert max(abs(got.get(x, 0.0) - want.get(x, 0.0)) for x in set(got) | set(want)) > 1e-3


def test_dynamic_rows_are_verified_without_q_beside_a_chain_with_q(models, monkeypatch):
    """A sampled row with a penalty takes the chain path and records its q; the dynamic rows in the
    same batch are deterministic candidates and must reach the tree verifier without q."""
    target, draft = models
    seen = []
    real = tree_mod.tree_verify_stochastic

    def spy(p, q, tokens, parents, rng, valid=None):
        seen.append(q)
        return real(p, q, tokens, parents, rng, valid)
    monkeypatch.setattr("specdec.engine.trees.tree_verify_stochastic", spy)
    engine = dynamic_engine(target, draft, "dynamic:5", max_batch=3)
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=None),
              SamplingParams(temperature=1.0, max_tokens=12, presence_penalty=0.5),
              SamplingParams(temperature=0.8, max_tokens=12)]
    out = engine.generate([PROMPT, PROMPT, [0, 2]], params)
    assert all(len(r.output) == 12 for r in out)
    assert seen and all(q is None for q in seen)
    assert out[1].stats.draft_tokens > 0  # the chain row drafted (with its q) beside them


def test_greedy_dynamic_equals_plain_batched():
    """Greedy rows decode to exactly plain greedy's tokens with dynamic trees of several budgets; a
    penalty row (chain path) rides in the same batch; accepted paths went through later siblings."""
    kw = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=128)
    target, draft = tiny_model(seed=21, scale=0.6, **kw), tiny_model(seed=22, scale=0.6, **kw)
    prompts = [[1, 2, 3], [0, 3, 3, 1, 2, 0, 1], [5], [7, 1, 0, 0, 2, 9, 9, 4]]
    params = [SamplingParams(temperature=0, max_tokens=40) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3)
    want = [r.output for r in make_engine(target, None, 0, max_batch=4, max_seq_len=128).generate(prompts, params)]
    with later_siblings() as later:
        for tree, k in (("dynamic", 3), ("dynamic:12", 4), ("dynamic:3", "auto")):
            got = dynamic_engine(target, draft, tree, k=k, max_batch=4, max_seq_len=128).generate(prompts, params)
            assert [r.output for r in got] == want, tree
            assert sum(r.stats.draft_tokens for r in got) > 0
            if k != "auto":  # (adaptive k may turn drafting off early on these unrelated models)
                assert sum(r.stats.accepted_tokens for r in got) > 0
    assert later, "no accepted path went through a later sibling"


def test_seed_stable_dynamic_text_equals_plain_for_50_seeds():
    """Seed-stable sampling at T = 0.8: with dynamic trees the text of each of 50 seeds is plain
    decoding's."""
    kw = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=128)
    target, draft = tiny_model(seed=31, scale=0.5, **kw), tiny_model(seed=32, scale=0.5, **kw)
    prompt = [3, 1, 4, 1, 5]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24) for s in range(50)]
    want = [r.output for r in make_engine(target, None, 0, max_batch=50, max_seq_len=128)
            .generate([prompt] * 50, params)]
    got = dynamic_engine(target, draft, "dynamic:6", max_batch=50, max_seq_len=128).generate([prompt] * 50, params)
    assert [r.output for r in got] == want
    assert sum(r.stats.accepted_tokens for r in got) > 0


def test_dynamic_flag_is_checked():
    for bad, msg in (("dynamic:0", "outside"), ("dynamic:33", "outside"), ("dynamic:x", "not an integer")):
        with pytest.raises(SpecdecError, match=msg):
            SpeculativeConfig(draft="x", draft_tree=bad)
    assert SpeculativeConfig(proposer="ngram", draft_tree="dynamic:5").draft_tree == "dynamic:5"
    for tree in ("2,1", "auto"):  # an n-gram trie has no fixed shape
        with pytest.raises(SpecdecError, match="n-gram tree grows from the earlier matches"):
            SpeculativeConfig(proposer="ngram", draft_tree=tree)
    assert SpeculativeConfig(proposer="composite", draft="x", draft_tree="dynamic").draft_tree == "dynamic"
    for tree in ("2,1", "auto"):  # a composite tree is a union of the parts' own trees
        with pytest.raises(SpecdecError, match="composite tree is the union"):
            SpeculativeConfig(proposer="composite", draft="x", draft_tree=tree)
    assert SpeculativeConfig(draft="x", draft_tree=" Dynamic:8 ").draft_tree == "dynamic:8"


def test_a_draft_model_defaults_to_the_composite_but_for_fixed_and_auto_trees():
    """With a draft model and no proposer named, the n-gram lookup drafts first (free, and far
    more often accepted where the text repeats itself); a fixed shape or `auto` asks for the
    draft model's own top candidates, which only the draft proposer drafts."""
    for tree in (None, "off", "dynamic", "dynamic:6"):
        assert SpeculativeConfig(draft="x", draft_tree=tree).proposer == "composite", tree
    for tree in ("2,1", (3, 2), "auto"):
        assert SpeculativeConfig(draft="x", draft_tree=tree).proposer == "draft", tree
    assert SpeculativeConfig(draft="x", proposer="draft").proposer == "draft"
    assert SpeculativeConfig().proposer == "ngram" and SpeculativeConfig(head="h").proposer == "head"
