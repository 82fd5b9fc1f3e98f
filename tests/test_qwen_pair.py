"""Qwen2.5-Coder 1.5B target + 0.5B draft (1.5 GB of weights): run by `make test-slow`.

Greedy speculative output equals plain greedy output token for token on 10 HumanEval prompts x
128 tokens, k in {1, 3, 5, 8}, and for the n-gram, composite and adaptive-k modes
(3 prompts, batch 1 and batched), and under a JSON schema (structured output); the two
tokenizers are accepted as compatible, and the padded vocabulary (151,936 embedding rows, 151,665
real tokens) is never sampled past.
"""

from __future__ import annotations

import pytest

from specdec.config import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    from specdec.loader import check_draft_compatible, load_model

    target, tok = load_model("qwen2.5-coder-1.5b", device="cpu")
    draft, dtok = load_model("qwen2.5-coder-0.5b", device="cpu")
    V = check_draft_compatible(tok, dtok, "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert V == 151_665 < target.args.vocab_size
    return target, draft, tok, V


@pytest.fixture(scope="module")
def prompts(pair):
    from specdec.tools.prompts import humaneval

    return [pair[2].encode_prompt(p) for p in humaneval(10)]


@pytest.fixture(scope="module")
def plain(pair, prompts):
    from specdec.engine import Engine

    target, _, tok, V = pair
    eng = Engine(target, tok, max_seq_len=1024, vocab_size=V)
    params = SamplingParams(temperature=0, max_tokens=128)
    return [eng.generate([p], params)[0].output for p in prompts]


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_spec_equals_plain(pair, prompts, plain, k):
    from specdec.engine import Engine
    from specdec.proposers import DraftModelProposer

    target, draft, tok, V = pair
    eng = Engine(target, tok, DraftModelProposer(draft, V, 1024), num_draft_tokens=k, max_seq_len=1024,
                 vocab_size=V)
    params = SamplingParams(temperature=0, max_tokens=128)
    for p, want in zip(prompts, plain):
        r = eng.generate([p], params)[0]
        assert r.output == want and r.stats.rounds > 0
        assert max(r.output) < V


def test_batched_rows_equal_plain(pair, prompts, plain):
    from specdec.engine import Engine
    from specdec.proposers import DraftModelProposer

    target, draft, tok, V = pair
    eng = Engine(target, tok, DraftModelProposer(draft, V, 1024), num_draft_tokens=4, max_seq_len=1024,
                 max_batch=3, vocab_size=V)
    out = eng.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=128))
    assert [r.output for r in out] == plain[:3]
    assert all(r.stats.rounds > 0 for r in out)


def _proposer(kind, draft, V):
    from specdec.proposers import DraftModelProposer, NgramProposer
    from specdec.proposers.composite import CompositeProposer

    if kind == "ngram":
        return NgramProposer(1, 4)
    if kind == "draft":
        return DraftModelProposer(draft, V, 1024)
    return CompositeProposer([NgramProposer(1, 4), DraftModelProposer(draft, V, 1024)])


@pytest.mark.parametrize("kind, k", [("ngram", 4), ("composite", 4), ("ngram", "auto"),
                                     ("draft", "auto"), ("composite", "auto")])
@pytest.mark.parametrize("batched", [False, True])
def test_proposers_and_adaptive_k_equal_plain(pair, prompts, plain, kind, k, batched):
    """n-gram, composite and adaptive k (issue #5) on the real pair, batch 1 and batched.

    Adaptive k runs on a fixed cost model (t_target(k) = 1 + 0.1 k, the draft free): with
    measured costs it may rightly never start an fp32 draft model on these long prompts (its
    catch-up is priced), and the test would then compare plain with plain."""
    from specdec.engine import Engine

    target, draft, tok, V = pair
    eng = Engine(target, tok, _proposer(kind, draft, V), num_draft_tokens=k, max_seq_len=1024,
                 max_batch=3, vocab_size=V, k_cost=(lambda B, kk: 1.0 + 0.1 * kk) if k == "auto" else None)
    params = SamplingParams(temperature=0, max_tokens=128)
    if batched:
        reqs = eng.generate(prompts[:3], params)
    else:
        reqs = [eng.generate([p], params)[0] for p in prompts[:3]]
    assert [r.output for r in reqs] == plain[:3]
    assert sum(r.stats.rounds for r in reqs) > 0  # drafting happened


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "born", "fields"],
          "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                         "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
PASSAGES = ["Marie Curie was born in 1867 in Warsaw and worked in physics and chemistry.",
            "Alan Turing, born 1912 in London, worked in mathematics, logic and computer science.",
            "Ada Lovelace (born 1815) is known for her work in mathematics and on the Analytical Engine."]


@pytest.mark.parametrize("kind, k", [("draft", 4), ("composite", "auto")])
def test_json_schema_speculative_equals_plain(pair, kind, k):
    """Structured output (issue #22) on the real pair: under a JSON schema, greedy speculative
    decoding (the draft model at k = 4; composite with adaptive k on a fixed cost model), all
    rows in one batch, equals plain decoding under the same schema token for token; every output
    finishes with "stop" and validates (jsonschema); drafts were accepted."""
    import json

    import jsonschema

    from specdec.engine import Engine

    target, draft, tok, V = pair
    prompts = [tok.encode_prompt(f"Extract the facts as JSON.\n\n{p}") for p in PASSAGES]
    params = SamplingParams(temperature=0, max_tokens=96, json_schema=SCHEMA)
    want = Engine(target, tok, max_seq_len=1024, max_batch=3, vocab_size=V).generate(prompts, params)
    eng = Engine(target, tok, _proposer(kind, draft, V), num_draft_tokens=k, max_seq_len=1024, max_batch=3,
                 vocab_size=V, k_cost=(lambda B, kk: 1.0 + 0.1 * kk) if k == "auto" else None)
    got = eng.generate(prompts, params)
    assert [r.output for r in got] == [r.output for r in want]
    assert sum(r.stats.accepted_tokens for r in got) > 0
    for r in want:
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(r.output)), SCHEMA)
