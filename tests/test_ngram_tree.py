"""N-gram tries (`proposer="ngram", draft_tree="dynamic[:N]"`): what followed several earlier
matches of the context's suffix, merged into one tree of deterministic candidates.

  - the trie: its first path is the chain the n-gram proposer drafts; every earlier occurrence is
    found (newest first), shared prefixes are one node, the node budget and depth hold, and an
    index grown token by token answers as one built at once;
  - exact enumeration (V = 4, a prompt whose suffix was followed by three different tokens): the
    engine's joint of the first 3 tokens equals the target's to 1e-6 under the sampling
    transforms, for budgets that make chains and trees; the same test catches a verifier that
    forgets the earlier siblings' rejection;
  - greedy output equals plain greedy, batched, with a penalty row on the chain path, accepted
    paths through later siblings (tiny models, and SmolLM2 on a prompt that repeats itself);
    seed-stable text equals plain for 50 seeds;
  - 48,000 samples from the real batched loop pass a chi-square test, and its control fails.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from engines import TREE_SETTINGS as SETTINGS, later_siblings, make_engine, repeating_batch
from engines import tree_paths as paths
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.loader import Models, build_engine, load_models
from specdec.proposers.ngram import NgramIndex
from specdec.metrics import SpecStats
from specdec.tools.distribution import (chi_square, engine_joint_exact, noncentrality, sample_engine,
                                         target_joint_exact)

# suffix [1, 2] was followed by 3 (at 2) and 0 (at 5); suffix [2] also by 1 (at 7)
PROMPT = [1, 2, 3, 1, 2, 0, 2, 1, 2]


def trie(tokens, k, n_nodes, n_min=1, n_max=4):
    idx = NgramIndex(n_min, n_max)
    idx.extend(tokens)
    parents, toks = idx.tree(tokens, k, n_nodes)
    return parents.tolist(), toks.tolist()


def test_trie_cases():
    idx = NgramIndex(1, 4)
    idx.extend(PROMPT)
    assert list(idx.occurrences(PROMPT, 2)) == [5, 2]  # newest first
    assert list(idx.occurrences(PROMPT, 1)) == [7, 5, 2]
    assert list(idx.occurrences(PROMPT, 3)) == []
    # the chain first (newest match of the longest suffix: 0, 2, 1), then 3, 1, 2, then (suffix [2]) 1, 2
    parents, toks = trie(PROMPT, 3, 32)
    assert sorted(paths(parents, toks)) == sorted([[0], [0, 2], [0, 2, 1], [3], [3, 1], [3, 1, 2], [1], [1, 2]])
    assert trie(PROMPT, 3, 3) == ([-1, 0, 1], [0, 2, 1])  # = the chain lookup drafts
    assert idx.lookup(PROMPT, 3) == [0, 2, 1]
    assert trie(PROMPT, 3, 4) == ([-1, -1, 0, 2], [0, 3, 2, 1])  # the chain, then 3; breadth-first
    assert trie(PROMPT, 1, 32) == ([-1, -1, -1], [0, 3, 1])  # depth <= k
    # continuations sharing a prefix share its nodes: after [5] came 6, 7 and 6, 8
    assert trie([5, 6, 7, 5, 6, 8, 5], 2, 32) == ([-1, 0, 0], [6, 8, 7])
    assert trie([1, 2, 3, 4], 3, 8) == ([], [])  # no earlier match: nothing
    assert trie(PROMPT, 3, 32, n_min=2) == ([-1, -1, 0, 1, 2, 3], [0, 3, 2, 1, 1, 2])  # no [2] matches
    for n in range(1, 9):  # every budget: a tree, parents first, within the budget
        parents, toks = trie(PROMPT, 3, n)
        assert len(toks) == min(n, 8) and all(-1 <= p < j for j, p in enumerate(parents))


def test_incremental_index_answers_as_a_rebuilt_one():
    seq = [5, 1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2, 4, 4, 1, 2]
    inc = NgramIndex(1, 3)
    for L in range(1, len(seq) + 1):
        inc.extend(seq[:L])
        whole = NgramIndex(1, 3)
        whole.extend(seq[:L])
        for n_nodes in (1, 4, 16):
            got, want = inc.tree(seq[:L], 4, n_nodes), whole.tree(seq[:L], 4, n_nodes)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model(seed=11, scale=0.5, vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)


def ngram_engine(target, tree, k=3, max_batch=1, max_seq_len=64):
    models = Models(target, None, None, target.args.vocab_size, "target", None)
    spec = SpeculativeConfig(proposer="ngram", num_draft_tokens=k, draft_tree=tree)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


CASES = [("dynamic:4", s) for s in SETTINGS] + [("dynamic:8", "plain"), ("dynamic:1", "topp0.7"),
                                                 ("dynamic", "minp0.3")]


@pytest.mark.parametrize("tree, setting", CASES)
def test_ngram_trie_joint_equals_target_joint(target, tree, setting):
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = ngram_engine(target, tree)
    drafted = []
    real = engine.proposer.propose_dynamic

    def spy(reqs, ks, n):
        prop = real(reqs, ks, n)
        drafted.append(int(prop.num_draft.max()))
        return prop
    engine.proposer.propose_dynamic = spy
    got = engine_joint_exact(engine, PROMPT, params)
    want = target_joint_exact(target, PROMPT, params)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert max(abs(got.get(x, 0.0) - p) for x, p in want.items()) < 1e-6
    assert set(got) <= set(want) | {x for x in got if got[x] < 1e-12}
    assert max(drafted) >= (1 if tree == "dynamic:1" else 3)  # tries (or chains) were drafted


def test_exact_test_catches_a_missing_residual_on_ngram_tries(target, monkeypatch):
    """Control: a later sibling accepted against the parent's p (the earlier siblings' rejection
    forgotten): the joint is off and the same test says so."""
    monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    got = engine_joint_exact(ngram_engine(target, "dynamic:8"), PROMPT, params)
    want = target_joint_exact(target, PROMPT, params)
    assert max(abs(got.get(x, 0.0) - want.get(x, 0.0)) for x in set(got) | set(want)) > 1e-3


def test_greedy_ngram_trie_equals_plain_batched():
    """Greedy rows decode to plain greedy's tokens with tries of several budgets and k; a penalty
    row (chain path) rides in the same batch; accepted paths went through later siblings."""
    target = tiny_model(seed=21, scale=0.6, vocab=8, dim=32, layers=2, heads=4, kv_heads=2, inter=48,
                        max_seq_len=160)
    prompts, params = repeating_batch()
    want = [r.output for r in make_engine(target, None, 0, max_batch=4, max_seq_len=160).generate(prompts, params)]
    with later_siblings() as later:
        for tree, k in (("dynamic", 3), ("dynamic:12", 5), ("dynamic:6", "auto")):
            got = ngram_engine(target, tree, k=k, max_batch=4, max_seq_len=160).generate(prompts, params)
            assert [r.output for r in got] == want, tree
            assert sum(r.stats.draft_tokens for r in got) > 0
            if k != "auto":  # (adaptive k prices a trie at its width and may stop drafting early here)
                assert sum(r.stats.accepted_tokens for r in got) > 0
    assert later, "no accepted path went through a later sibling"


def test_seed_stable_ngram_trie_text_equals_plain_for_50_seeds():
    target = tiny_model(seed=31, scale=0.5, vocab=8, dim=32, layers=2, heads=4, kv_heads=2, inter=48,
                        max_seq_len=128)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 6, 3, 1]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24) for s in range(50)]
    want = [r.output for r in make_engine(target, None, 0, max_batch=50, max_seq_len=128)
            .generate([prompt] * 50, params)]
    got = ngram_engine(target, "dynamic:6", k=3, max_batch=50, max_seq_len=128).generate([prompt] * 50, params)
    assert [r.output for r in got] == want
    assert sum(r.stats.accepted_tokens for r in got) > 0


def test_greedy_ngram_trie_equals_plain_on_smollm2():
    """The real model (its own quantisation) on prompts that repeat themselves with variations: trie
    output equals plain greedy token for token, alone and batched, and some accepted path went
    through a later sibling."""
    llm = load_models("smollm2-135m", dtype="native")
    tok = llm.tokenizer
    text = ("def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
            "def volume(w, h, d):\n    return w * h * d\n\ndef surface(w, h, d):\n    return")
    prompts = [tok.encode_prompt(text, raw=True),
               tok.encode_prompt("List the colours red, green, blue, then red, green, blue again, three times.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = build_engine(llm, None, max_model_len=512, max_batch=2)
    want = [r.output for r in plain.generate(prompts, [params] * 2)]
    spec = SpeculativeConfig(proposer="ngram", num_draft_tokens=4, draft_tree="dynamic:8")
    with later_siblings() as later:
        batched = build_engine(llm, spec, max_model_len=512, max_batch=2).generate(prompts, [params] * 2)
        alone = [build_engine(llm, spec, max_model_len=512).generate([p], params)[0] for p in prompts]
    assert [r.output for r in batched] == want and [r.output for r in alone] == want
    assert sum(r.stats.accepted_tokens for r in batched) > 0
    assert later, "no accepted path went through a later sibling"


# 48,000 samples: the control's noncentrality is then ~7,200, far past the 400 asserted (it was
# 200,000, which cost minutes and bought no power the control needs)
N_SAMPLES, BATCH = 48_000, 4000
STAT = SamplingParams(temperature=1.0, max_tokens=3)


@pytest.mark.parametrize("control", [None, "no_residual"])
def test_ngram_trie_samples_match_target(target, control, monkeypatch):
    """48,000 samples of the first 3 tokens from the real batched loop with 8-node tries; Pearson
    chi-square against the target's exact joint: pass at p > 1e-3. The control (later siblings
    against the parent's p) must be rejected at p < 1e-6; its exact joint's noncentrality >= 400
    with ~60 degrees of freedom makes that happen with probability > 1 - 1e-9
    (tests/test_statistical.py)."""
    want = target_joint_exact(target, PROMPT, STAT)
    if control:
        monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
        alt = engine_joint_exact(ngram_engine(target, "dynamic:8"), PROMPT, STAT)
        assert noncentrality(N_SAMPLES, alt, want) >= 400
    engine = ngram_engine(target, "dynamic:8", max_batch=BATCH)
    stats = SpecStats()
    counts = sample_engine(engine, PROMPT, STAT, N_SAMPLES, BATCH, seed=7, stats=stats)
    _, _, p = chi_square(counts, want)
    assert stats.draft_tokens > N_SAMPLES  # tries were drafted
    assert (p < 1e-6) if control else (p > 1e-3)
