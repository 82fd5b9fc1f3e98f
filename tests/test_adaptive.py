"""Adaptive k: the choice rule on literal inputs, greedy equivalence in every proposer mode, and
that k really moves with the acceptance it observes.

Losslessness at T > 0 with adaptive k is in tests/test_statistical.py (same chi-square test and
redraw-from-p control as for fixed k).
"""

from __future__ import annotations

import pytest

from conftest import tiny_model
from specdec.engine.adaptive import AdaptiveK, CostCurve, FixedK, expected_tokens, k_policy
from specdec.config import SamplingParams, SpeculativeConfig
from specdec.engine import Engine
from specdec.engine.trees import verify_width
from specdec.loader import Models, build_engine
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec.proposers.composite import CompositeProposer
from specdec.round import Candidate, Choice, RowResult


def test_expected_tokens_equals_enumeration():
    """E[committed] = sum over n (accepted drafts) of (n + 1) P(n): a round stops at the first
    rejection, P(n) = alpha_1 .. alpha_n (1 - alpha_{n+1}), and P(k) = alpha_1 .. alpha_k."""
    alphas = [0.9, 0.5, 0.7, 0.2]
    for k in range(5):
        total = 0.0
        for n in range(k + 1):
            p = 1.0
            for i in range(n):
                p *= alphas[i]
            if n < k:
                p *= 1 - alphas[n]
            total += p * (n + 1)
        assert expected_tokens(alphas, k) == pytest.approx(total)
    assert expected_tokens([1.0] * 4, 4) == 5 and expected_tokens([0.0] * 4, 4) == 1


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve(prior_slope=0.1)
    assert c.estimate(3) is None
    c.observe(1, 10.0)
    assert c.estimate(1) == 10.0
    assert c.estimate(3) == pytest.approx(10.0 + 0.1 * 10.0 * 2)  # one point: the prior slope
    c.observe(5, 14.0)
    assert c.estimate(3) == pytest.approx(12.0)  # between two measured widths: linear
    assert c.estimate(7) == pytest.approx(16.0)  # past them: the slope of the last two
    c.observe(5, 1000.0)  # a stall is clipped to 3x the current value before averaging
    assert c.estimate(5) == pytest.approx(0.75 * 14.0 + 0.25 * 42.0)


class _Req:
    def __init__(self, i):
        self.id = i


def _row(req, accepted: int = 0) -> RowResult:
    """A row's round result as the engine hands it to `accept` (only `accepted` is read here)."""
    return RowResult(request=req, k=0, drafted=0, accepted=accepted, committed=[0], source=None,
                     key=None, delta="")


def _flat_cost(draft_per_token):
    return lambda batch, k: 1.0 + draft_per_token * k  # target forward = 1, draft c per token


def test_choice_follows_acceptance():
    """Everything accepted -> k_max; everything rejected -> 0 (plain decoding pays more);
    with a free draft even poor acceptance is worth a draft or two."""
    pol = AdaptiveK(8, cost=_flat_cost(0.3))
    good, bad = _Req(1), _Req(2)
    pol.begin(good)
    pol.begin(bad)
    for _ in range(30):
        pol.observe_round(good, 8, 8)
        pol.observe_round(bad, 4, 0)
    assert pol.choose(good, 1, 8) == 8
    assert pol.choose(bad, 1, 8) == 0
    assert pol.choose(good, 1, 3) == 3  # the budget cuts it
    free = AdaptiveK(8, cost=lambda b, k: 1.0)
    r = _Req(3)
    free.begin(r)
    for _ in range(30):
        free.observe_round(r, 4, 0)
    assert free.choose(r, 1, 8) >= 1  # any alpha > 0 gains when drafting and verifying are free


def test_rejected_request_probes_again():
    """Counts decay every round, also rounds that drafted nothing (the request's own and the
    engine-wide pool that seeds it), so k = 0 is not absorbing."""
    pol = AdaptiveK(8, cost=_flat_cost(0.3))
    r = _Req(1)
    pol.begin(r)
    for _ in range(30):
        pol.observe_round(r, 4, 0)
    assert pol.choose(r, 1, 8) == 0
    rounds = 0
    while pol.choose(r, 1, 8) == 0:
        pol.observe_round(r, 0, 0)
        pol.observe_target(1, 1, 1.0)  # the engine reports every round's target forward
        rounds += 1
        assert rounds < 100
    assert rounds >= 5  # but not right away


def test_measured_costs_drive_the_choice():
    """Without a fixed cost model the curves come from observed seconds: an expensive draft
    (c = 2 per token) makes drafting lose even at alpha = 0.6; a cheap one makes it win."""
    for per_token, want_zero in [(2.0, True), (0.05, False)]:
        pol = AdaptiveK(6)
        r = _Req(1)
        pol.begin(r)
        for k in range(1, 7):
            pol.observe_target(1, k + 1, 1.0 + 0.02 * k)
            pol.observe_draft_cost(k, per_token * k)
        pol.observe_target(1, 1, 1.0)
        for _ in range(40):
            pol.observe_round(r, 5, 3)  # ~0.6-0.75 per position
        assert (pol.choose(r, 1, 6) == 0) == want_zero


def _measured_policy(draft_per_token: float) -> AdaptiveK:
    """AdaptiveK(8) with measured costs: target 1 + 0.02 k, n-gram ~free, draft c per token."""
    pol = AdaptiveK(8)
    for k in range(1, 9):
        pol.observe_target(1, k + 1, 1.0 + 0.02 * k)
        pol.observe_draft_cost(k, 0.0001 * k, "ngram")
        pol.observe_draft_cost(k, draft_per_token * k, "draft")
    pol.observe_target(1, 1, 1.0)
    return pol


def test_draft_cost_is_kept_per_proposer():
    """A composite's n-gram rounds cost nothing to draft, its draft-model rounds cost ~c per
    token: a request whose last round was drafted by the n-gram lookup gets a longer k than
    one whose last round came from the draft model, at the same acceptance."""
    pol = _measured_policy(draft_per_token=2.0)  # a draft model slower than the target
    via_ngram, via_draft = _Req(1), _Req(2)
    for r, src in ((via_ngram, "ngram"), (via_draft, "draft")):
        pol.begin(r)
        for _ in range(20):
            pol.observe_round(r, 8, 8, src)
    assert pol.choose(via_ngram, 1, 8) == 8 and pol.choose(via_draft, 1, 8) == 0


def test_choice_priced_by_the_proposer_that_will_draft():
    """Told which proposer drafts this round (Proposer.peek), the choice uses that proposer's own
    acceptance and cost: a request whose n-gram matches were always accepted and whose
    draft-model rounds were always rejected drafts long when the n-gram has a match and not at
    all when only the draft model would draft; and a match of 3 tokens caps k at 3."""
    pol = _measured_policy(draft_per_token=0.1)
    r = _Req(1)
    pol.begin(r)
    for _ in range(10):
        pol.observe_round(r, 8, 8, "ngram")
        pol.observe_round(r, 4, 0, "draft")
    assert pol.choose(r, 1, 8, "ngram", 8) == 8
    assert pol.choose(r, 1, 8, "ngram", 3) == 3
    assert pol.choose(r, 1, 8, "draft", 8) == 0
    assert pol.choose(r, 1, 8, "ngram", 0) == 0  # nothing to draft: plain round


def test_peek_lists_who_could_draft_and_composite_routes(smollm2):
    """peek: which parts could draft and how many tokens each has, from committed tokens only,
    without drafting; a composite told `only` drafts from the part named, not the first."""
    model, tok = smollm2
    ng = NgramProposer(1, 3)
    comp = CompositeProposer([NgramProposer(1, 3), DraftModelProposer(model, tok.vocab_size, 256)])
    eng = Engine(model, tok, comp, num_draft_tokens="auto", max_seq_len=256)
    eng.reserve(2)
    R = eng.add_request([5, 6, 7, 8, 5, 6], SamplingParams(temperature=1.0, max_tokens=8))
    ng.begin(R)  # suffix [5, 6] occurred before, followed by 7, 8, 5, 6
    assert ng.peek(R, 3) == [Candidate("ngram", 3, "ngram@2")] and ng.peek(R, 8) == [Candidate("ngram", 4, "ngram@2")]
    # the draft model has no KV yet: it would first feed all 6 prompt tokens
    assert comp.peek(R, 3) == [Candidate("ngram", 3, "ngram@2"), Candidate("draft", 3, "draft", 6)]
    assert ng.propose([R], [8]).tokens[0].tolist() == [7, 8, 5, 6]  # what peek counted
    assert comp.propose([R], [3]).source == ["ngram"]
    comp.accept(R, _row(R))
    routed = comp.propose([R], [3], only=["draft"])
    assert routed.source == ["draft"] and routed.q is not None and int(routed.num_draft[0]) == 3
    comp.accept(R, _row(R))
    assert comp.peek(R, 3)[-1] == Candidate("draft", 3, "draft", 0)  # caught up: nothing left to feed
    R2 = eng.add_request([1, 2, 3, 4], SamplingParams(temperature=1.0, max_tokens=8))
    ng.begin(R2)  # no earlier occurrence of any suffix
    assert ng.peek(R2, 4) == [] and comp.peek(R2, 4) == [Candidate("draft", 4, "draft", 4)]


def test_choose_among_picks_the_better_proposer():
    """A free n-gram match that is always rejected loses to a costly draft model that is always
    accepted, and the other way round; nothing to draft is a plain round."""
    pol = _measured_policy(draft_per_token=0.1)
    good_draft, good_ngram = _Req(1), _Req(2)
    for r, good, bad in ((good_draft, "draft", "ngram"), (good_ngram, "ngram", "draft")):
        pol.begin(r)
        for _ in range(10):
            pol.observe_round(r, 4, 4, good)
            pol.observe_round(r, 4, 0, bad)
    c = pol.choose_among(good_draft, 1, 8, [Candidate("ngram", 8), Candidate("draft", 8)])
    assert c.source == "draft" and c.k >= 4
    assert pol.choose_among(good_ngram, 1, 8, [Candidate("ngram", 5), Candidate("draft", 8)]) == Choice(5, "ngram", "ngram")
    assert pol.choose_among(good_ngram, 1, 8, []) == Choice(0)
    # acceptance kept per key: long n-gram matches good, 1-token matches bad
    r = _Req(3)
    pol.begin(r)
    for _ in range(10):
        pol.observe_round(r, 4, 4, "ngram", "ngram@3")
        pol.observe_round(r, 4, 0, "ngram", "ngram@1")
    assert pol.choose_among(r, 1, 8, [Candidate("ngram", 6, "ngram@3")]).k == 6
    assert pol.choose_among(r, 1, 8, [Candidate("ngram", 6, "ngram@1")]).k == 0


def test_a_proposers_own_prior_is_the_starting_point():
    """A proposer that measured its own acceptance (a head's held-out numbers) is priced from
    there, not from PRIOR_ALPHA: a head accepting 0.55, then 0.3 past the first draft, drafts
    k = 1 where the 0.6 prior would draft 2 (verify + draft cost 0.24 of a forward per token);
    what the request then observes moves it as before."""
    def cost(b, k):
        return 1.0 + 0.24 * k

    r = _Req(1)
    own, generic = AdaptiveK(8, cost=cost, priors={"head": (0.55, 0.3)}), AdaptiveK(8, cost=cost)
    for pol in (own, generic):
        pol.begin(r)
    assert own._alphas(r, "head", 3) == pytest.approx([0.55, 0.3, 0.3])
    assert generic._alphas(r, "head", 3) == pytest.approx([0.6, 0.6, 0.6])
    assert own.choose_among(r, 1, 8, [Candidate("head", 8)]).k == 1
    assert generic.choose_among(r, 1, 8, [Candidate("head", 8)]).k == 2
    assert own._alphas(r, "ngram", 2) == pytest.approx([0.6, 0.6])  # other proposers keep the default
    for _ in range(6):
        own.observe_round(r, 3, 3, "head")
    assert own.choose_among(r, 1, 8, [Candidate("head", 8)]).k >= 3


def test_first_draft_miss_does_not_condemn_the_continuation():
    """An n-gram copy either starts or not: once its first token is accepted, the rest follow.
    A request whose only round so far missed at position 1 keeps the continuation rate the
    engine has seen (positions 2..), so it still drafts long once it drafts at all; its first
    position alone pays for the miss.  (With every position shrunk toward the request's
    overall rate, the one miss pulled positions 2..8 down to it.)"""
    pol = AdaptiveK(8, cost=_flat_cost(0.0))
    for i in range(4):  # earlier requests: long copies that were accepted whole
        r = _Req(10 + i)
        pol.begin(r)
        for _ in range(2):
            pol.observe_round(r, 8, 8, "ngram", "ngram@4")
        pol.release(r)
    r = _Req(1)
    pol.begin(r)
    pol.observe_round(r, 8, 0, "ngram", "ngram@4")
    a = pol._alphas(r, "ngram", 8, "ngram@4")
    assert a[0] < 0.75 and min(a[1:]) > 0.9, a
    # priced by verify cost growing 5% per token, that makes k = 8 the choice, not a short k
    slope = AdaptiveK(8, cost=lambda b, k: 1.0 + 0.05 * k)
    slope.pool, slope.state = pol.pool, pol.state
    assert slope.choose_among(r, 1, 8, [Candidate("ngram", 8, "ngram@4")]).k == 8


def test_short_match_continuation_is_the_sources():
    """How a started copy goes on is the proposer's, not the matched length's: a request whose
    4-token matches were copied whole drafts long on a 1-token match too (its first position
    is the gamble, positions 2.. follow the n-gram's continuation rate), where a record kept
    per key alone had only the 0.6 prior for the 1-token match's continuation.
    Control: where the same request's continuations fail, the 1-token match drafts short."""
    def request(tail_ok: bool):
        pol = AdaptiveK(8, cost=lambda b, k: 1.0 + 0.05 * k)
        r = _Req(1)
        pol.begin(r)
        for _ in range(4):
            pol.observe_round(r, 8, 8 if tail_ok else 1, "ngram", "ngram@4")
        for _ in range(2):  # 1-token matches: missed at once, never continued
            pol.observe_round(r, 8, 0, "ngram", "ngram@1")
        return pol, r

    pol, r = request(tail_ok=True)
    a = pol._alphas(r, "ngram", 8, "ngram@1")
    assert a[0] < 0.3 and min(a[1:]) > 0.85, a
    assert pol.choose_among(r, 1, 8, [Candidate("ngram", 8, "ngram@1")]).k == 8
    pol, r = request(tail_ok=False)
    assert pol.choose_among(r, 1, 8, [Candidate("ngram", 8, "ngram@1")]).k <= 2


def test_round_counted_once_per_record():
    """A round counts once in the overall record, once in its source's and once in its key's;
    when the key is the source (a draft model), once there, not twice."""
    pol = AdaptiveK(8, cost=_flat_cost(0.0))
    r = _Req(1)
    pol.begin(r)
    pol.observe_round(r, 4, 2, "draft")
    pol.observe_round(r, 4, 4, "ngram", "ngram@3")
    st = pol.state[r.id]
    assert set(st) == {None, "draft", "ngram", "ngram@3"}
    assert st["draft"].reached[0] == pytest.approx(0.92)  # one round, decayed once since
    assert st["ngram"].reached[0] == st["ngram@3"].reached[0] == 1.0
    assert st[None].reached[0] == pytest.approx(1.92)


def test_draft_catch_up_priced_and_spread_over_remaining_tokens():
    """A draft model that must first prefill 300 prompt tokens is not worth it when a good
    n-gram match is there, nor alone against plain decoding, but is worth starting on a short
    prompt.  The catch-up is spread over at most the next 32 tokens (fewer if the answer ends
    sooner); its cost per token is the measured one (observe_catch_up) once seen."""
    pol = _measured_policy(draft_per_token=0.1)
    r = _Req(1)
    pol.begin(r)
    for _ in range(6):
        pol.observe_round(r, 4, 4, "draft")
        pol.observe_round(r, 4, 3, "ngram", "ngram@3")
    cands = lambda lag: [Candidate("ngram", 8, "ngram@3"), Candidate("draft", 8, "draft", lag)]
    assert pol.choose_among(r, 1, 8, cands(2), remaining=64).source == "draft"  # steady state
    pol.observe_catch_up(100, 100 * 0.02)  # 0.02 s per prefilled token: no source, ignored
    assert pol.catch_up == {}
    pol.observe_catch_up(100, 100 * 0.02, "draft")  # target forward = 1 s: 0.02 per token
    assert pol.catch_up["draft"] == pytest.approx(0.02)
    assert pol.choose_among(r, 1, 8, cands(300), remaining=64).source == "ngram"
    assert pol.choose_among(r, 1, 8, cands(20), remaining=64).source == "draft"
    assert pol.choose_among(r, 1, 8, cands(300), remaining=4000).source == "ngram"  # horizon 32
    assert pol.choose_among(r, 1, 8, cands(300)).source == "ngram"  # unknown remainder: all now
    # a draft model not seen yet (prior acceptance 0.6), alone against plain decoding, with
    # the catch-up cost measured here (0.05 target forwards per token): a 300-token prefill
    # over the next 32 tokens loses, a 20-token one wins, unless the answer is about to end
    new = _measured_policy(draft_per_token=0.1)
    new.observe_catch_up(100, 100 * 0.05, "draft")
    fresh = _Req(2)
    new.begin(fresh)
    assert new.choose_among(fresh, 1, 8, [Candidate("draft", 8, "draft", 300)], remaining=64).k == 0
    assert new.choose_among(fresh, 1, 8, [Candidate("draft", 8, "draft", 20)], remaining=64).k > 0
    assert new.choose_among(fresh, 1, 1, [Candidate("draft", 1, "draft", 20)], remaining=2).k == 0


def test_k_policy():
    assert isinstance(k_policy(3, 8), FixedK) and k_policy(3, 8).choose(None, 1, 2) == 2
    assert isinstance(k_policy("auto", 8), AdaptiveK)


# ---- greedy equivalence: adaptive k never changes greedy output --------------------------------
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def prompts_and_plain(smollm2):
    model, tok = smollm2
    prompts = [tok.encode_prompt(f"Repeat this code exactly, then add a mul function:\n{CODE}"),
               tok.encode_prompt("Name three colours."),
               tok.encode_prompt("Write a haiku about autumn leaves.")]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = Engine(model, tok, max_seq_len=512, max_batch=3).generate(prompts, params)
    return prompts, params, [r.output for r in plain]


def _proposer(kind, model, tok):
    if kind == "ngram":
        return NgramProposer(1, 4)
    draft = tiny_model(seed=5, vocab=model.args.vocab_size, dim=32, layers=1, max_seq_len=1024)
    if kind == "draft-self":
        return DraftModelProposer(model, tok.vocab_size, 512)
    if kind == "draft-random":
        return DraftModelProposer(draft, tok.vocab_size, 512)
    return CompositeProposer([NgramProposer(1, 4), DraftModelProposer(model, tok.vocab_size, 512)])


@pytest.mark.parametrize("kind", ["ngram", "draft-self", "draft-random", "composite"])
@pytest.mark.parametrize("batched", [False, True])
def test_adaptive_greedy_equals_plain(smollm2, prompts_and_plain, kind, batched):
    model, tok = smollm2
    prompts, params, plain = prompts_and_plain
    eng = Engine(model, tok, _proposer(kind, model, tok), num_draft_tokens="auto", max_seq_len=512,
                 max_batch=3, max_draft_tokens=8)
    if batched:
        reqs = eng.generate(prompts, params)
    else:
        reqs = [eng.generate([p], params)[0] for p in prompts]
    assert [r.output for r in reqs] == plain
    assert sum(r.stats.rounds for r in reqs) > 0  # drafting happened


def test_adaptive_k_moves_with_acceptance(smollm2):
    """Through the engine, with the draft's cost fixed low so only acceptance decides: a
    self-draft (everything accepted) gets long k, a random draft (everything rejected) short k.
    (Measured costs are covered above with injected timings, and end to end by
    benchmarks/proposers.py; a timing-driven assertion here would be flaky on a loaded machine.)"""
    model, tok = smollm2
    params = SamplingParams(temperature=0, max_tokens=48)
    ids = tok.encode_prompt("Write a haiku about autumn leaves.")

    def chosen(kind):
        eng = Engine(model, tok, _proposer(kind, model, tok), num_draft_tokens="auto", max_seq_len=512,
                     max_draft_tokens=6, k_cost=lambda batch, k: 1.0 + 0.05 * k)
        h = eng.generate([ids], params)[0].stats.chosen_k
        return h, sum(k * n for k, n in h.items()) / sum(h.values())

    h_self, mean_self = chosen("draft-self")
    h_rand, mean_rand = chosen("draft-random")
    assert mean_self >= 4, h_self
    assert mean_rand <= 1, h_rand


def test_settle_cuts_the_batch_width_when_a_wide_verify_costs_more():
    """One row copies well (would draft 8), seven rarely get a draft accepted. Alone, the copier
    drafts 8. In a compute-bound batch of 8 (a verify costs B (W + 1) units) the seven others
    pay for its width: the batch settles narrower, and a free forward keeps the full width."""
    def policy(cost):
        pol = AdaptiveK(8, cost=cost)
        rows = [_Req(i) for i in range(8)]
        for i, r in enumerate(rows):
            pol.begin(r)
            for _ in range(12):
                pol.observe_round(r, 8, 8 if i == 0 else 0, "ngram")
        return pol, rows

    compute_bound = lambda B, k: B * (k + 1)  # noqa: E731
    pol, rows = policy(compute_bound)
    choices = [Choice(8, "ngram", "ngram")] + [Choice(1, "ngram", "ngram")] * 7
    assert pol.settle(rows[:1], choices[:1], 1) == choices[:1]  # alone: nothing to settle
    settled = pol.settle(rows, choices, 8)
    width = max(c.k for c in settled)
    assert width < 8
    e = lambda w: sum(expected_tokens(pol._alphas(r, "ngram", c.k), min(c.k, w)) for r, c in zip(rows, choices))  # noqa: E731
    assert all(e(width) / compute_bound(8, width) >= e(w) / compute_bound(8, w) - 1e-12 for w in range(9))
    flat = lambda B, k: 1.0 + 0.01 * k  # noqa: E731  (memory-bound: width nearly free)
    pol, rows = policy(flat)
    assert pol.settle(rows, choices, 8) == choices
    assert FixedK(4).settle(rows, [Choice(4)] * 8, 8) == [Choice(4)] * 8


def test_draft_prompt_prefilled_while_speculation_runs_at_that_load():
    """Adaptive k prefills a draft model's prompt with the target's (so an untried draft is not
    priced out by its prompt's catch-up) until the batch settles on plain rounds at that size."""
    pol = AdaptiveK(8, cost=lambda B, k: B * (k + 1))
    rows = [_Req(i) for i in range(8)]
    for r in rows:
        pol.begin(r)
    assert pol.prefills_draft(8) and pol.prefills_draft(1)  # nothing known: speculation is tried
    for _ in range(30):
        pol.settle(rows, [Choice(0)] * 8, 8)
    assert not pol.prefills_draft(8) and pol.prefills_draft(1)
    # an unseen size is judged by the nearest lighter one seen: above 8, plain; below, untried
    assert not pol.prefills_draft(12) and pol.prefills_draft(4)
    pol.settle(rows, [Choice(0)] * 8, 12)  # its first round starts from 8's share, not from "drafting"
    assert not pol.prefills_draft(12)
    pol.drafting[4] = 1.0  # as if drafting had won at 4
    assert pol.prefills_draft(4) and pol.prefills_draft(6) and not pol.prefills_draft(12)
    for _ in range(30):
        pol.settle(rows, [Choice(3, "draft", "draft")] * 8, 8)  # (the pool's prior alpha: 0.6)
    assert pol.prefills_draft(8) == any(c.k for c in pol.settle(rows, [Choice(3, "draft", "draft")] * 8, 8))
    assert FixedK(4).prefills_draft(8)


def test_one_slow_measurement_does_not_price_drafting_out_for_good():
    """The first k = 1 round was slow (a cold start: 3x its real cost), so drafting looks
    worse than plain and is never chosen again, unless the policy explores: every
    EXPLORE_EVERY plain rounds it drafts one token, measures again, and climbs to a long k
    where every draft is accepted and a wider verify is nearly free."""
    from specdec.engine.adaptive import EXPLORE_EVERY

    def true_cost(M):
        return 1.0 + 0.02 * (M - 1)

    pol = AdaptiveK(8)
    r = _Req(0)
    pol.begin(r)
    pol.observe_target(1, 1, true_cost(1))
    pol.observe_target(1, 2, 3 * true_cost(2))  # the slow first k = 1 round
    pol.observe_draft_cost(1, 0.05, "draft")
    pol.observe_round(r, 1, 1, "draft")
    ks = []
    for _ in range(6 * EXPLORE_EVERY):
        c = pol.settle([r], [pol.choose_among(r, 1, 8, [Candidate("draft", 8)])], 1)[0]
        ks.append(c.k)
        pol.observe_target(1, c.k + 1, true_cost(c.k + 1))
        if c.k:
            pol.observe_draft_cost(c.k, 0.05 * c.k, "draft")
        pol.observe_round(r, c.k, c.k, c.source)
    assert ks[:EXPLORE_EVERY - 1] == [0] * (EXPLORE_EVERY - 1)  # priced out at first
    assert max(ks[-EXPLORE_EVERY:]) >= 4 and ks[-1] >= 4  # explored, measured, climbed


def test_exploration_under_load_is_proportionally_rarer():
    """8 rows priced out of drafting (a wide verify costs much more): exploring makes every row
    of the forward 2 tokens wide, so it comes every EXPLORE_EVERY x 8 plain rounds, not every
    EXPLORE_EVERY (which cost ~3% of a loaded server's rounds: one in 32 nearly twice as wide)."""
    from specdec.engine.adaptive import EXPLORE_EVERY

    pol = AdaptiveK(8)
    rows = [_Req(i) for i in range(8)]
    for r in rows:
        pol.begin(r)
        pol.observe_round(r, 1, 0, "draft")  # drafts rejected: drafting does not pay
    pol.observe_target(8, 1, 1.0)
    pol.observe_target(8, 2, 2.0)  # compute-bound: twice the tokens, twice the time
    pol.observe_draft_cost(1, 0.3, "draft", rows=8)
    explored = []
    for i in range(EXPLORE_EVERY * 8 + 1):
        cs = pol.settle(rows, [pol.choose_among(r, 8, 8, [Candidate("draft", 8)]) for r in rows], 8)
        if any(c.k for c in cs):
            explored.append(i)
    assert explored == [EXPLORE_EVERY * 8 - 1], explored


def test_a_row_a_whole_prompt_behind_is_explored_after_enough_quiet_rounds():
    """A request admitted where speculation had settled off is not draft-prefilled, so its draft
    model is its whole prompt behind. Exploring it feeds that prompt: it waits for
    ceil(lag / EXPLORE_CATCH_UP) periods of EXPLORE_EVERY quiet rounds (the catch-up paid per
    quiet round stays EXPLORE_CATCH_UP / EXPLORE_EVERY), but it is explored; a row a few tokens
    behind still explores after one period. (Alone only: under load the budget stays fixed.)"""
    from specdec.engine.adaptive import EXPLORE_CATCH_UP, EXPLORE_EVERY

    for lag, periods in ((5, 1), (150, 3), (EXPLORE_CATCH_UP * 2, 2)):
        pol = AdaptiveK(8)
        r = _Req(0)
        pol.begin(r)
        pol.observe_round(r, 1, 0, "draft")  # its first draft was rejected: priced out
        pol.observe_target(1, 1, 1.0)
        pol.observe_target(1, 2, 1.4)
        pol.observe_draft_cost(1, 0.4, "draft")
        explored = []
        for i in range(EXPLORE_EVERY * 4):
            c = pol.settle([r], [pol.choose_among(r, 1, 8, [Candidate("draft", 8, "draft", lag)])], 1)[0]
            if c.k:
                explored.append(i)
                break
        assert explored == [EXPLORE_EVERY * periods - 1], (lag, explored)


def test_a_draft_tree_is_priced_at_its_verify_width():
    """A dynamic tree of depth k verifies 2k + 1 tokens per row, not k + 1: on a steep verify
    curve (1 + 0.15 per extra token, measured to 17 tokens) at the same per-depth acceptance (~0.7)
    the tree's k comes out shorter than the chain's, and each choice is the argmax of expected
    tokens over the cost at its own width."""
    chosen = {}
    for tree in (None, "dynamic", (2, 1, 1, 1)):
        width = verify_width(tree)
        kmax = 4 if isinstance(tree, tuple) else 6  # (the engine caps k at a fixed shape's depth)
        pol = AdaptiveK(kmax, width=width)
        r = _Req(1)
        pol.begin(r)
        for w in range(1, 18):
            pol.observe_target(1, w, 1.0 + 0.15 * (w - 1))
        for k in range(1, 7):
            pol.observe_draft_cost(k, 0.0001 * k, "ngram")
        for n in [1, 2, 3, 0, 6, 4, 2, 5] * 8:  # ~0.7 per depth
            pol.observe_round(r, 6, n, "ngram")
        k = chosen[tree] = pol.choose(r, 1, kmax, "ngram")
        alphas = pol._alphas(r, "ngram", kmax)
        w = width or (lambda k: k + 1)
        rate = [expected_tokens(alphas, j) / (1.0 + 0.15 * (w(j) - 1 if j else 0)) for j in range(kmax + 1)]
        assert k == max(range(kmax + 1), key=lambda j: (rate[j], -j)), (tree, rate)
    assert 0 < chosen["dynamic"] < chosen[None]
    assert chosen[(2, 1, 1, 1)] <= chosen[None]
    target = tiny_model(seed=1, vocab=8, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
    models = Models(target, None, target, 8, "target", "draft")
    spec = SpeculativeConfig(draft="draft", num_draft_tokens="auto", max_draft_tokens=8, draft_tree=(2, 1, 1, 1))
    assert build_engine(models, spec, max_model_len=64).policy.k_max == 4
