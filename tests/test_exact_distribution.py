"""Exact distribution test: the engine's speculative output distribution IS the target's.

Tiny random target and draft (V = 4 so every path can be enumerated). `engine_joint_exact`
enumerates every branch of the engine's own randomness (draft samples, accept/reject coins,
recovered/bonus samples) with its probability, through the engine's own propose/verify/commit
code, and sums the exact probability of each first-3-token sequence. That must equal the
target's exact joint prod p(x_i | x_<i) to 1e-6 (fp32 softmax rounding is ~1e-7 per factor).
"""

from __future__ import annotations

import pytest

from conftest import tiny_model
from engines import make_engine
from specdec.tools.distribution import engine_joint_exact, target_joint_exact
from specdec import rejection
from specdec.config import SamplingParams

PROMPT = [1, 2, 3]

SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp0.6_topk2": dict(temperature=0.6, top_k=2),
    "topp0.7": dict(temperature=1.2, top_p=0.7),
    "minp0.3": dict(temperature=0.9, min_p=0.3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3),
    "all": dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.2),
}


@pytest.fixture(scope="module")
def models():
    kw = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    return tiny_model(seed=11, scale=0.5, **kw), tiny_model(seed=12, scale=0.5, **kw)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k, draft_sampling", [(1, "probabilistic"), (2, "probabilistic"),
                                               (3, "probabilistic"), (2, "greedy")])
def test_engine_joint_equals_target_joint(models, setting, k, draft_sampling):
    target, draft = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = make_engine(target, draft, k, draft_sampling)
    got = engine_joint_exact(engine, PROMPT, params)
    want = target_joint_exact(target, PROMPT, params)
    assert abs(sum(got.values()) - 1.0) < 1e-9
    assert _max_diff(got, want) < 1e-6


@pytest.mark.parametrize("setting", ["plain", "temp0.6_topk2", "penalties", "all"])
def test_ngram_one_hot_q_joint_equals_target(models, setting):
    """N-gram drafts (one-hot q) from a repetitive prompt: still exactly the target's joint."""
    from specdec.proposers import NgramProposer

    target, _ = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = make_engine(target, None, 3)
    engine.proposer, engine.k = NgramProposer(1, 3), 3
    prompt = [1, 2, 3, 1, 2]
    got = engine_joint_exact(engine, prompt, params)
    assert _max_diff(got, target_joint_exact(target, prompt, params)) < 1e-6


@pytest.mark.parametrize("setting", ["plain", "all"])
def test_composite_joint_equals_target(models, setting):
    """n-gram first (one-hot q), draft model otherwise (full q), from round to round."""
    from specdec.proposers import DraftModelProposer, NgramProposer
    from specdec.proposers.composite import CompositeProposer

    target, draft = models
    params = SamplingParams(max_tokens=16, **SETTINGS[setting])
    engine = make_engine(target, None, 2)
    engine.proposer = CompositeProposer([NgramProposer(2, 3), DraftModelProposer(draft, 4, 64)])
    engine.k = 2
    prompt = [1, 2, 3, 1, 2]
    got = engine_joint_exact(engine, prompt, params)
    assert _max_diff(got, target_joint_exact(target, prompt, params)) < 1e-6


def test_exact_test_catches_redraw_from_p(models, monkeypatch):
    """Negative control: the same comparison sees the classic bug (redraw from p on reject)."""
    target, draft = models
    params = SamplingParams(max_tokens=16, temperature=1.0)
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q, d: p)
    got = engine_joint_exact(make_engine(target, draft, 2), PROMPT, params)
    assert _max_diff(got, target_joint_exact(target, PROMPT, params)) > 1e-3
