"""Draft trees through the real engine (specdec.engine.trees): the draft model drafts a tree of its
top candidates, the target scores it in one forward with tree attention, the tree verifier keeps a
path, the target's KV for that path is compacted into place.

  - exact enumeration (V = 4): the engine's joint of the first 3 tokens equals the target's to
    1e-6 under every sampling transform, for several shapes; the same test catches two bugs a tree
    invites (a sibling's candidate accepted against the parent's p, i.e. no residual; and every
    node's RoPE position equal to its slot, i.e. no tree positions);
  - greedy speculative output equals plain greedy, batched, with rows that take the chain path
    (penalties) beside tree rows, and accepted paths that went through later siblings;
  - a 48,000-sample chi-square test of the real loop with its negative control.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from test_exact_distribution import SETTINGS as CHAIN_SETTINGS
from engines import later_siblings, make_engine
from specdec import tree as tree_mod
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import trees
from specdec.errors import SpecdecError
from specdec.loader import Models, build_engine
from specdec.tools.distribution import (chi_square, engine_joint_exact, noncentrality, sample_engine,
                                        target_joint_exact)

PROMPT = [1, 2, 3]
# the chain tests' transforms ("all" adds nothing here: with its penalties a row takes the chain)
SETTINGS = {k: v for k, v in CHAIN_SETTINGS.items() if k != "all"}


@pytest.fixture(scope="module")
def models():
    kw = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    return tiny_model(seed=11, scale=0.5, **kw), tiny_model(seed=12, scale=0.5, **kw)


def tree_engine(target, draft, widths, k=None, max_batch=1, max_seq_len=64, draft_sampling="probabilistic"):
    models = Models(target, None, draft, target.args.vocab_size, "target", "draft")
    spec = SpeculativeConfig(draft="draft", num_draft_tokens=k or len(widths), draft_tree=widths,
                             draft_sampling=draft_sampling)
    return build_engine(models, spec, max_model_len=max_seq_len, max_batch=max_batch)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# Sampled candidates (draft_sampling "probabilistic": drawn from q without replacement) and
# deterministic ones ("greedy": the draft's top tokens): every transform on the smallest tree; the
# larger ones (whose enumeration takes up to a minute each) under a few, between them every
# transform again.
CASES = ([((2,), s, "probabilistic") for s in SETTINGS] + [((2,), s, "greedy") for s in SETTINGS if s != "penalties"]
         + [((1, 3), "minp0.3", "probabilistic"), ((2, 1), "plain", "probabilistic"),
            ((3, 2), "topp0.7", "greedy"), ((3, 2), "penalties", "probabilistic"),
            ((2, 2, 1), "temp0.6_topk2", "greedy"), ((1, 3), "plain", "greedy")])


@pytest.mark.parametrize("widths, setting, draft_sampling", CASES)
def test_tree_joint_equals_target_joint(models, setting, widths, draft_sampling):
    target, draft = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = tree_engine(target, draft, widths, draft_sampling=draft_sampling)
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
    for widths, kind in (((3,), "greedy"), ((2,), "probabilistic")):  # both candidate kinds
        got = engine_joint_exact(tree_engine(target, draft, widths, draft_sampling=kind), PROMPT, params)
        assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3, (widths, kind)
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
    got = engine_joint_exact(tree_engine(target, draft, (3,), draft_sampling="greedy"), PROMPT, params)
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
    with later_siblings() as later:
        got = engine.generate(prompts, params)
    assert [r.output for r in got] == want
    assert sum(r.stats.draft_tokens for r in got) > 0 and sum(r.stats.accepted_tokens for r in got) > 0
    assert later, "no accepted path went through a later sibling"


def test_draft_tree_flag_is_checked():
    with pytest.raises(SpecdecError, match="draft_tree"):
        SpeculativeConfig(draft="x", draft_tree="3,0")
    with pytest.raises(SpecdecError, match="nodes"):
        SpeculativeConfig(draft="x", draft_tree="4,4,4")
    with pytest.raises(SpecdecError, match="n-gram tree grows from the earlier matches"):
        SpeculativeConfig(proposer="ngram", draft_tree="2,2")
    with pytest.raises(SpecdecError, match="composite tree is the union"):
        SpeculativeConfig(proposer="composite", draft="x", draft_tree="2,2")
    assert SpeculativeConfig(draft="x", draft_tree="off").draft_tree is None
    assert SpeculativeConfig(draft="x", draft_tree="3, 2").draft_tree == (3, 2)


# 48,000 samples: the control's noncentrality is then ~20,000, far past the 400 asserted (it was
# 200,000, which cost minutes and bought no power the control needs)
N_SAMPLES, BATCH = 48_000, 4000
STAT = SamplingParams(temperature=1.0, max_tokens=3)


@pytest.mark.parametrize("control", [None, "no_residual"])
def test_tree_samples_match_target(models, control, monkeypatch):
    """48,000 samples of the first 3 tokens from the real batched loop with a (2, 1) tree of
    children drawn without replacement; Pearson
    chi-square against the target's exact joint: pass at p > 1e-3. The control's exact joint gives
    its noncentrality; >= 400 with ~60 degrees of freedom is rejected at p < 1e-6 with probability
    > 1 - 1e-9 (tests/test_statistical.py), and the sampled control must be."""
    target, draft = models
    want = target_joint_exact(target, PROMPT, STAT)
    if control:
        monkeypatch.setattr(tree_mod, "residual_distribution", lambda r, q, d: r)
        alt = engine_joint_exact(tree_engine(target, draft, (2, 1)), PROMPT, STAT)
        assert noncentrality(N_SAMPLES, alt, want) >= 400
    engine = tree_engine(target, draft, (2, 1), max_batch=BATCH)
    counts = sample_engine(engine, PROMPT, STAT, N_SAMPLES, BATCH, seed=5)
    _, _, p = chi_square(counts, want)
    assert engine.proposer.forwards > 0
    assert (p < 1e-6) if control else (p > 1e-3)


def test_greedy_tree_equals_plain_on_smollm2():
    """SmolLM2-135M at its native quantisation, drafted by itself requantised to Q4_0 (so drafts
    are sometimes wrong and later siblings get their turn): greedy tree speculation equals plain
    greedy token for token, batched and alone, chat and code prompts; dynamic trees too."""
    from specdec.loader import load_models

    torch.set_num_threads(2)
    models = load_models("smollm2-135m", "smollm2-135m", "native", "q4_0")
    tok = models.tokenizer
    prompts = [tok.encode_prompt(p) for p in ("Why is the sky blue?", "def fibonacci(n):",
                                              "Write a haiku about rivers.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = build_engine(models, None, 512, max_batch=3)
    want = [r.output for r in plain.generate(prompts, params)]
    spec = SpeculativeConfig(draft="smollm2-135m", draft_dtype="q4_0", num_draft_tokens=3, draft_tree=(2, 2, 1))
    engine = build_engine(models, spec, 512, max_batch=3)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [r.output for r in batched] == want and [r.output for r in alone] == want
    assert sum(r.stats.accepted_tokens for r in batched) > 0
    assert sum(r.stats.draft_tokens - r.stats.accepted_tokens for r in batched) > 0  # some rejected
    spec = SpeculativeConfig(draft="smollm2-135m", proposer="draft", draft_dtype="q4_0", num_draft_tokens=4,
                             draft_tree="dynamic:8")
    dynamic = build_engine(models, spec, 512, max_batch=3).generate(prompts, params)
    assert [r.output for r in dynamic] == want and sum(r.stats.accepted_tokens for r in dynamic) > 0


def test_seed_stable_tree_text_equals_plain_for_50_seeds():
    """Seed-stable sampling at T = 0.8 (the default with a seed): for 50 seeds, the text with tree
    speculation (two shapes) and with a chain is the text of plain decoding with the same seed,
    batched; the trees drafted, and accepted paths went through later siblings."""
    kw = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=128)
    target, draft = tiny_model(seed=31, scale=0.5, **kw), tiny_model(seed=32, scale=0.5, **kw)
    prompt = [3, 1, 4, 1, 5]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=24) for s in range(50)]
    assert all(p.stable for p in params)
    want = [r.output for r in make_engine(target, None, 0, max_batch=50, max_seq_len=128)
            .generate([prompt] * 50, params)]
    with later_siblings() as later:
        for widths in ((3, 2), (2, 2, 1)):
            got = tree_engine(target, draft, widths, max_batch=50, max_seq_len=128).generate([prompt] * 50, params)
            assert [r.output for r in got] == want, widths
            assert sum(r.stats.accepted_tokens for r in got) > 0
    assert later
    chain = make_engine(target, draft, 3, max_batch=50, max_seq_len=128).generate([prompt] * 50, params)
    assert [r.output for r in chain] == want
