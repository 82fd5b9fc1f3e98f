"""Greedy speculative output equals plain greedy output, token for token (docs/pitfalls.md 2).

No tolerance: every divergence is a bug, or a near-tie we would have to name. The drafts span
both extremes: the target itself (everything accepted) and a random tiny model with the same
vocabulary (almost everything rejected), so both the bonus and the recovered paths are used.
"""

from __future__ import annotations

import pytest

from conftest import tiny_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer

PROMPTS = ["Write a Python function that checks if a number is prime.",
           "What is the tallest mountain in the world?",
           "Name three colours."]


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    model, tok = smollm2
    engine = Engine(model, tok, max_seq_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ids = [tok.encode_prompt(p) for p in PROMPTS]
    return ids, [r.output for r in engine.generate(ids, params)]


def _spec_engine(target, tok, draft, k):
    V = tok.vocab_size
    return Engine(target, tok, DraftModelProposer(draft, V, 512), num_draft_tokens=k, max_seq_len=512,
                  max_batch=4)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_self_draft_everything_accepted(smollm2, plain_outputs, k):
    model, tok = smollm2
    ids, plain = plain_outputs
    engine = _spec_engine(model, tok, model, k)
    reqs = engine.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=40))
    assert reqs[0].output == plain[0]
    s = reqs[0].stats.to_dict()
    assert s["acceptance_rate"] == 1.0 and s["rounds"] > 0


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_random_tiny_draft_mostly_rejected(smollm2, plain_outputs, k):
    model, tok = smollm2
    ids, plain = plain_outputs
    draft = tiny_model(seed=7, vocab=model.args.vocab_size, dim=32, layers=1, max_seq_len=1024)
    engine = _spec_engine(model, tok, draft, k)
    reqs = engine.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=40))
    assert reqs[0].output == plain[0]
    assert reqs[0].stats.rounds > 0 and reqs[0].stats.to_dict()["acceptance_rate"] < 0.5


@pytest.mark.parametrize("draft_kind", ["self", "random"])
def test_batched_rows_with_different_prompt_lengths(smollm2, plain_outputs, draft_kind):
    """Three prompts of different lengths in one batch, ragged acceptance per row."""
    model, tok = smollm2
    ids, plain = plain_outputs
    draft = model if draft_kind == "self" else tiny_model(seed=8, vocab=model.args.vocab_size, dim=32,
                                                          layers=1, max_seq_len=1024)
    engine = _spec_engine(model, tok, draft, 4)
    reqs = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=40))
    assert [r.output for r in reqs] == plain
    assert all(r.stats.rounds > 0 for r in reqs)
    if draft_kind == "self":  # the draft's KV (ragged prompt prefill, rollbacks) is right per row
        assert all(r.stats.to_dict()["acceptance_rate"] == 1.0 for r in reqs)


def test_draft_prompt_prefilled_with_the_targets(smollm2, plain_outputs):
    """At a fixed k the draft gets its prompt KV in the prefill (every token but the last), so
    its first round feeds one token; a request that joins later is prefilled on its own cache
    row (rows not 0..B-1); no prefill for a request with no room to draft, nor under adaptive k
    (which prices the catch-up and may never start the draft).  Self-draft: all accepted."""
    model, tok = smollm2
    ids, plain = plain_outputs

    def spied(prop):
        calls = {"prefill": [], "propose": []}
        prefill, propose = prop.prefill, prop.propose
        prop.prefill = lambda reqs: calls["prefill"].append([r.id for r in reqs]) or prefill(reqs)
        prop.propose = lambda reqs, ks, only=None: calls["propose"].append(propose(reqs, ks, only)) \
            or calls["propose"][-1]
        return calls

    prop = DraftModelProposer(model, tok.vocab_size, 512)
    calls = spied(prop)
    engine = Engine(model, tok, prop, num_draft_tokens=4, max_seq_len=512, max_batch=4)
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
    auto = DraftModelProposer(model, tok.vocab_size, 512)
    auto_calls = spied(auto)
    adaptive = Engine(model, tok, auto, num_draft_tokens="auto", max_seq_len=512)
    adaptive.add_request(ids[2], params)
    adaptive.step()
    assert auto_calls["prefill"] == []


def test_plain_batched_equals_alone(smollm2, plain_outputs):
    model, tok = smollm2
    ids, plain = plain_outputs
    engine = Engine(model, tok, max_seq_len=512, max_batch=4)
    alone = [engine.generate([i], SamplingParams(temperature=0.0, max_tokens=40))[0].output for i in ids]
    assert alone == plain


def test_draft_state_does_not_leak_between_requests(smollm2):
    """A row reused by a new request starts the draft from scratch, even when the new request's
    first round drafts nothing (max_tokens=1): the draft's KV length never exceeds the tokens it
    has really seen for this request."""
    model, tok = smollm2
    prop = DraftModelProposer(model, tok.vocab_size, 512)
    engine = Engine(model, tok, prop, num_draft_tokens=4, max_seq_len=512)
    long_ids = tok.encode_prompt("Tell me a long story about the sea and its creatures.")
    engine.generate([long_ids], SamplingParams(temperature=0, max_tokens=20))
    short = tok.encode_prompt("Hi")
    engine.generate([short], SamplingParams(temperature=0, max_tokens=1))
    req = engine.add_request(short, SamplingParams(temperature=0, max_tokens=12))
    engine.step()
    assert prop.cache.lengths[req.row] <= len(req.tokens)
    engine.run()
