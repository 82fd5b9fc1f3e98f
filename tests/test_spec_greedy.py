"""Greedy speculative output equals plain greedy output, token for token (docs/pitfalls.md 2).

No tolerance: every divergence is a bug, or a near-tie we would have to name. The drafts span
both extremes: the target itself (everything accepted) and another random model with the same
vocabulary (almost everything rejected), so both the bonus and the recovered paths are used.
Tiny random models: real weights add nothing to this bookkeeping (test_quant_model.py,
test_ngram.py, test_adaptive.py and test_stops.py check the same on SmolLM2).
"""

from __future__ import annotations

import pytest

from conftest import tiny_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer

V, CTX = 64, 256
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=V, max_seq_len=CTX)


@pytest.fixture(scope="module")
def plain_outputs(target):
    engine = Engine(target, None, max_seq_len=CTX, vocab_size=V)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    return PROMPTS, [r.output for r in engine.generate(PROMPTS, params)]


def _spec_engine(target, draft, k):
    return Engine(target, None, DraftModelProposer(draft, V, CTX), num_draft_tokens=k, max_seq_len=CTX,
                  max_batch=4, vocab_size=V)


def _other(seed):
    return tiny_model(seed=seed, vocab=V, dim=32, layers=1, max_seq_len=CTX)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_self_draft_everything_accepted(target, plain_outputs, k):
    ids, plain = plain_outputs
    engine = _spec_engine(target, target, k)
    reqs = engine.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=40))
    assert reqs[0].output == plain[0]
    s = reqs[0].stats.to_dict()
    assert s["acceptance_rate"] == 1.0 and s["rounds"] > 0


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_random_draft_mostly_rejected(target, plain_outputs, k):
    ids, plain = plain_outputs
    engine = _spec_engine(target, _other(7), k)
    reqs = engine.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=40))
    assert reqs[0].output == plain[0]
    assert reqs[0].stats.rounds > 0 and reqs[0].stats.to_dict()["acceptance_rate"] < 0.5


@pytest.mark.parametrize("draft_kind", ["self", "random"])
def test_batched_rows_with_different_prompt_lengths(target, plain_outputs, draft_kind):
    """Three prompts of different lengths in one batch, ragged acceptance per row."""
    ids, plain = plain_outputs
    engine = _spec_engine(target, target if draft_kind == "self" else _other(8), 4)
    reqs = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=40))
    assert [r.output for r in reqs] == plain
    assert all(r.stats.rounds > 0 for r in reqs)
    if draft_kind == "self":  # the draft's KV (ragged prompt prefill, rollbacks) is right per row
        assert all(r.stats.to_dict()["acceptance_rate"] == 1.0 for r in reqs)


def test_draft_prompt_prefilled_with_the_targets(target, plain_outputs):
    """At a fixed k the draft gets its prompt KV in the prefill (every token but the last), so
    its first round feeds one token; a request that joins later is prefilled on its own cache
    row (rows not 0..B-1); no prefill for a request with no room to draft, nor under adaptive k
    (which prices the catch-up and may never start the draft).  Self-draft: all accepted."""
    ids, plain = plain_outputs

    def spied(prop):
        calls = {"prefill": [], "propose": []}
        prefill, propose = prop.prefill, prop.propose
        prop.prefill = lambda reqs: calls["prefill"].append([r.id for r in reqs]) or prefill(reqs)
        prop.propose = lambda reqs, ks, only=None: calls["propose"].append(propose(reqs, ks, only)) \
            or calls["propose"][-1]
        return calls

    prop = DraftModelProposer(target, V, CTX)
    calls = spied(prop)
    engine = Engine(target, None, prop, num_draft_tokens=4, max_seq_len=CTX, max_batch=4, vocab_size=V)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    engine.reserve(2)
    a = engine.add_request(ids[0], params)
    engine.step()
    assert calls["prefill"] == [[a.id]] and calls["propose"][0].catch_up == 1
    engine.step()
    b = engine.add_request(ids[1], params)
    engine.step()  # b: prefilled on row 1, then one token fed (a: 1 or 2 after a full accept)
    assert b.row == 1 and calls["prefill"][-1] == [b.id] and calls["propose"][-1].catch_up <= 2
    engine.run()
    assert [a.output, b.output] == plain[:2]
    assert a.stats.accepted_tokens == a.stats.draft_tokens > 0
    assert b.stats.accepted_tokens == b.stats.draft_tokens > 0
    one = engine.add_request(ids[2], SamplingParams(temperature=0.0, max_tokens=1))
    engine.run()  # one token to emit: nothing to draft, nothing prefilled
    assert calls["prefill"][-1] == [b.id] and one.finished
    auto = DraftModelProposer(target, V, CTX)
    auto_calls = spied(auto)
    adaptive = Engine(target, None, auto, num_draft_tokens="auto", max_seq_len=CTX, vocab_size=V)
    first = adaptive.add_request(ids[2], params)
    adaptive.step()  # nothing known yet: speculation is tried, its draft prompt prefilled
    assert auto_calls["prefill"] == [[first.id]]
    adaptive.abort(first)
    adaptive.policy.drafting[1] = 0.0  # as if plain rounds had won at this load
    adaptive.add_request(ids[1], params)
    adaptive.step()  # then a draft prompt is left to catch-up, priced, maybe never paid
    assert auto_calls["prefill"] == [[first.id]]


def test_plain_batched_equals_alone(target, plain_outputs):
    ids, plain = plain_outputs
    engine = Engine(target, None, max_seq_len=CTX, max_batch=4, vocab_size=V)
    alone = [engine.generate([i], SamplingParams(temperature=0.0, max_tokens=40))[0].output for i in ids]
    assert alone == plain


def test_draft_state_does_not_leak_between_requests(target):
    """A row reused by a new request starts the draft from scratch, even when the new request's
    first round drafts nothing (max_tokens=1): the draft's KV length never exceeds the tokens it
    has really seen for this request."""
    prop = DraftModelProposer(target, V, CTX)
    engine = Engine(target, None, prop, num_draft_tokens=4, max_seq_len=CTX, vocab_size=V)
    long_ids = [5, 9, 13, 2, 40, 33, 17, 8, 61, 22, 4, 19, 50, 7, 28, 36, 11, 3, 45, 26]
    engine.generate([long_ids], SamplingParams(temperature=0, max_tokens=20))
    short = [5, 9]
    engine.generate([short], SamplingParams(temperature=0, max_tokens=1))
    req = engine.add_request(short, SamplingParams(temperature=0, max_tokens=12))
    engine.step()
    assert prop.cache.lengths[req.row] <= len(req.tokens)
    engine.run()
