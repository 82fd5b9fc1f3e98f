"""Structured output with speculative decoding: exact, with the grammar applied to p and q at every
candidate prefix (issue 22, docs/pitfalls.md 5 and 16).

Exact enumeration on tiny models (V = 4: tokens "a", "b", "c" and EOS) under the regex
(ab|ba|cc)+, whose allowed set at each position depends on the history (after "a" only "b", after
"c" only "c"; EOS only after a complete pair): the joint of the first 3 tokens the engine emits,
every branch of its dice enumerated through its own propose / verify / commit code, equals the
target's constrained joint (p masked by the grammar at each prefix, renormalised) to 1e-6, for
k in {1, 2, 3}, full and one-hot q, and the n-gram proposer. Negative controls the same test must
reject: verification that ignores the grammar (only the draft obeys it); the mask on p for the
acceptance test only, with q and the residual unmasked; a matcher that is not rolled back after
the drafts are walked; drafts cut at the first refused one while q is unmasked.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from specdec import grammar as G
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.tools.distribution import engine_joint_exact, target_joint_exact

V = 4
TOKENS = [b"a", b"b", b"c", b"<eos>"]
EOS = 3
REGEX = "(ab|ba|cc)+"
PROMPT = [0, 1, 2]
SETTINGS = {
    "plain": SamplingParams(temperature=1.0, max_tokens=3, regex=REGEX),
    "top_k": SamplingParams(temperature=0.8, top_k=2, max_tokens=3, regex=REGEX),
    "penalties": SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.3,
                                max_tokens=3, regex=REGEX),
}


@pytest.fixture(scope="module")
def lltok():
    return G.tiny_tokenizer(TOKENS, EOS)


@pytest.fixture(scope="module")
def models():
    kw = dict(vocab=V, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=32)
    return tiny_model(seed=21, scale=0.6, **kw), tiny_model(seed=22, scale=1.2, **kw)


def _mask_fn(lltok):
    """The grammar's allowed tokens after the prompt's output prefix, from a fresh state."""
    compiled = G.compile_grammar(regex=REGEX)

    def fn(prefix):
        st = G.GrammarState(lltok, compiled, V, "cpu")
        for t in prefix:
            st.commit(t)
        return st.inputs(torch.zeros(0, dtype=torch.long)).mask[0]
    return fn


def _engine(target, proposer, k, lltok):
    return Engine(target, None, proposer, num_draft_tokens=k, max_seq_len=32, vocab_size=V,
                  grammar_tokenizer=lltok)


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


def _valid(seq) -> bool:
    """Is this output a prefix the grammar allows (checked on the text, not with llguidance)?"""
    s = "".join("abc"[t] if t < 3 else "$" for t in seq)
    import re

    body = s.split("$")[0]
    return bool(re.fullmatch(r"((ab|ba|cc)*)(a|b|c)?", body)) and ("$" not in s or re.fullmatch(REGEX, body))


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("draft_sampling", ["probabilistic", "greedy"])
def test_draft_model_joint_equals_constrained_target(models, lltok, setting, k, draft_sampling):
    target, draft = models
    params = SETTINGS[setting]
    want = target_joint_exact(target, PROMPT, params, mask_fn=_mask_fn(lltok))
    assert all(_valid(x) for x in want)
    assert sum(want.values()) == pytest.approx(1.0, abs=1e-6)  # (fp32 softmax)
    engine = _engine(target, DraftModelProposer(draft, V, 32, draft_sampling=draft_sampling), k, lltok)
    got = engine_joint_exact(engine, PROMPT, params)
    assert _max_diff(got, want) < 1e-6


def test_ngram_joint_equals_constrained_target(models, lltok):
    """Deterministic drafts that the grammar may reject (the n-gram copies the prompt's "c b"):
    a rejected draft ends the round's drafts, and the joint is still exact."""
    target, _ = models
    params = SETTINGS["plain"]
    prompt = [2, 2, 0, 1, 2, 2, 0]
    want = target_joint_exact(target, prompt, params, mask_fn=_mask_fn(lltok))
    engine = _engine(target, NgramProposer(1, 3), 3, lltok)
    got = engine_joint_exact(engine, prompt, params)
    assert _max_diff(got, want) < 1e-6


@pytest.mark.parametrize("cut", [False, True])
def test_unmasked_q_is_exact_but_wasteful(models, lltok, monkeypatch, cut):
    """A draft whose q ignores the grammar is still exact (verification needs only the q the
    drafts came from): the grammar on p is what keeps the output in the language. Control (cut):
    ending such drafts at the first one the grammar rejects, as the engine does for one-hot
    drafts, is NOT exact for a sampled q (the residual [p - q]+ would be replaced by p), and the
    exact test sees it."""
    from specdec.proposers import draft_model

    _strip_mask(monkeypatch, draft_model)
    if cut:
        original_propose = Engine._propose

        def propose_and_cut(self, reqs, choices):
            prop, t = original_propose(self, reqs, choices)
            for b, r in enumerate(reqs):
                n = int(prop.num_draft[b])
                if n:
                    prop.num_draft[b] = r.grammar.accepted_prefix(prop.tokens[b, :n].tolist())
            return prop, t
        monkeypatch.setattr(Engine, "_propose", propose_and_cut)
    target, draft = models
    params = SETTINGS["plain"]
    want = target_joint_exact(target, PROMPT, params, mask_fn=_mask_fn(lltok))
    got = engine_joint_exact(_engine(target, DraftModelProposer(draft, V, 32), 2, lltok), PROMPT, params)
    assert (_max_diff(got, want) > 1e-3) if cut else (_max_diff(got, want) < 1e-6)


def _strip_mask(monkeypatch, module, keep=None):
    """Patch `module.stacked_inputs` to drop the grammar's mask (keep: a dict that receives it)."""
    from specdec.logits_state import LogitsInputs

    original = module.stacked_inputs

    def stripped(*a, **kw):
        inp = original(*a, **kw)
        if keep is not None:
            keep["mask"] = inp.mask
        return LogitsInputs(**{**inp.__dict__, "mask": None})
    monkeypatch.setattr(module, "stacked_inputs", stripped)


def _assert_leaks(models, lltok):
    """The control's joint (draft model, k = 2) differs from the constrained target's and puts
    mass on outputs outside the language."""
    target, draft = models
    params = SETTINGS["plain"]
    want = target_joint_exact(target, PROMPT, params, mask_fn=_mask_fn(lltok))
    got = engine_joint_exact(_engine(target, DraftModelProposer(draft, V, 32), 2, lltok), PROMPT, params)
    assert _max_diff(got, want) > 1e-2
    assert any(not _valid(x) for x, w in got.items() if w > 0)


def test_control_verification_ignores_the_grammar(models, lltok, monkeypatch):
    """Negative control: the grammar steers the draft but verification (p) ignores it. The joint
    puts mass on outputs outside the language, and the exact test sees it."""
    _control_verification_ignores_grammar(monkeypatch)  # (a lenient commit: else the matcher refuses)
    _assert_leaks(models, lltok)


def test_control_mask_on_acceptance_only(models, lltok, monkeypatch):
    """Negative control, the issue's: the mask on p for the acceptance test only, while q stays
    unmasked and the residual (and the bonus) are computed from the unmasked p. Tokens outside
    the language leak through the residual, and the exact test sees it."""
    _control_mask_on_acceptance_only(monkeypatch)
    _assert_leaks(models, lltok)


def _lenient_commit(self, token):
    self._masks.clear()
    self.matcher.try_consume_tokens([token])


def test_control_matcher_not_rolled_back(models, lltok, monkeypatch):
    """Negative control: the drafts walked for the masks stay consumed (no rollback). The
    matcher runs ahead of the committed tokens; the engine's next commit is refused by the
    matcher (an assertion, not a silent wrong distribution) or the joint is wrong."""
    _control_matcher_not_rolled_back(monkeypatch)
    target, draft = models
    params = SETTINGS["plain"]
    want = target_joint_exact(target, PROMPT, params, mask_fn=_mask_fn(lltok))
    try:
        got = engine_joint_exact(_engine(target, DraftModelProposer(draft, V, 32), 2, lltok), PROMPT, params)
    except AssertionError:
        return
    assert _max_diff(got, want) > 1e-2


def test_grammar_that_completes_finishes_with_stop(models, lltok):
    """A grammar that can only end (regex "ab"): after it, EOS is the only token and the request
    finishes with "stop" even though max_tokens allows more."""
    target, draft = models
    engine = _engine(target, DraftModelProposer(draft, V, 32), 3, lltok)
    for seed in range(5):
        r = engine.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=10, regex="ab", seed=seed))[0]
        assert r.output[:2] == [0, 1] and r.finish_reason == "stop", (r.output, r.finish_reason)


N, BATCH = 200_000, 4000


def _control_verification_ignores_grammar(monkeypatch):
    from specdec.engine import core

    _strip_mask(monkeypatch, core)
    monkeypatch.setattr(G.GrammarState, "commit", _lenient_commit)


def _control_mask_on_acceptance_only(monkeypatch):
    from specdec import rejection
    from specdec.engine import core
    from specdec.proposers import draft_model

    saved = {}
    _strip_mask(monkeypatch, core, keep=saved)
    _strip_mask(monkeypatch, draft_model)
    original_acceptance = rejection.acceptance_probs

    def acceptance_with_mask(p, q, draft):
        m = saved["mask"].view(p.shape[0], -1, p.shape[-1])[:, : p.shape[1]]
        return original_acceptance(p * m, q, draft)
    monkeypatch.setattr(rejection, "acceptance_probs", acceptance_with_mask)
    monkeypatch.setattr(G.GrammarState, "commit", _lenient_commit)


def _control_matcher_not_rolled_back(monkeypatch):
    original = G.GrammarState.inputs

    def no_rollback(self, drafts, last_only=False):
        out = original(self, drafts, last_only)
        if len(drafts):
            self.matcher.try_consume_tokens(drafts.tolist())
            self._masks.clear()
        return out
    monkeypatch.setattr(G.GrammarState, "inputs", no_rollback)


CONTROLS = {"verification_ignores_grammar": _control_verification_ignores_grammar,
            "mask_on_acceptance_only": _control_mask_on_acceptance_only,
            "matcher_not_rolled_back": _control_matcher_not_rolled_back}


@pytest.mark.parametrize("control", [pytest.param(None, marks=pytest.mark.slow), *CONTROLS])
def test_statistical_with_grammar(models, lltok, control, monkeypatch):
    """The real loop (batched rows, caches, rollback, the matcher walked and rolled back every
    round), draft model at k = 3, T = 1 under the grammar: 200,000 samples of the first 3
    tokens against the exact constrained joint, chi-square pass at p > 1e-3. Controls, the same
    three as the enumeration's above (the grammar ignored at verification; the mask on p for the
    acceptance test only; the matcher not rolled back): where the control's loop runs, its exact
    joint (enumerated) gives the noncentrality lambda of the test at the control's N, asserted
    >= 400 (rejection at p < 1e-6 with probability > 1 - 1e-9, tests/test_statistical.py), and
    sampling then rejects it at p < 1e-6; a matcher that was not rolled back is instead refused
    by the engine's own check (an AssertionError when it commits a token the matcher, run ahead,
    no longer accepts), in the enumeration and in the sampled loop alike. The passing run takes
    minutes (a matcher per row): `make test-slow`; the exact enumeration above checks the same
    algebra in `make test`."""
    from specdec.tools.distribution import chi_square, noncentrality, sample_engine

    target, draft = models
    params = SETTINGS["plain"]
    want = target_joint_exact(target, PROMPT, params, mask_fn=_mask_fn(lltok))
    n = N

    def engine(max_batch):
        return Engine(target, None, DraftModelProposer(draft, V, 32), num_draft_tokens=3, max_batch=max_batch,
                      max_seq_len=32, vocab_size=V, grammar_tokenizer=lltok)
    if control:
        CONTROLS[control](monkeypatch)
        n = 20_000
        try:
            alt = engine_joint_exact(engine(8), PROMPT, params)
        except AssertionError:
            assert control == "matcher_not_rolled_back"
            with pytest.raises(AssertionError):
                sample_engine(engine(BATCH), PROMPT, params, n, BATCH, seed=11)
            return
        lam = noncentrality(n, alt, want)
        assert lam >= 400, lam
    counts = sample_engine(engine(BATCH), PROMPT, params, n, BATCH, seed=11)
    stat, dof, p = chi_square(counts, {k: v for k, v in want.items() if v > 0})
    assert (p < 1e-6) if control else (p > 1e-3), (stat, dof, p)
