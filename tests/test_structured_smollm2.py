"""Structured output on the real SmolLM2-135M: 22 JSON schemas of varied shape (nested objects,
arrays, enums, bounded numbers, patterned strings), greedy. Speculative decoding (n-gram, k = 4)
gives exactly the plain tokens under each schema, all rows in one batch; every output is valid
JSON that the reference validator (jsonschema) accepts; the grammar finishes each request with
"stop". Drafting is asserted to have happened and been accepted.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import NgramProposer

S, I, N, B = {"type": "string", "maxLength": 30}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required=None, extra=False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


SCHEMAS = [
    ("a person named Ada, 36, from Paris", obj({"name": S, "age": I, "city": S})),
    ("a book", obj({"title": S, "year": {"type": "integer", "minimum": 1450, "maximum": 2030}})),
    ("a product with a price", obj({"product": S, "price": {"type": "number", "minimum": 0}})),
    ("the weather today", obj({"condition": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "celsius": I})),
    ("a yes/no answer: is water wet?", obj({"answer": B, "reason": S})),
    ("three colours", obj({"colours": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("a list of small primes", obj({"primes": {"type": "array", "items": I, "maxItems": 5}})),
    ("a point in 2D", obj({"x": N, "y": N})),
    ("a user with an address", obj({"user": S, "address": obj({"street": S, "zip": {"type": "string",
                                                                                  "pattern": "^[0-9]{5}$"}})})),
    ("a date", obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("an HTTP status", obj({"code": {"type": "integer", "minimum": 100, "maximum": 599}, "text": S})),
    ("a chess move", obj({"piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]},
                          "square": {"type": "string", "pattern": "^[a-h][1-8]$"}})),
    ("a rating from 1 to 5", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("a tweet", obj({"text": {"type": "string", "maxLength": 40}, "likes": {"type": "integer", "minimum": 0}})),
    ("a team of two people", obj({"team": {"type": "array", "items": obj({"name": S, "role": S}),
                                           "minItems": 2, "maxItems": 2}})),
    ("a recipe", obj({"dish": S, "minutes": {"type": "integer", "minimum": 1, "maximum": 300},
                      "vegetarian": B})),
    ("a temperature reading", obj({"value": {"type": "number", "minimum": -50, "maximum": 60},
                                   "unit": {"const": "C"}})),
    ("a country and its capital", obj({"country": S, "capital": S})),
    ("an optional nickname", obj({"name": S, "nickname": S}, required=["name"])),
    ("a matrix of two rows", obj({"rows": {"type": "array", "items": {"type": "array", "items": I, "maxItems": 2},
                                           "minItems": 2, "maxItems": 2}})),
    ("a flag and a count", obj({"enabled": B, "count": {"type": "integer", "minimum": 0, "maximum": 9}})),
    ("a language name", {"type": "string", "enum": ["Python", "Rust", "Go"]}),
]


@pytest.fixture(scope="module")
def runs(smollm2):
    """Plain and speculative greedy outputs for every schema, each one batch of 22 rows."""
    model, tok = smollm2
    prompts = [tok.encode_prompt(f"Reply in JSON only: {what}.") for what, _ in SCHEMAS]
    params = [SamplingParams(temperature=0, max_tokens=200, json_schema=schema) for _, schema in SCHEMAS]
    plain = Engine(model, tok, max_seq_len=512, max_batch=len(SCHEMAS)).generate(prompts, params)
    spec = Engine(model, tok, NgramProposer(1, 4), num_draft_tokens=4, max_seq_len=512,
                  max_batch=len(SCHEMAS)).generate(prompts, params)
    return tok, plain, spec


def test_speculative_equals_plain_under_each_schema(runs):
    _, plain, spec = runs
    for (what, _), p, s in zip(SCHEMAS, plain, spec):
        assert s.output == p.output, what
    drafted = sum(r.stats.draft_tokens for r in spec)
    accepted = sum(r.stats.accepted_tokens for r in spec)
    assert drafted > 50 and accepted > 10, (drafted, accepted)


def test_every_output_validates_against_its_schema(runs):
    tok, plain, _ = runs
    unfinished = [(what, r.text) for (what, _), r in zip(SCHEMAS, plain) if r.finish_reason != "stop"]
    assert not unfinished, unfinished
    for (what, schema), r in zip(SCHEMAS, plain):
        jsonschema.validate(json.loads(tok.decode(r.output)), schema)


def test_mixed_batch_with_logprobs_and_penalties(smollm2):
    """Rows with and without a grammar in one batch (and one with a penalty), greedy, with
    log-probabilities: each row's speculative tokens and log-probabilities equal plain decoding's
    (the grammar's -inf entries are left out of the top list, as any filtered token is)."""
    model, tok = smollm2
    schema = SCHEMAS[0][1]
    prompts = [tok.encode_prompt(p) for p in ("Reply in JSON only: a person named Ada, 36, from Paris.",
                                               "Write one sentence about the sea.",
                                               "Reply in JSON only: a person named Bo, 41, from Oslo.",
                                               "List three fruits.")]
    params = [SamplingParams(temperature=0, max_tokens=48, json_schema=schema, logprobs=2),
              SamplingParams(temperature=0, max_tokens=48, logprobs=2),
              SamplingParams(temperature=0, max_tokens=48, json_schema=schema, presence_penalty=0.5, logprobs=2),
              SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.2, logprobs=2)]
    plain = Engine(model, tok, max_seq_len=512, max_batch=4).generate(prompts, params)
    spec = Engine(model, tok, NgramProposer(1, 4), num_draft_tokens=4, max_seq_len=512,
                  max_batch=4).generate(prompts, params)
    for p, s in zip(plain, spec):
        assert s.output == p.output
        assert [(x.token, x.logprob, x.top) for x in s.logprobs] == [(x.token, x.logprob, x.top) for x in p.logprobs]
    for r in (plain[0], plain[2]):
        jsonschema.validate(json.loads(tok.decode(r.output)), schema)
    assert sum(r.stats.draft_tokens for r in spec) > 0
