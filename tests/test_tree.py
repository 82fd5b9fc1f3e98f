"""Draft trees (specdec.tree): shape helpers, literal verification cases, fast == reference draw
for draw, and losslessness: exact enumeration and a 200,000-sample statistical test, each with
negative controls that the same test must reject.

Exact tests: target and draft are explicit conditional tables over V = 4 tokens (tests/
tree_models.py). Every branch of a round's randomness (draft draws, one coin per candidate
tried, the recovered/bonus sample) is enumerated with its probability, through the verifier's
own code, and the joint of the first 3 emitted tokens must equal the target's joint
prod p(x_i | x_<i) to 1e-6. The tables are float64 and renormalised, so a correct rule agrees to
~1e-15 (enumeration drops branches below 1e-12: < 1e-9 in all); the controls miss by > 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tree_models as tm
from specdec import tree
from specdec.config import SamplingParams
from specdec.rejection import PLACEHOLDER as P
from specdec.rejection import TorchRng
from specdec.tools.distribution import chi_square, noncentrality

SHAPES = {"chain3": (1, 1, 1), "w2": (2,), "w2_1": (2, 1), "w3_2": (3, 2), "w2_2_1": (2, 2, 1)}
SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp0.7_topk3": dict(temperature=0.7, top_k=3),
    "topp0.8": dict(temperature=1.2, top_p=0.8),
    "topk2": dict(temperature=1.0, top_k=2),  # a 3-wide sampled group runs out of q's support
    "all": dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05),
}


def tables(setting="plain", seed=0):
    return tm.Tables(V=4, L=5, params=SamplingParams(**SETTINGS[setting]), seed=seed)


# --- shape -------------------------------------------------------------------------------------

def test_shapes():
    assert tree.tree_from_widths((3, 2)).tolist() == [-1, -1, -1, 0, 0, 1, 1, 2, 2]
    assert tree.tree_from_widths((1, 1, 1)).tolist() == tree.chain(3).tolist() == [-1, 0, 1]
    par = tree.tree_from_widths((2, 1))  # root -> 0, 1; 0 -> 2; 1 -> 3
    assert par.tolist() == [-1, -1, 0, 1]
    assert tree.children(par) == [[0, 1], [2], [3], [], []]
    assert tree.depths(par).tolist() == [0, 1, 1, 2, 2]
    assert tree.sibling_rank(par).tolist() == [0, 1, 0, 0]
    assert tree.path_to(par, 3) == [1, 3] and tree.path_to(par, -1) == []
    # positions: root, node 0, node 1, node 2, node 3; a row attends to itself and its ancestors
    assert tree.ancestor_mask(par).int().tolist() == [[1, 0, 0, 0, 0],
                                                      [1, 1, 0, 0, 0],
                                                      [1, 0, 1, 0, 0],
                                                      [1, 1, 0, 1, 0],
                                                      [1, 0, 1, 0, 1]]
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        tree.check_parents(torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="widths"):
        tree.tree_from_widths((2, 0))


# --- literal cases -----------------------------------------------------------------------------

PAR = tree.tree_from_widths((2, 1))  # nodes 0, 1 under the root; 2 under 0; 3 under 1


def test_greedy_literal():
    # argmax at positions root, n0, n1, n2, n3
    am = torch.tensor([[5, 7, 8, 1, 2]])
    out = tree.tree_verify_greedy(am, torch.tensor([[3, 5, 7, 8]]), PAR)  # n0 = 3 misses, n1 = 5 hits
    assert out.path.tolist() == [[1, 3]] and out.tokens.tolist() == [[5, 8, 2]]  # n3 = 8 hits, bonus 2
    out = tree.tree_verify_greedy(am, torch.tensor([[5, 5, 0, 8]]), PAR)  # both hit: the first wins
    assert out.path.tolist() == [[0, -1]] and out.tokens.tolist() == [[5, 7, P]]  # n2 = 0 misses: 7
    out = tree.tree_verify_greedy(am, torch.tensor([[1, 2, 7, 8]]), PAR)  # none hits: plain argmax
    assert out.tokens.tolist() == [[5, P, P]] and out.num_emitted.tolist() == [1]
    valid = torch.tensor([[True, False, True, False]])  # n1 (and its child) absent
    out = tree.tree_verify_greedy(am, torch.tensor([[3, 5, 7, 8]]), PAR, valid)
    assert out.tokens.tolist() == [[5, P, P]]


def onehot(ids, V=10):
    return torch.nn.functional.one_hot(torch.tensor(ids), V).double()


def test_stochastic_certain_cases():
    """With one-hot p every acceptance is certain or impossible."""
    p = onehot([[5, 7, 8, 1, 2]])  # [1, 5, V]
    out = tree.tree_verify_stochastic(p, None, torch.tensor([[3, 5, 7, 8]]), PAR, tree.UniformDice.draw(1, 4, 0))
    assert out.path.tolist() == [[1, 3]] and out.tokens.tolist() == [[5, 8, 2]]
    out = tree.tree_verify_stochastic(p, None, torch.tensor([[1, 2, 7, 8]]), PAR, tree.UniformDice.draw(1, 4, 0))
    assert out.tokens.tolist() == [[5, P, P]]  # both rejected: the residual is p, all on 5


def test_deterministic_siblings_use_the_renormalised_residual():
    """p = [0.5, 0.3, 0.2], candidates 0 then 1: P(accept 1 | 0 rejected) = 0.3 / 0.5, not 0.3.
    Coins at u = 0.55 reject token 0 (0.55 >= 0.5) and accept token 1 (0.55 < 0.6); with the
    unnormalised residual (0.3) token 1 would be rejected."""
    p = torch.tensor([[[0.5, 0.3, 0.2], [1.0, 0, 0], [1.0, 0, 0]]], dtype=torch.float64)
    dice = tree.UniformDice(torch.tensor([[0.55, 0.55]]), torch.tensor([0.0]))
    out = tree.tree_verify_stochastic(p, None, torch.tensor([[0, 1]]), tree.tree_from_widths((2,)), dice)
    assert out.path.tolist() == [[1]] and out.tokens.tolist() == [[1, 0]]


def test_draft_children():
    q = torch.tensor([[0.1, 0.6, 0.3, 0.0]])
    tok, qc, valid = tree.draft_children(q, 3)
    assert tok.tolist() == [[1, 2, 0]] and qc is None and valid.all()
    tok, qc, valid = tree.draft_children(q, 4, TorchRng(0))
    assert valid.tolist() == [[True, True, True, False]]  # q has 3 tokens of support
    assert sorted(tok[0, :3].tolist()) == [0, 1, 2]
    # each child's q is q without the earlier children, renormalised
    first = tok[0, 0].item()
    want = q[0].double().clone()
    want[first] = 0
    assert torch.allclose(qc[0, 1], want / want.sum())


# --- fast == reference -------------------------------------------------------------------------

@st.composite
def random_trees(draw):
    N = draw(st.integers(0, 9))
    return torch.tensor([draw(st.integers(-1, j - 1)) for j in range(N)], dtype=torch.long)


@settings(max_examples=80, deadline=None)
@given(parents=random_trees(), B=st.integers(1, 4), V=st.integers(2, 6), seed=st.integers(0, 10**6),
       kind=st.sampled_from(["onehot", "sampled", "sparse"]), peaked=st.booleans())
def test_fast_equals_reference(parents, B, V, seed, kind, peaked):
    """The batched verifiers equal the loop references draw for draw (the same UniformDice),
    over random tree shapes, p, candidates drafted from random q (sparse: many zeros, so groups
    run out of support and nodes are invalid), and greedy on the argmax."""
    g = torch.Generator().manual_seed(seed)
    N = len(parents)
    scale = 4.0 if peaked else 1.0
    p = (torch.randn(B, N + 1, V, generator=g) * scale).softmax(-1)
    q_table = (torch.randn(B, N + 1, V, generator=g) * scale).softmax(-1)
    if kind == "sparse":
        q_table = q_table * (torch.rand(B, N + 1, V, generator=g) < 0.4)
        q_table[..., 0] += 1e-3
    if N:
        tok, q, valid = tree.draft_tree(parents, lambda u, t: q_table[:, u], None if kind == "onehot" else TorchRng(seed))
    else:
        tok, q, valid = torch.zeros(B, 0, dtype=torch.long), None, None
    dice = tree.UniformDice.draw(B, N, seed)
    a = tree.tree_verify_stochastic(p, q, tok, parents, dice, valid)
    b = tree.tree_verify_reference(p, q, tok, parents, dice, valid)
    assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens) and torch.equal(a.num_emitted, b.num_emitted)
    am = p.argmax(-1)
    if N:  # make hits likely: a candidate equal to its parent's argmax half the time
        tok = torch.where(torch.rand(B, N, generator=g) < 0.5, am[:, parents + 1], tok)
    a = tree.tree_verify_greedy(am, tok, parents, valid)
    b = tree.tree_verify_greedy_reference(am, tok, parents, valid)
    assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens)


# --- exact enumeration -------------------------------------------------------------------------

def exact(setting, shape, kind, record="drawn"):
    t = tables(setting)
    got = tm.joint_exact(tm.reference_round(t, tree.tree_from_widths(SHAPES[shape]), kind, record=record))
    assert abs(sum(got.values()) - 1.0) < 1e-9
    return tm.max_diff(got, t.target_joint())


@pytest.mark.parametrize("kind", tm.KINDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_exact_joint_equals_target(shape, kind):
    assert exact("plain", shape, kind) < 1e-6


@pytest.mark.parametrize("kind", ["top_m", "sampled"])
@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "plain"])
@pytest.mark.parametrize("shape", ["w2_1", "w3_2"])
def test_exact_joint_with_sampling_transforms(shape, setting, kind):
    assert exact(setting, shape, kind) < 1e-6


@pytest.mark.parametrize("shape, kind", [("w2", "top_m"), ("w2_1", "top_m"), ("w2", "sampled"),
                                         ("w2_1", "ngram")])
def test_exact_joint_fast_path(shape, kind):
    """The batched fast path itself (draft_tree + tree_verify_stochastic, a coin for every node)
    enumerated on small trees; larger ones are tied to the reference by test_fast_equals_reference."""
    t = tables("temp0.7_topk3")
    got = tm.joint_exact(tm.fast_round(t, tree.tree_from_widths(SHAPES[shape]), kind))
    assert tm.max_diff(got, t.target_joint()) < 1e-6


def unnormalised_residual(monkeypatch):
    """Siblings verified against [r - q]+ (r with c zeroed) without renormalising it (r itself
    where nothing is left, as the real rule falls back)."""
    def fast(p, q, d):
        r = p.clone().scatter_(-1, d.unsqueeze(-1), 0.0) if q is None else (p - q).clamp_min(0.0)
        return torch.where(r.sum(-1, keepdim=True) > 0, r, p)

    def ref(r, q, c):
        left = [max(r[x] - (float(x == c) if q is None else q[x]), 0.0) for x in range(len(r))]
        return left if sum(left) > 0 else r
    monkeypatch.setattr(tree, "residual_distribution", fast)
    monkeypatch.setattr(tree, "_residual_ref", ref)


def siblings_against_p(monkeypatch):
    """Every sibling verified against the parent's p (the residual never carried)."""
    monkeypatch.setattr(tree, "residual_distribution", lambda p, q, d: p)
    monkeypatch.setattr(tree, "_residual_ref", lambda r, q, c: r)


VERIFIER_CONTROLS = {"unnormalised_residual": unnormalised_residual, "siblings_against_p": siblings_against_p}


@pytest.mark.parametrize("kind", ["top_m", "sampled"])
@pytest.mark.parametrize("control", list(VERIFIER_CONTROLS))
def test_exact_catches_verifier_bugs(control, kind, monkeypatch):
    VERIFIER_CONTROLS[control](monkeypatch)
    assert exact("plain", "w3_2", kind) > 1e-3


def test_exact_catches_with_replacement_residual():
    """Drafts drawn without replacement, but each child's q recorded as the parent's whole q
    (the residual rule for draws with replacement): the joint is off."""
    assert exact("plain", "w3_2", "sampled", record="full") > 1e-3


def test_with_replacement_rule_is_exact_for_draws_with_replacement():
    """The control's rule is not wrong in itself: with draws *with* replacement (each child
    drawn from the parent's q, duplicates allowed), recording q itself is exact (SpecInfer's
    multi-draft rule), which shows the control fails for the mismatch alone."""
    t = tables("plain")
    parents = tree.tree_from_widths((3, 2))

    class WithReplacement(tm.LazyRow):
        def children(self, u):
            q = self.t.q[self.t.code(self.prefix[u])]
            for j in self.kids[u]:
                self._add(u, j, int(self.rng.categorical(q.unsqueeze(0))[0]), q.tolist())
                yield j

    def round_fn(h, rng):
        par = tm.prune(parents, 3 - len(h))
        row = WithReplacement(t, h, par, "sampled", rng)
        _, emitted = tree.walk_reference(row, tm.EnumDice(rng, row, tree.depths(par).tolist(), 3 - len(h)))
        return tuple(emitted[:3 - len(h)])
    assert tm.max_diff(tm.joint_exact(round_fn), t.target_joint()) < 1e-6


# --- statistical -------------------------------------------------------------------------------

N = 200_000
STAT_SHAPE = (2, 2, 1)
STAT_SETTING = "temp0.7_topk3"


@pytest.fixture
def one_thread():
    """Elementwise ops on [B, N, 4] tensors gain nothing from threads, and on a shared machine
    two OpenMP threads can make each op 10-50x slower: sample on one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("kind, control", [("sampled", None), ("top_m", None), ("sampled", "with_replacement"),
                                           ("top_m", "unnormalised_residual")])
def test_statistical(kind, control, monkeypatch, one_thread):
    """The batched fast path, round after round, 200,000 sequences (~6 s a case on one core):
    Pearson chi-square of the first 3 tokens (V = 4, top-k 3: 27 cells) against the target's
    exact joint passes at p > 1e-3, and rounds accept nodes at every depth.

    Power: each control's exact joint (enumerated as above) gives the chi-square's noncentrality
    lambda = N sum (alt - target)^2 / target, asserted >= 400 before sampling (it is ~ 6,600 for
    with_replacement and ~ 166,000 for unnormalised_residual); with <= 26 degrees of freedom the
    1e-6 critical value is ~ 76, and a noncentral chi2(26, 400) has mean 426 and sd ~ 41, so the
    control is rejected at p < 1e-6 with probability > 1 - 1e-12. The sampled control must
    really be rejected at p < 1e-6."""
    t = tables(STAT_SETTING)
    parents = tree.tree_from_widths(STAT_SHAPE)
    want = t.target_joint()
    record = "full" if control == "with_replacement" else "drawn"
    if control == "unnormalised_residual":
        unnormalised_residual(monkeypatch)
    if control:
        lam = noncentrality(N, tm.joint_exact(tm.reference_round(t, parents, kind, record=record)), want)
        assert lam >= 400, lam
    counts, accepted = tm.sample_rounds(t, parents, kind, N, seed=7, record=record)
    assert all(accepted[d] > 0 for d in range(len(STAT_SHAPE) + 1)), accepted
    stat, dof, pval = chi_square(counts, want)
    assert (pval < 1e-6) if control else (pval > 1e-3), (stat, dof, pval, accepted)
