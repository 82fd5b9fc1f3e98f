"""The draft head (specdec.head) and its proposer: training sees what drafting sees, a saved head
loads back exactly and refuses what is not one, and speculation with a head (a reduced draft
vocabulary: q is zero outside it) is exactly the target's distribution, by exact enumeration and by
200,000 samples, with negative controls the same tests catch.

The head here is tiny and trained for the test (a few dozen steps on the tiny target's own
features), so its q is neither uniform nor the target's p.
"""

from __future__ import annotations

import copy
import itertools
import json
import random

import pytest
import torch

from conftest import tiny_model
from engines import later_siblings
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError
from specdec.head import DraftHead, HeadConfig, attach, load_head
from specdec.head.data import Sequence, corpus_chunks, teacher_force
from specdec.head.model import HeadCache
from specdec.head.train import acceptance, batches, collate, draft_vocabulary, loss_fn, windows
from specdec.loader import Models, build_engine
from specdec.proposers import head as head_proposer
from specdec.runtime.kernels import linear
from specdec.tools.distribution import (chi_square, engine_joint_exact, noncentrality, sample_engine,
                                        target_joint_exact)

PROMPT = [1, 2, 3]
KW = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
TAP_KW = dict(KW, layers=2)
SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp0.6_topk2": dict(temperature=0.6, top_k=2),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3),
    "all": dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.2),
}


def target_sequences(target, n: int, length: int, seed: int, taps: tuple[int, ...] = ()) -> list[Sequence]:
    """Sequences sampled from the target at T = 1, with its final hidden states (and the taps'
    streams before them; teacher forcing)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = [int(torch.randint(0, 4, (1,), generator=g))]
        for _ in range(length - 1):
            cache = target.new_cache(1, 64)
            lg = target.forward(torch.tensor([toks]), torch.arange(len(toks)).view(1, -1), cache)[0, -1]
            toks.append(int(torch.multinomial(lg.softmax(-1), 1, generator=g)))
        cache = target.new_cache(1, 64)
        _, h = target.forward(torch.tensor([toks[:-1]]), torch.arange(len(toks) - 1).view(1, -1), cache,
                              return_hidden=True, taps=taps)
        out.append(Sequence(toks, h[0].clone(), 1, "test"))
    return out


def train_tiny_head(target, draft_vocab: int, steps: int = 40, seed: int = 0, taps: tuple[int, ...] = ()):
    """(head, top-1 agreement before, after) trained on the target's own samples."""
    torch.manual_seed(seed)
    seqs = target_sequences(target, 24, 14, seed, taps)
    cfg = HeadConfig.for_target(target.args, "tiny", "", draft_vocab, 16, taps)
    head = DraftHead(cfg)
    head.vocab = draft_vocabulary(seqs, draft_vocab, 4, set())
    attach(head, target)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    wins = windows(seqs, 64)
    agree = []
    for i in range(steps):
        for batch in batches(wins, 4096, random.Random(i)):
            loss, a = loss_fn(head, *collate(seqs, batch, cfg.dim, cfg.feature_dim), steps=2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            agree.append(a[0])
    return head.eval(), agree[0], agree[-1]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest (and a loaded machine's second is slow)
    target = tiny_model(seed=31, scale=0.6, **KW)
    head, before, after = train_tiny_head(target, draft_vocab=3)
    assert after > before  # it learned something
    return target, head


@pytest.fixture(scope="module")
def tapped():
    """A head that also reads the residual stream after the target's first layer (EAGLE-3's
    fused features), on a two-layer tiny target."""
    torch.set_num_threads(1)
    target = tiny_model(seed=31, scale=0.6, **TAP_KW)
    head, before, after = train_tiny_head(target, draft_vocab=3, taps=(0,))
    assert after > before and head.cfg.feature_dim == 2 * KW["dim"]
    return target, head


def head_engine(target, head, k, draft_sampling="probabilistic", max_batch=1):
    models = Models(target, None, None, 4, "target", None)
    models.heads["tiny"] = head
    spec = SpeculativeConfig(head="tiny", num_draft_tokens=k, draft_sampling=draft_sampling)
    return build_engine(models, spec, max_model_len=64, max_batch=max_batch)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ---- the head itself ---------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "tapped"])
def test_training_unroll_equals_cached_drafting(which, request):
    """Training's step-s output at pair j is what drafting computes there: the cached forward over
    the true pairs, then s - 1 steps each fed its own predicted feature and the next token (a
    head with taps: the target's fused features for true pairs, its own g for drafted ones)."""
    target, head = request.getfixturevalue(which)
    seq = target_sequences(target, 1, 12, seed=5, taps=tuple(head.cfg.taps))[0]
    T = len(seq.hidden)
    feats, toks = seq.hidden.unsqueeze(0), torch.tensor(seq.tokens[1: T + 1]).unsqueeze(0)
    with torch.no_grad():
        gs = head.unroll(feats, toks, torch.arange(T).unsqueeze(0), steps=3)
        for j0 in (2, 5, 7):
            cache = HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 64)
            g = head.step(feats[:, : j0 + 1], toks[:, : j0 + 1], torch.arange(j0 + 1).view(1, -1), cache, [0])[:, -1]
            torch.testing.assert_close(g, gs[0][:, j0], atol=1e-5, rtol=1e-5)
            for s in (2, 3):  # pair j0 + s - 1 = (g of the step before, the true next token)
                j = j0 + s - 1
                g = head.step(g.unsqueeze(1), toks[:, j: j + 1], torch.tensor([[j]]), cache, [0])[:, 0]
                torch.testing.assert_close(g, gs[s - 1][:, j], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["tiny", "tapped"])
def test_fused_draft_step_equals_torch_step(which, request):
    """A prepared head drafts on the runtime's fused layer glue (`_step_layer`); it computes what
    the torch ops compute (`_step_torch`, same bf16 weights), for a batched prefill over padded
    rows in other cache rows and for single draft steps fed their own features, and writes the
    same KV."""
    target, head = request.getfixturevalue(which)
    head = copy.deepcopy(head).prepare()
    seqs = target_sequences(target, 2, 12, seed=7, taps=tuple(head.cfg.taps))
    feats = torch.stack([s.hidden for s in seqs])  # [2, 11, feature_dim]
    toks = torch.tensor([s.tokens[1:12] for s in seqs])
    caches = [HeadCache(3, head.cfg.n_kv_heads, head.cfg.head_dim, 64) for _ in range(2)]
    rows = [2, 0]
    with torch.no_grad():
        pos = torch.arange(8).view(1, -1).expand(2, 8)
        got = [fn(feats[:, :8], toks[:, :8], pos, c, rows)
               for fn, c in zip((head._step_layer, head._step_torch), caches)]
        torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)
        g = got[0][:, -1]
        for j in (8, 9, 10):
            pos = torch.full((2, 1), j)
            got = [fn(g.unsqueeze(1), toks[:, j: j + 1], pos, c, rows)
                   for fn, c in zip((head._step_layer, head._step_torch), caches)]
            torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)
            g = got[0][:, 0]
    torch.testing.assert_close(caches[0].k[:, :, :11], caches[1].k[:, :, :11], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0].v[:, :, :11], caches[1].v[:, :, :11], atol=1e-5, rtol=1e-5)
    assert not caches[0].k[1].any()  # row 1 untouched


def test_held_out_acceptance_counts_exact_greedy_rounds(tiny):
    """`acceptance` (train-head's held-out report) against a direct count: from every answer
    position the head's greedy drafts on cached steps, accepted up to the first miss; the first
    draft's top-w hit rate starts at the first draft's acceptance and rises with w."""
    target, head = tiny
    seqs = target_sequences(target, 3, 14, seed=21)
    for s in seqs:
        s.prompt_len = 3
    r = acceptance(head, seqs, k=3)
    runs = []
    with torch.no_grad():
        for s in seqs:
            T = len(s.hidden) - 1  # (the pairs acceptance drafts from)
            for j0 in range(2, T - 3):
                cache = HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 64)
                g = head.step(s.hidden[: j0 + 1].unsqueeze(0), torch.tensor([s.tokens[1: j0 + 2]]),
                              torch.arange(j0 + 1).view(1, -1), cache, [0])[:, -1]
                run = 0
                while run < 3:
                    d = int(head.vocab[head.logits(g).argmax(-1)])
                    if d != s.tokens[j0 + run + 2]:
                        break
                    run += 1
                    g = head.step(g.unsqueeze(1), torch.tensor([[d]]), torch.tensor([[j0 + run]]), cache, [0])[:, 0]
                runs.append(run)
    assert r["rounds"] == len(runs)
    assert r["tokens_per_round"]["3"] == pytest.approx(1 + sum(runs) / len(runs), abs=1e-3)
    assert r["acceptance_at"][0] == pytest.approx(sum(x >= 1 for x in runs) / len(runs), abs=1e-4)
    top = [r["first_in_top"][str(w)] for w in range(1, 4)]  # (3 draft tokens: top 3 at most)
    assert top[0] == pytest.approx(r["acceptance_at"][0], abs=1e-4)
    assert top == sorted(top) and top[0] < top[2] <= 1.0


def test_tree_step_equals_chain_steps(tiny):
    """A draft tree's level (siblings at one position in separate slots, each seeing the true
    pairs and its own ancestors) gives every node what a chain step along its own path gives:
    on the fused glue and in torch ops, and for a row whose cache starts past slot 0."""
    target, head = tiny
    prepared = copy.deepcopy(head).prepare()
    seq = target_sequences(target, 1, 12, seed=9)[0]
    feats, toks = seq.hidden[:8].unsqueeze(0), torch.tensor(seq.tokens[1:9]).unsqueeze(0)
    # the tree after 8 true pairs: node 0 at depth 1; nodes 1, 2 its children (siblings); node 3
    # a child of node 2. Node j: slot 8 + j, position 7 + depth.
    parents = [-1, 0, 0, 2]
    g_in = torch.randn(1, 4, head.cfg.dim)  # each node's input feature (its parent's g)
    node_tok = torch.tensor([[1, 2, 0, 3]])
    positions = torch.tensor([[8, 9, 9, 10]])
    slots = torch.tensor([[8, 9, 10, 11]])
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    for h, start in ((prepared, 0), (head, 0), (prepared, 3)):
        cache = HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 64)
        cache.start[0] = start
        with torch.no_grad():
            h.step(feats[:, start:], toks[:, start:], torch.arange(start, 8).view(1, -1), cache, [0])
            tree = h.step(g_in, node_tok, positions, cache, [0], mask=mask, slots=slots)
            for j in range(4):
                path = [j]
                while parents[path[0]] >= 0:
                    path.insert(0, parents[path[0]])
                chain = copy.deepcopy(cache)
                for i in path:  # a chain over the path alone: slot = position
                    g = h.step(g_in[:, i: i + 1], node_tok[:, i: i + 1], positions[:, i: i + 1], chain, [0])
                torch.testing.assert_close(tree[:, j], g[:, 0], atol=1e-5, rtol=1e-5)
        assert not torch.equal(tree[:, 1], tree[:, 2])  # (siblings differ: the test can tell them apart)


def test_save_load_round_trip_and_bad_heads(tiny, tmp_path):
    target, head = tiny
    head.save(tmp_path / "h", dtype=torch.float32)
    back = load_head(tmp_path / "h", target)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    assert json.loads((tmp_path / "h" / "head.json").read_text())["draft_vocab"] == 3
    with pytest.raises(SpecdecError, match="not a trained head"):
        load_head(tmp_path / "missing", target)
    with pytest.raises(SpecdecError, match="hidden size|trained for a target"):
        load_head(tmp_path / "h", tiny_model(seed=1, **(KW | dict(dim=32))))
    head.cfg.target_sha256 = "cd" * 32
    head.save(tmp_path / "h", dtype=torch.float32)
    head.cfg.target_sha256 = ""
    assert load_head(tmp_path / "h", target, target_sha256="cd" * 32) is not None
    with pytest.raises(SpecdecError, match="sha256"):
        load_head(tmp_path / "h", target, target_sha256="ab" * 32)
    (tmp_path / "h" / "head.json").write_text("{not json")
    with pytest.raises(SpecdecError, match="not a head config"):
        load_head(tmp_path / "h", target)


def test_head_flags_are_checked():
    with pytest.raises(SpecdecError, match="draft='x' is not used by proposer='head'"):
        SpeculativeConfig(proposer="head", draft="x").check_unused()
    with pytest.raises(SpecdecError, match="only used by proposer='head'"):
        SpeculativeConfig(proposer="ngram", head="dir").check_unused()
    assert SpeculativeConfig(head="dir").proposer == "head"
    with pytest.raises(SpecdecError, match="no head is shipped for model 'nope'"):
        build_engine(Models(tiny_model(**KW), None, None, 4, "nope", None), SpeculativeConfig(proposer="head", num_draft_tokens=2))


def test_a_round_reads_the_features_it_needs_from_the_chunks_as_they_came(tiny):
    """The proposer keeps a row's features as the rounds delivered them and reads only the tail a
    round needs: the same values as joining them all first, at every offset, for few and for
    many (> 64, joined once) chunks."""
    _, head = tiny
    p = head_proposer.HeadProposer(copy.deepcopy(head), 4, 64)
    g = torch.Generator().manual_seed(1)
    for sizes in ([5], [3, 1, 2, 1], [1] * 70 + [4]):
        chunks = [torch.randn(n, p.F, generator=g) for n in sizes]
        whole = torch.cat(chunks)
        for i in range(len(whole) + 2):
            p.feats[0] = list(chunks)
            assert torch.equal(p._since(0, i), whole[i:]), (sizes, i)
    p.feats[0] = []
    assert p._since(0, 0).shape == (0, p.F)


def test_held_out_acceptance_is_adaptive_ks_prior(tiny):
    """A head's held-out acceptance (head.json) becomes adaptive k's starting point for it:
    (first draft, later drafts), each set weighted by its rounds."""
    held = {"chat": {"rounds": 100, "acceptance_at": [0.3, 0.2, 0.4]},
            "code": {"rounds": 300, "acceptance_at": [0.7, 0.5, 0.5]}}
    assert head_proposer.held_out_prior(held) == pytest.approx((0.6, (100 * 0.6 + 300 * 1.0) / 800))
    assert head_proposer.held_out_prior({}) is None
    target, head = tiny
    head = copy.deepcopy(head)
    head.cfg.held_out = held
    for build in (head_engine, composite_engine):
        assert build(target, head, "auto").policy.priors == {"head": pytest.approx(head_proposer.held_out_prior(held))}
    assert head_engine(target, tiny[1], "auto").policy.priors == {}  # no held-out numbers: the default


def test_the_head_reports_its_catch_up_apart_from_drafting(tiny):
    """After rounds without a draft, the head feeds the pairs it sat out before drafting: that is
    a catch-up (Proposal.catch_up, and peek's candidate says it beforehand), which adaptive k
    measures and prices apart from the cost of drafting k; in steady state it feeds 1-2 pairs.
    Control: with every round drafting, no catch-up past the steady 2."""
    from specdec.round import Choice

    target, head = tiny
    for plain_every in (0, 3):  # 0: every round drafts; 3: two plain rounds before each draft
        engine = head_engine(target, head, 1)
        seen, peeked, rounds = [], [], itertools.count()
        plan, propose = engine._plan, engine.proposer.propose

        def _plan(r, batch_size, plan=plan, plain_every=plain_every):
            if plain_every and next(rounds) % plain_every:
                return Choice(0)
            peeked.append(engine.proposer.peek(r, 1)[0].catch_up)
            return plan(r, batch_size)

        def _propose(reqs, ks, only=None, propose=propose):
            prop = propose(reqs, ks, only)
            seen.append(prop.catch_up)
            return prop

        engine._plan, engine.proposer.propose = _plan, _propose
        engine.generate([[1, 2, 3, 1]], SamplingParams(temperature=0.0, max_tokens=24))
        assert seen and peeked[:len(seen)] == seen  # peek said what drafting then fed
        if plain_every:
            assert min(seen[1:]) >= 3, seen  # 2 plain rounds + the last round's 1-2 pairs
        else:
            assert max(seen) <= 2, seen


# ---- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k, draft_sampling", [(1, "probabilistic"), (2, "probabilistic"),
                                               (3, "probabilistic"), (2, "greedy")])
def test_head_joint_equals_target_joint(tiny, setting, k, draft_sampling):
    """The head drafts from 3 of the 4 tokens (q = 0 on the fourth): the joint of the first 3
    tokens is still the target's, to 1e-6."""
    target, head = tiny
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    _assert_joint_exact(head_engine(target, head, k, draft_sampling), target, params)


def _assert_joint_exact(engine, target, params) -> None:
    got = engine_joint_exact(engine, PROMPT, params)
    # (1e-6, not the draft model's 1e-9: a replay whose target KV comes from the prefix cache feeds
    # the head its pairs in one forward instead of two, and torch's GEMM rounds by shape, ~1e-8)
    assert abs(sum(got.values()) - 1.0) < 1e-6
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) < 1e-6
    assert engine.proposer.parts()[-1].forwards > 0  # the head drafted (alone, or a composite's last part)


def _q_over_full_vocabulary(monkeypatch):
    """The bug a reduced vocabulary invites: drafts sampled on the draft vocabulary, but the q
    handed to the verifier spread over the whole vocabulary (smoothed onto the missing token)."""
    real = head_proposer.draw

    def draw(*args, **kw):
        d, q, dead = real(*args, **kw)
        if q is not None:
            q = 0.7 * q + 0.3 / q.shape[-1]
        return d, q, dead
    monkeypatch.setattr(head_proposer, "draw", draw)


def test_exact_test_catches_q_over_full_vocabulary(tiny, monkeypatch):
    target, head = tiny
    params = SamplingParams(max_tokens=16, temperature=1.0)
    _q_over_full_vocabulary(monkeypatch)
    got = engine_joint_exact(head_engine(target, head, 2), PROMPT, params)
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3


# Trees drafted by the head: sampled candidates (without replacement from its q) and deterministic
# ones (its top tokens); width 4 > the 3-token draft vocabulary leaves a node with no candidate.
TREE_CASES = ([((2,), s, "probabilistic") for s in ("plain", "temp0.6_topk2")]
              + [((2,), s, "greedy") for s in ("plain", "temp0.6_topk2")]
              + [((2, 1), "plain", "probabilistic"), ((3, 2), "plain", "greedy"), ((4,), "plain", "greedy"),
                 ((1, 3), "temp0.6_topk2", "probabilistic"), ((2, 2), "penalties", "probabilistic")])


def head_tree_engine(target, head, widths, draft_sampling="probabilistic", max_batch=1, k=None):
    models = Models(target, None, None, 4, "target", None)
    models.heads["tiny"] = head
    spec = SpeculativeConfig(head="tiny", num_draft_tokens=k or len(widths), draft_sampling=draft_sampling,
                             draft_tree=widths)
    return build_engine(models, spec, max_model_len=64, max_batch=max_batch)


@pytest.mark.parametrize("widths, setting, draft_sampling", TREE_CASES)
def test_head_tree_joint_equals_target_joint(tiny, widths, setting, draft_sampling):
    target, head = tiny
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    _assert_joint_exact(head_tree_engine(target, head, widths, draft_sampling), target, params)


@pytest.mark.parametrize("k, widths, setting", [(2, None, "all"), (3, None, "plain"), (2, (3, 2), "temp0.6_topk2")])
def test_tapped_head_joint_equals_target_joint(tapped, k, widths, setting):
    """A head with taps drafts chains and trees; the joint of the first 3 tokens is the target's."""
    target, head = tapped
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = head_engine(target, head, k) if widths is None else head_tree_engine(target, head, widths)
    _assert_joint_exact(engine, target, params)


def test_forward_taps_are_the_residual_stream_and_batch_invariant():
    """forward(taps=...) returns the residual stream after each tapped layer, then the final hidden
    state unchanged: the stream after the last layer, normed, is the final hidden state; a row
    computed alone has the same bits as among other rows; a bad tap is never asked for (the head
    checks its layers against the target)."""
    target = tiny_model(seed=4, **dict(KW, layers=3))
    d, eps = KW["dim"], target.args.norm_eps
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 4, (3, 7), generator=g)
    pos = torch.arange(7).view(1, -1).expand(3, 7)
    _, h = target.forward(toks, pos, target.new_cache(3, 16), return_hidden=True)
    _, ht = target.forward(toks, pos, target.new_cache(3, 16), return_hidden=True, taps=(0, 2))
    assert ht.shape == (3, 7, 3 * d) and torch.equal(ht[..., -d:], h)
    last = ht[..., d: 2 * d]
    torch.testing.assert_close(last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * target.norm, h,
                               atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ht[..., :d], last)  # layer 0's stream is not layer 2's
    _, one = target.forward(toks[1:2], pos[1:2], target.new_cache(1, 16), return_hidden=True, taps=(0, 2))
    assert torch.equal(one[0], ht[1])
    head = DraftHead(HeadConfig.for_target(target.args, "tiny", "", 3, 16, taps=(2,)))
    with pytest.raises(SpecdecError, match=r"reads target layers \[2\]; this target has 3 layers"):
        attach(head, target)


@pytest.mark.parametrize("which, tree, setting", [("tiny", "dynamic:4", "plain"), ("tiny", "dynamic:6", "temp0.6_topk2"),
                                                  ("tapped", "dynamic:5", "plain")])
def test_head_dynamic_tree_joint_equals_target_joint(which, tree, setting, request):
    """The head grows dynamic trees (its own confidence, deterministic candidates): exact."""
    target, head = request.getfixturevalue(which)
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    _assert_joint_exact(head_tree_engine(target, head, tree, k=3), target, params)


def _tree_q_smoothed(monkeypatch):
    """A tree's children drawn from the head's q, but the q recorded for the verifier smoothed
    over the whole vocabulary."""
    real = head_proposer.fill_children

    def fill(req, logits, nodes, tokens, valid, parent_valid, offset, q, draft_sampling):
        real(req, logits, nodes, tokens, valid, parent_valid, offset, q, draft_sampling)
        if q is not None:
            for j in nodes:
                q[j] = 0.7 * q[j] + 0.3 / q.shape[-1]
    monkeypatch.setattr(head_proposer, "fill_children", fill)


def test_exact_test_catches_head_tree_bugs(tiny, monkeypatch):
    """Controls: a smoothed q for sampled children; and every deterministic candidate accepted
    against its parent's p (no residual after a rejected sibling). The same test rejects both."""
    target, head = tiny
    params = SamplingParams(max_tokens=16, temperature=1.0)
    want = target_joint_exact(target, PROMPT, params)
    with monkeypatch.context() as m:
        _tree_q_smoothed(m)
        got = engine_joint_exact(head_tree_engine(target, head, (2, 1)), PROMPT, params)
        assert _max_diff(got, want) > 1e-3
    monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
    got = engine_joint_exact(head_tree_engine(target, head, (3,), "greedy"), PROMPT, params)
    assert _max_diff(got, want) > 1e-3


def test_greedy_head_tree_equals_plain_batched(tiny):
    """Rows of different prompts in one batch, one with penalties (it drafts a chain beside the
    tree rows): the same tokens as plain greedy decoding, with accepted later siblings."""
    target, head = tiny
    prompts = [[1, 2, 3], [0, 3, 3, 1, 2, 0, 1], [2], [3, 1, 0, 0, 2]]
    params = [SamplingParams(temperature=0, max_tokens=24)] * 3 + [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3)]
    plain = build_engine(Models(target, None, None, 4, "target", None), None, max_model_len=64, max_batch=4)
    want = [plain.generate([p], ps)[0].output for p, ps in zip(prompts, params)]
    for widths in ((2, 2), (3, 1, 1), "dynamic:5"):
        eng = head_tree_engine(target, head, widths, max_batch=4, k=3)
        with later_siblings() as later:
            got = eng.generate(prompts, params)
        assert [r.output for r in got] == want, widths
        assert sum(r.stats.draft_tokens for r in got) > 0
        assert later, "no accepted path went through a later sibling"


N, BATCH = 200_000, 4000
STAT_PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=3)


@pytest.mark.parametrize("control", [None, "q_over_full_vocabulary"])
def test_head_samples_match_target(tiny, control, monkeypatch):
    """200,000 samples of the first 3 tokens from the real engine loop (batched rows, the head's
    cache rolled back across rounds), Pearson chi-square against the target's exact joint: pass
    at p > 1e-3. The control's exact joint gives its noncentrality lambda; lambda >= 400 with ~60
    degrees of freedom means it is rejected at p < 1e-6 with probability > 1 - 1e-9 (see
    tests/test_statistical.py), and the sampled control must be."""
    target, head = tiny
    want = target_joint_exact(target, PROMPT, STAT_PARAMS)
    if control:
        _q_over_full_vocabulary(monkeypatch)
        alt = engine_joint_exact(head_engine(target, head, 3), PROMPT, STAT_PARAMS)
        assert noncentrality(N, alt, want) >= 400
    engine = head_engine(target, head, 3, max_batch=BATCH)
    counts = sample_engine(engine, PROMPT, STAT_PARAMS, N, BATCH, seed=7)
    _, _, p = chi_square(counts, want)
    assert engine.proposer.forwards > 0
    if control:
        assert p < 1e-6
    else:
        assert p > 1e-3


# ---- the n-gram + head composite (`--proposer composite` without a draft model) ------------------
def composite_engine(target, head, k, max_batch=1, ngram_min=2, k_cost=None):
    """n-gram lookup first (matches of >= ngram_min tokens: on a 4-token vocabulary every context
    has a 1-token match, so the head would never be asked), the head where it finds nothing.
    k_cost: a fixed cost model for adaptive k (the choice then depends on acceptance only)."""
    models = Models(target, None, None, 4, "target", None)
    models.heads["tiny"] = head
    spec = SpeculativeConfig(proposer="composite", head="tiny", num_draft_tokens=k, ngram_min=ngram_min)
    return build_engine(models, spec, max_model_len=64, max_batch=max_batch, k_cost=k_cost)


def _count_ngram_drafts(engine) -> list[int]:
    """Draft tokens the composite's n-gram part proposes, per call, from now on."""
    ngram, calls = engine.proposer.proposers[0], []
    real = ngram.propose

    def propose(*args, **kw):
        prop = real(*args, **kw)
        calls.append(int(prop.num_draft.sum()))
        return prop
    ngram.propose = propose
    return calls


BATCH_PROMPTS = [[1, 2, 3], [0, 3, 3, 1, 2, 0, 1], [2], [3, 1, 0, 0, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.mark.parametrize("which", ["tiny", "tapped"])
@pytest.mark.parametrize("proposer", ["head", "composite"])
def test_greedy_head_speculation_equals_plain_batched(which, proposer, request):
    """Rows of different prompts and lengths in one batch, k = 3 and adaptive k, the head alone or
    after the n-gram lookup: the same tokens as plain greedy decoding, and the head drafted (and
    had some accepted); in the composite both parts drafted. The composite's adaptive k runs on
    a fixed cost model: on measured clocks which part wins a round depends on the machine (a CI
    run once priced the lookup out of every round), on this one only on acceptance."""
    target, head = request.getfixturevalue(which)
    plain = build_engine(Models(target, None, None, 4, "target", None), None, max_model_len=64, max_batch=4)
    want = [r.output for r in plain.generate(BATCH_PROMPTS, GREEDY)]
    for k in (3, "auto"):
        if proposer == "head":
            engine = head_engine(target, head, k, max_batch=4)
        else:
            engine = composite_engine(target, head, k, max_batch=4,
                                      k_cost=(lambda B, kk: 1.0 + 0.1 * kk) if k == "auto" else None)
        got = engine.generate(BATCH_PROMPTS, GREEDY)
        assert [r.output for r in got] == want, k
        assert sum(r.stats.draft_tokens for r in got) > 0
        if k == 3:
            assert sum(r.stats.accepted_tokens for r in got) > 0
        if proposer == "composite":
            assert {name for r in got for name in r.stats.proposers} == {"ngram", "head"}, k


@pytest.mark.parametrize("which", ["tiny", "tapped"])
def test_head_composite_feeds_the_head_every_round(which, request):
    """The head's features (the target's hidden states) reach it in the n-gram's rounds too: after
    a request, the head holds one per committed position but the last, equal to those a head-only
    engine received for the same tokens (the runtime is batch-invariant)."""
    target, head = request.getfixturevalue(which)
    prompt = BATCH_PROMPTS[1]
    alone = composite_engine(target, head, 3)
    ngram_calls = _count_ngram_drafts(alone)
    r = alone.generate([prompt], GREEDY)[0]
    assert sum(ngram_calls) > 0 and r.stats.proposers["head"].proposals > 0
    solo = head_engine(target, head, 3)
    assert solo.generate([prompt], GREEDY)[0].output == r.output
    n = len(prompt) + len(r.output) - 1
    feats, ref = alone.proposer.proposers[1]._all(0), solo.proposer._all(0)
    assert len(feats) == n and len(ref) == n
    assert torch.equal(feats, ref)


@pytest.mark.parametrize("setting", ["plain", "temp0.6_topk2", "penalties"])
def test_head_composite_joint_equals_target_joint(tiny, setting):
    """Rounds drafted by the n-gram (one-hot q) and by the head (its q on 3 of the 4 tokens) in
    one request: the joint of the first 3 tokens is the target's, to 1e-6."""
    target, head = tiny
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = composite_engine(target, head, 2, ngram_min=1)
    ngram_calls = _count_ngram_drafts(engine)
    _assert_joint_exact(engine, target, params)  # (asserts that the head drafted)
    assert sum(ngram_calls) > 0


def test_exact_test_catches_q_over_full_vocabulary_in_the_composite(tiny, monkeypatch):
    """The same control through the composite: the enumeration sees the head's wrong q."""
    target, head = tiny
    params = SamplingParams(max_tokens=16, temperature=1.0)
    _q_over_full_vocabulary(monkeypatch)
    got = engine_joint_exact(composite_engine(target, head, 2, ngram_min=1), PROMPT, params)
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3


def test_head_composite_flags_are_checked():
    assert SpeculativeConfig(proposer="composite", head="dir").draft is None  # no draft model needed
    with pytest.raises(SpecdecError, match="second part is the draft model or, without one, the head"):
        SpeculativeConfig(proposer="composite", head="dir", draft="x")
    with pytest.raises(SpecdecError, match="composite tree needs a draft model"):
        SpeculativeConfig(proposer="composite", draft_tree="dynamic")
    with pytest.raises(SpecdecError, match="draft_dtype='q4_0' applies to a draft model"):
        SpeculativeConfig(proposer="composite", draft_dtype="q4_0").check_unused()
    with pytest.raises(SpecdecError, match="composite' needs a draft model .* or a draft head .*no head is shipped "
                                           "for model 'nope'"):
        build_engine(Models(tiny_model(**KW), None, None, 4, "nope", None), SpeculativeConfig(proposer="composite"))


def test_verify_command_with_a_head(tiny, tmp_path, capsys):
    """`specdec verify --head DIR` passes at T = 1 (the head drafts, 4,000 samples), and the same
    audit fails the classic bug (--control redraw-from-p)."""
    from specdec.cli import main
    from tiny_hf import write_tiny_hf

    target_dir = write_tiny_hf(tmp_path / "target", seed=31, scale=0.6, **KW)
    torch.manual_seed(3)  # an untrained head: q far from p, so the control's bias is large
    head = DraftHead(tiny[1].cfg)
    head.vocab = tiny[1].vocab
    head.save(tmp_path / "head", dtype=torch.float32)
    args = ["verify", "--model", str(target_dir), "--head", str(tmp_path / "head"), "--prefix", "w1 w2 w3",
            "--num-draft-tokens", "3", "--n", "2", "--samples", "4000", "--temperature", "1", "--seed", "3"]
    rc = main(args)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["verdict"] == "pass", report
    assert report["rounds_with_drafts"] > 0 and 0 < report["acceptance_rate"] < 1
    rc = main(args + ["--control", "redraw-from-p"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and report["verdict"] == "fail", report


def test_verify_command_with_the_head_composite(tiny, tmp_path, capsys):
    """`specdec verify --proposer composite --head DIR` (no draft model): both parts draft, the
    audit passes at T = 1 and fails the classic bug."""
    from specdec.cli import main
    from tiny_hf import write_tiny_hf

    target_dir = write_tiny_hf(tmp_path / "target", seed=31, scale=0.6, **KW)
    torch.manual_seed(3)
    head = DraftHead(tiny[1].cfg)
    head.vocab = tiny[1].vocab
    head.save(tmp_path / "head", dtype=torch.float32)
    args = ["verify", "--model", str(target_dir), "--proposer", "composite", "--head", str(tmp_path / "head"),
            "--ngram-min", "2", "--prefix", "w1 w2 w3 w1 w2", "--num-draft-tokens", "3", "--n", "3",
            "--samples", "4000", "--temperature", "1", "--seed", "3"]
    rc = main(args)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["verdict"] == "pass", report
    assert {n for n, p in report["proposers"].items() if p["proposals"] > 0} == {"ngram", "head"}, report
    rc = main(args + ["--control", "redraw-from-p"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and report["verdict"] == "fail", report


def test_verify_command_with_a_tapped_head(tapped, tmp_path, capsys):
    """`specdec verify` with a head that reads an inner layer: its memo model answers the taps."""
    from specdec.cli import main
    from tiny_hf import write_tiny_hf

    target_dir = write_tiny_hf(tmp_path / "target", seed=31, scale=0.6, **TAP_KW)
    torch.manual_seed(3)
    head = DraftHead(tapped[1].cfg)
    head.vocab = tapped[1].vocab
    head.save(tmp_path / "head", dtype=torch.float32)
    rc = main(["verify", "--model", str(target_dir), "--head", str(tmp_path / "head"), "--prefix", "w1 w2 w3",
               "--num-draft-tokens", "3", "--n", "2", "--samples", "3000", "--temperature", "1", "--seed", "3"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["verdict"] == "pass", report
    assert report["rounds_with_drafts"] > 0


# ---- the shipped SmolLM2 head, on the real model ---------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_models():
    from specdec.loader import load_models

    torch.set_num_threads(2)
    return load_models("smollm2-135m", dtype="native")


def test_shipped_head_greedy_equals_plain_on_smollm2(smollm2_models):
    """The head shipped for SmolLM2 (`--proposer head` alone finds it), at its native quantisation:
    greedy speculative output equals plain greedy token for token, chat and code prompts, batched
    and one at a time, at k = 4 and adaptive k, and drafting trees (3, 2, 1, the adaptive shape
    and dynamic trees), with drafts accepted (held-out prompts: the benchmark's chat set and HumanEval are
    never in its training data) and, for the fixed tree, accepted later siblings."""
    from specdec.tools.prompts import CHAT_PROMPTS, humaneval

    models = smollm2_models
    tok = models.tokenizer
    prompts = [tok.encode_prompt(p) for p in CHAT_PROMPTS[:3] + humaneval(2)]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = build_engine(models, None, max_model_len=2048, max_batch=5)
    want = [r.output for r in plain.generate(prompts, params)]
    for k, tree in ((4, None), ("auto", None), (3, (3, 2, 1)), ("auto", "auto"), (4, "dynamic")):
        eng = build_engine(models, SpeculativeConfig(proposer="head", num_draft_tokens=k, draft_tree=tree),
                           max_model_len=2048, max_batch=5)
        with later_siblings() as later:
            got = eng.generate(prompts, params)
        assert [r.output for r in got] == want, (k, tree)
        alone = [eng.generate([p], params)[0].output for p in prompts[:2]]
        assert alone == want[:2], (k, tree)
        drafted = sum(r.stats.draft_tokens for r in got)
        accepted = sum(r.stats.accepted_tokens for r in got)
        assert drafted > 0 and accepted > 0, (k, tree, accepted, drafted)
        if tree in ((3, 2, 1), "dynamic"):
            assert later, "no accepted path went through a later sibling"


def test_shipped_head_composite_greedy_equals_plain_on_smollm2(smollm2_models):
    """`--proposer composite` on SmolLM2 (no draft model: the n-gram lookup, then the shipped head):
    greedy output equals plain, batched and alone, k = 1 and adaptive k; at k = 1 both parts drafted
    and had drafts accepted."""
    from specdec.tools.prompts import CHAT_PROMPTS, humaneval

    models = smollm2_models
    tok = models.tokenizer
    prompts = [tok.encode_prompt(p) for p in CHAT_PROMPTS[:2] + humaneval(2)]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [r.output for r in build_engine(models, None, max_model_len=2048, max_batch=4).generate(prompts, params)]
    for k in (1, "auto"):
        eng = build_engine(models, SpeculativeConfig(proposer="composite", num_draft_tokens=k),
                           max_model_len=2048, max_batch=4)
        got = eng.generate(prompts, params)
        assert [r.output for r in got] == want, k
        assert [eng.generate([p], params)[0].output for p in prompts[:2]] == want[:2], k
        if k == 1:
            for name in ("ngram", "head"):
                accepted = sum(r.stats.proposers[name].tokens_accepted for r in got if name in r.stats.proposers)
                assert accepted > 0, name


def test_shipped_head_drafts_on_int8_weights_near_its_fp32_values(smollm2_models):
    """A prepared head (576-wide SmolLM2) drafts on Q8_0 weights and output rows, the int8
    kernels' formats: its features stay within a few percent of the fp32 head's on real
    features, and its first drafts are the fp32 head's at nearly every position. Where K is not
    a multiple of 32 (the tiny heads) the weights stay bf16 panels."""
    from specdec.head import shipped_head
    from specdec.runtime.kernels import PreparedWeight, prepare_int8
    from specdec.runtime.kernels.quant import QuantWeight
    from specdec.tools.prompts import humaneval

    models = smollm2_models
    target = models.target
    fp32 = load_head(shipped_head("smollm2-135m"), target)
    int8 = copy.deepcopy(fp32).prepare()
    assert all(isinstance(int8._kernels[n], QuantWeight) for n in ("fc", "wqkv", "wo", "w_gate_up", "w_down"))
    ids, rows = int8.draft_rows(models.vocab)
    assert isinstance(rows, QuantWeight) and rows.n == len(ids)
    assert isinstance(prepare_int8(torch.randn(8, 16)), PreparedWeight)  # K = 16: bf16 panels
    toks = models.tokenizer.encode_prompt(humaneval(1)[0])
    with torch.no_grad():
        _, h = target.forward(torch.tensor([toks]), torch.arange(len(toks)).view(1, -1),
                              target.new_cache(1, 1024), return_hidden=True)
        T = len(toks) - 1
        feats, nxt, pos = h[:, :T], torch.tensor([toks[1: T + 1]]), torch.arange(T).view(1, -1)
        g = [head.step(feats, nxt, pos, HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 1024), [0])[0]
             for head in (fp32, int8)]
        rel = (g[1] - g[0]).norm(dim=-1) / g[0].norm(dim=-1)
        first = [fp32.logits(g[0]).argmax(-1), linear(g[1], rows).argmax(-1)]
    assert float(rel.max()) < 0.05, float(rel.max())
    assert float((first[0] == first[1]).float().mean()) >= 0.95


def test_head_layer_starts_as_the_targets_last_layer():
    """`train-head --init-layer last`: the head's attention, MLP and their norms start as the
    target's last layer (dequantised), its input as the token's and the feature's sum; a head
    whose MLP is not the target's width is refused before anything runs."""
    from specdec.head.train import init_from_layer

    target = tiny_model(seed=3, **dict(KW, layers=2))
    cfg = HeadConfig.for_target(target.args, "tiny", "", 3, target.args.intermediate_size)
    head = attach(DraftHead(cfg), target)
    init_from_layer(head, target, 1)
    lw = target.layers[1]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        assert torch.equal(getattr(head, name).weight, getattr(lw, name).dense), name
    assert torch.equal(head.w_a, lw.attn_norm) and torch.equal(head.w_m, lw.ffn_norm)
    d = cfg.dim
    assert torch.equal(head.fc.weight, torch.cat([torch.eye(d), torch.eye(d)], 1))
    init_from_layer(attach(DraftHead(cfg), target), target, 0)  # any layer of the target
    other = attach(DraftHead(HeadConfig.for_target(target.args, "tiny", "", 3, 2 * target.args.intermediate_size)),
                   target)
    assert not torch.equal(other.wqkv.weight, lw.wqkv.dense)  # (without it: a random start)


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))


def test_training_prompts_are_seeded_alternate_and_hold_out_the_benchmarks():
    """The harvest's prompts: the same list for a seed, another for another seed, code and chat
    alternating; no benchmark chat prompt, none of their subjects as a topic, no HumanEval
    function among the code tasks (held out: the head is measured on those)."""
    import re

    from specdec.head.data import CHAT_TOPICS, chat_prompts, code_prompts, training_prompts
    from specdec.tools.prompts import CHAT_PROMPTS, humaneval

    a, b = training_prompts(0), training_prompts(1)
    assert a == training_prompts(0) and a != b and sorted(a) == sorted(b)
    n = 2 * min(len(code_prompts()), len(chat_prompts()))
    assert [k for k, _ in a[:n]] == ["code", "chat"] * (n // 2)
    assert not set(CHAT_PROMPTS) & set(chat_prompts())
    bench = " ".join(CHAT_PROMPTS).lower()
    assert not [t for t in CHAT_TOPICS if t.lower() in bench]
    signature = re.compile(r"def \w+\(.*\).*:")  # a function's whole def line
    theirs = {m.group(0) for p in humaneval() for m in signature.finditer(p)}
    ours = {m.group(0) for p in code_prompts() for m in signature.finditer(p)}
    assert len(theirs) > 100 and len(ours) > 1000 and not theirs & ours


def test_training_prompts_take_the_targets_own_requests_first():
    """With requests (user turns the target wrote), chat prompts are two requests, then one
    templated prompt, and so on; every request is used once, in its order; code still alternates."""
    from specdec.head.data import chat_prompts, training_prompts

    requests = [f"request {i}?" for i in range(7)]
    items = training_prompts(3, requests=requests)
    chat = [p for k, p in items if k == "chat"]
    assert [k for k, _ in items[:10]] == ["code", "chat"] * 5
    assert chat[:2] == requests[:2] and chat[3:5] == requests[2:4] and chat[9] == requests[6]
    assert [p for p in chat if p.startswith("request")] == requests
    assert chat[2] in chat_prompts() and chat[5] in chat_prompts() and chat[10] in chat_prompts()
    assert sorted(chat) == sorted(requests + chat_prompts())
    assert items == training_prompts(3, requests=requests)


class TurnTokenizer:
    """A chat template around V = 64 word tokens: "<u>" is [1, 2], token 3 ends a turn, token 4
    decodes to a non-ASCII word."""
    chat_template = "<u>{content}</u>"
    eos_token_ids = frozenset({3})
    vocab_size = 64

    def apply_chat_template(self, messages):
        return f"<u>{messages[0]['content']}</u>"

    def encode(self, text, add_special_tokens=True):
        assert text == "<u>"  # only the user turn's opening is ever encoded here
        return [1, 2]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join("\u00e9t\u00e9" if i == 4 else f"w{i}" for i in ids)


def test_user_requests_are_the_targets_own_finished_turns():
    """Magpie-style prompts: sampled from the start of a user turn; kept only if the turn ends
    (EOS) within max_new, is 6+ tokens, mostly ASCII and new; the same seed gives the same list,
    `exclude` removes a prompt; no chat template, no requests."""
    from specdec.head.data import user_requests, user_turn_prefix

    target = tiny_model(seed=2, vocab=64, scale=0.05)
    tok = TurnTokenizer()
    assert user_turn_prefix(tok) == [1, 2]
    kept = user_requests(target, tok, 48, seed=0, batch=8, max_new=24)
    assert kept == user_requests(target, tok, 48, seed=0, batch=8, max_new=24)
    assert 0 < len(kept) < 48 and len(set(kept)) == len(kept)
    for text in kept:
        words = text.split()
        assert len(words) >= 6 and "w3" not in words and len(words) < 24
        assert sum(ord(c) > 127 for c in text) <= 0.02 * len(text)
    assert user_requests(target, tok, 48, seed=0, batch=8, max_new=24, exclude=kept[:1]) == kept[1:]
    tok.chat_template = None
    assert user_turn_prefix(tok) is None and user_requests(target, tok, 8, 0, 8) == []


def test_corpus_chunks_are_seeded_sized_and_alternate():
    """The teacher-forcing corpus: the same seed gives the same chunks, another seed another
    order; every chunk 64..window tokens; prose and code alternate from the start."""
    first = list(itertools.islice(corpus_chunks(ByteTokenizer(), 0, 256), 40))
    assert first == list(itertools.islice(corpus_chunks(ByteTokenizer(), 0, 256), 40))
    assert first != list(itertools.islice(corpus_chunks(ByteTokenizer(), 1, 256), 40))
    assert all(64 <= len(ids) <= 256 for _, ids in first)
    assert [k for k, _ in first[:6]] == ["corpus-text", "corpus-code"] * 3
    assert any("def " in bytes(ids).decode("utf-8", "replace") for k, ids in first if k == "corpus-code")


class TokenIds:  # a tokenizer for prompts given as token ids: only what harvest reads
    vocab_size = 4
    eos_token_ids = [3]


def test_harvest_samples_the_targets_tempered_distribution():
    """The harvest's sampled answers (a share of the training data, and every user turn the
    target writes) come from the target at the harvest's temperature: the joint of two answer
    tokens (an answer ends early at eos) from 2,000 batched rows against the exact one, chi-square
    at p > 1e-3. Control: the same samples against T = 1's joint, its noncentrality >= 400 first
    (power ~1 at p < 1e-6 with <= 12 degrees of freedom), must be rejected; greedy rows take the
    argmax."""
    from specdec.head.data import harvest

    target = tiny_model(seed=11, **KW)
    prompt = [1, 2, 0]

    def probs(ids, temp):
        cache = target.new_cache(1, 16)
        lg = target.forward(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1), cache)[0, -1]
        return (lg.double() / temp).softmax(-1)

    def joint(temp):
        out, p1 = {}, probs(prompt, temp)
        for a in range(4):
            if a == 3:
                out[(a,)] = float(p1[a])
                continue
            p2 = probs(prompt + [a], temp)
            for b in range(4):
                out[(a, b)] = float(p1[a] * p2[b])
        return out

    N, T = 2000, 0.4
    seqs = harvest(target, TokenIds(), [("user", prompt)] * N, 2, 64, seed=0, sampled_share=1.0, temperature=T)
    counts: dict = {}
    for q in seqs:
        key = tuple(q.tokens[len(prompt):])
        counts[key] = counts.get(key, 0) + 1
    want, control = joint(T), joint(1.0)
    assert noncentrality(N, control, want) >= 400
    _, dof, p = chi_square(counts, want)
    assert p > 1e-3, (p, dof)
    _, dof, p_control = chi_square(counts, control)
    assert p_control < 1e-6
    greedy = harvest(target, TokenIds(), [("user", prompt)] * 5, 2, 4, seed=0, sampled_share=0.0)
    first = int(probs(prompt, 1.0).argmax())
    assert all(q.tokens[len(prompt)] == first for q in greedy)


def test_teacher_forced_features_equal_decoding_features():
    """The head trains on features from one prefill over a chunk and drafts from features of
    verify forwards a few tokens wide: both must be the same numbers (batch-invariant widths)."""
    target = tiny_model(seed=5, **KW)
    ids = [int(t) for t in torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(3))]
    seq = teacher_force(target, [("corpus-code", ids)], window=32)[0]
    assert seq.tokens == ids and seq.hidden.shape == (19, KW["dim"]) and seq.prompt_len == 0
    cache = target.new_cache(1, 64)
    rows = []
    for a in range(0, 19, 3):  # 3 tokens per forward, as a verify round of k = 2
        b = min(a + 3, 19)
        _, h = target.forward(torch.tensor([ids[a:b]]), torch.arange(a, b).view(1, -1), cache, return_hidden=True)
        cache.set_length(0, b)
        rows.append(h[0])
    assert torch.equal(seq.hidden, torch.cat(rows).half())
    seq2 = teacher_force(target, [("corpus-code", ids)] * 3, window=32, token_budget=25)
    assert len(seq2) == 2  # stops starting chunks once the budget is read


def test_draft_vocabulary_counts_teacher_forced_text_once():
    """Answers weigh 4x in the draft vocabulary (they are what the head drafts); teacher-forced
    text, like a prompt, once."""
    answer = Sequence([0, 5, 5, 5], torch.zeros(3, 2), 1, "chat")
    corpus = Sequence([0] + [7] * 5, torch.zeros(5, 2), 0, "corpus-text")
    ids = draft_vocabulary([answer, corpus], 2, 10, set())
    assert ids.tolist() == [5, 7]
    ids = draft_vocabulary([answer, corpus], 1, 10, set())
    assert ids.tolist() == [5]  # 3 answer tokens x 4 beat 5 corpus tokens


def test_train_head_command_end_to_end(tmp_path, capsys):
    """`specdec train-head` as a user runs it, on a tiny checkpoint with a tokenizer: harvest,
    train, held-out measurement, a head that loads and drafts; the same --out again is a clear
    error (the head is finished), and a bad flag names itself."""
    from specdec.cli import main
    from tiny_hf import write_tiny_hf

    model = write_tiny_hf(tmp_path / "m", vocab=300)
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({  # a chat template: user turns
        "chat_template": "{% for m in messages %}w1 {{ m['content'] }} w3 {% endfor %}w2", "eos_token": "w3"}))
    out = tmp_path / "head"
    flags = ["train-head", "--model", model, "--out", str(out), "--minutes", "1", "--harvest-tokens", "3000",
             "--epochs", "2", "--draft-vocab", "256", "--intermediate", "32", "--max-new", "24",
             "--batch-pairs", "256", "--corpus-tokens", "2000", "--taps", "0", "--threads", "1"]
    assert main(flags) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["train"]["steps"] >= 1 and report["train"]["answered_tokens"] >= 3000
    assert report["train"]["teacher_forced_tokens"] >= 2000
    requests = json.loads((out / "work" / "user_requests.json").read_text())  # ceil(3000 / 24) asked for
    assert report["train"]["user_requests"] == len(requests) and len(requests) <= 125
    assert report["held_out"]["chat"]["rounds"] > 0 and len(report["held_out"]["code"]["acceptance_at"]) == 5
    from specdec.head.data import load_shards  # every 20th answer is measured after each epoch, never trained on
    from specdec.head.train import kept_out
    answers, corpus = load_shards(out / "work"), load_shards(out / "work", "corpus")
    kept = [i for i, _ in answers if kept_out(i)]
    assert report["train"]["validation_answers"] == len(kept) >= 1
    assert report["train"]["sequences"] == len(answers) - len(kept) + len(corpus)
    assert 1 <= len(report["train"]["validation"]) <= 2  # one per (part of an) epoch, --epochs 2
    assert all(v["tokens_per_round"]["1"] >= 1 for v in report["train"]["validation"])
    head = DraftHead.load(out)
    assert head.cfg.draft_vocab == 256 and head.cfg.train["batch_pairs"] == 256 and head.cfg.taps == [0]
    assert "fuse.weight" in head.state_dict()
    assert main(flags) == 2
    assert "already holds a finished head" in capsys.readouterr().err
    assert main([*flags[:-4], "--lr", "0", "--threads", "1"]) == 2
    assert "lr" in capsys.readouterr().err
    assert main([*flags[:-4], "--user-requests", "-1", "--threads", "1"]) == 2
    assert "user_requests=-1" in capsys.readouterr().err
    assert main([*flags[:-2], "--harvest-share", "0.5", "--corpus-share", "0.5", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "corpus_share=0.5" in err and "[0, 0.50)" in err
    fresh = [*flags[:4], str(tmp_path / "other"), *flags[5:-4]]
    assert main([*fresh, "--taps", "1", "--threads", "1"]) == 2  # two layers: only layer 0
    assert "taps=1: the model has 2 layers; allowed layer indices [0, 0]" in capsys.readouterr().err
    assert main([*fresh, "--taps", "0,0", "--threads", "1"]) == 2
    assert "distinct and ascending" in capsys.readouterr().err
    assert main([*fresh, "--init-layer", "last", "--threads", "1"]) == 2  # --intermediate 32 is not its MLP
    err = capsys.readouterr().err
    assert "init_layer=last" in err and "intermediate=32; allowed:" in err
    assert main([*fresh, "--init-layer", "first", "--threads", "1"]) == 2
    assert "init_layer='first'; allowed: none, last" in capsys.readouterr().err
    state = json.loads((out / "work" / "state.json").read_text())  # a stopped run resumed with other taps
    (out / "work" / "state.json").write_text(json.dumps(state | {"finished": False}))
    assert main([*flags[:-4], "--taps", "none", "--threads", "1"]) == 2
    assert "harvested with --taps 0" in capsys.readouterr().err
