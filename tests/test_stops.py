"""Stops inside a speculative round (docs/pitfalls.md 6): output equals plain decoding exactly, and
nothing past the stop is emitted, counted or left in a cache.

The draft is the target itself, so every round accepts all k drafts and emits k + 1 tokens:
each stop below falls strictly inside a round.
"""

from __future__ import annotations

import pytest

from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer

K = 4


class Spy(DraftModelProposer):
    """Records the draft's KV length at release: it must cover committed tokens only."""

    def release(self, req):
        self.kv_at_release = self.cache.lengths[req.row]
        super().release(req)


def engines(smollm2, max_seq_len=512):
    model, tok = smollm2
    plain = Engine(model, tok, max_seq_len=max_seq_len)
    spy = Spy(model, tok.vocab_size, max_seq_len)
    spec = Engine(model, tok, spy, num_draft_tokens=K, max_seq_len=max_seq_len)
    return plain, spec, spy


def check_consistent(req, spy, spec):
    assert spy.kv_at_release <= len(req.tokens)
    s = req.stats.to_dict()
    assert s["rounds"] > 0  # drafting happened
    assert s["accepted_tokens"] <= len(req.output)  # drafts cut off by the stop are not counted
    assert s["accepted_tokens"] <= s["draft_tokens"]
    assert 0 <= s["acceptance_rate"] <= 1


def test_eos_mid_round(smollm2):
    model, tok = smollm2
    plain, spec, spy = engines(smollm2)
    ids = tok.encode_prompt("What is 2+2?")
    params = SamplingParams(temperature=0, max_tokens=64)
    a = plain.generate([ids], params)[0]
    b = spec.generate([ids], params)[0]
    assert a.finish_reason == "stop" and a.output[-1] in tok.eos_token_ids
    assert len(a.output) % (K + 1) != 0  # the EOS lands inside a round
    assert b.output == a.output and b.text == a.text and b.finish_reason == "stop"
    check_consistent(b, spy, spec)


def test_stop_string_split_across_two_tokens(smollm2):
    model, tok = smollm2
    plain, spec, spy = engines(smollm2)
    ids = tok.encode_prompt("Write a Python function that reverses a string.")
    free = plain.generate([ids], SamplingParams(temperature=0, max_tokens=48))[0]
    pieces = [tok.decode([t]) for t in free.output]
    j = next(j for j in range(8, len(pieces) - 1)
             if len(pieces[j].strip()) >= 2 and len(pieces[j + 1].strip()) >= 2 and (j + 2) % (K + 1) != 0)
    stop = pieces[j][-2:] + pieces[j + 1][:2]
    assert stop not in "".join(pieces[: j + 1])  # first occurrence spans tokens j and j + 1
    params = SamplingParams(temperature=0, max_tokens=48, stop=[stop])
    a = plain.generate([ids], params)[0]
    b = spec.generate([ids], params)[0]
    assert a.finish_reason == "stop" and a.output == free.output[: j + 2]
    assert a.text == "".join(pieces)[: "".join(pieces).index(stop)] and stop not in a.text
    assert b.output == a.output and b.text == a.text and b.finish_reason == "stop"
    check_consistent(b, spy, spec)


@pytest.mark.parametrize("max_tokens", [7, 9, 10])
def test_max_tokens_mid_round(smollm2, max_tokens):
    model, tok = smollm2
    plain, spec, spy = engines(smollm2)
    ids = tok.encode_prompt("Tell me about the moon in detail.")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    a = plain.generate([ids], params)[0]
    b = spec.generate([ids], params)[0]
    assert len(a.output) == max_tokens and a.finish_reason == "length"
    assert b.output == a.output and b.finish_reason == "length"
    check_consistent(b, spy, spec)


def test_context_limit_mid_round(smollm2):
    model, tok = smollm2
    ids = tok.encode_prompt("Tell me about the moon in detail.")
    plain, spec, spy = engines(smollm2, max_seq_len=len(ids) + 8)
    params = SamplingParams(temperature=0, max_tokens=64)
    a = plain.generate([ids], params)[0]
    b = spec.generate([ids], params)[0]
    assert len(a.tokens) == len(ids) + 8 and a.finish_reason == "length"
    assert b.output == a.output and b.finish_reason == "length"
    check_consistent(b, spy, spec)


def test_streamed_text_never_shows_a_stop_string_prefix(smollm2):
    """Streaming holds back text that might still become a stop string."""
    model, tok = smollm2
    plain, spec, _ = engines(smollm2)
    ids = tok.encode_prompt("Write a Python function that reverses a string.")
    streamed = []
    out = spec.generate([ids], SamplingParams(temperature=0, max_tokens=48, stop=["return"]),
                        on_event=lambda r, d: streamed.append(d))[0]
    assert "".join(streamed) == out.text and "return" not in out.text and "retur" not in "".join(streamed)[-6:]
