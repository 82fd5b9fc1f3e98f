"""N-gram prompt lookup: literal token cases, and greedy equivalence through the engine."""

from __future__ import annotations

import pytest

from specdec.errors import SpecdecError
from specdec.proposers.ngram import NgramIndex, NgramProposer


def lookup(tokens, k, n_min=1, n_max=3):
    idx = NgramIndex(n_min, n_max)
    idx.extend(tokens)
    return idx.lookup(tokens, k)


def test_literal_cases():
    # suffix [1, 2] occurred at the start, followed by 3, 4: propose them
    assert lookup([1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]
    # k larger than what follows the match: the continuation stops at the end of the context
    assert lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    # no earlier occurrence of any suffix: nothing to propose
    assert lookup([1, 2, 3, 4], 3) == []
    # the longest suffix wins: [7, 1, 2] matches at the end -> 5, not the later [1, 2] -> 6
    assert lookup([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2], 1) == [5]
    # with equal length, the most recent occurrence wins: [2] was last followed by 6
    assert lookup([2, 5, 2, 6, 2], 1, n_max=1) == [6]
    # n_min = 2: a single-token match is not enough
    assert lookup([4, 9, 4], 2, n_min=2) == []
    # a repeated token: the longest earlier match is [3, 3] at 0..1, followed by the last 3
    assert lookup([3, 3, 3], 4) == [3]


def test_incremental_index_equals_rebuilt_index():
    """Indexing token by token gives the same answers as indexing the whole list at once."""
    seq = [5, 1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    inc = NgramIndex(1, 3)
    for L in range(1, len(seq) + 1):
        inc.extend(seq[:L])
        assert inc.lookup(seq[:L], 3) == lookup(seq[:L], 3)


def test_bad_ranges():
    with pytest.raises(SpecdecError, match="ngram_min=3 > ngram_max=2"):
        NgramProposer(3, 2)
    with pytest.raises(SpecdecError, match="ngram_min=0"):
        NgramProposer(0, 2)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_ngram_equals_plain(smollm2, k):
    from specdec.config import SamplingParams
    from specdec.engine import Engine

    model, tok = smollm2
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [tok.encode_prompt(f"Repeat this code exactly, then add a mul function:\n{code}"),
               tok.encode_prompt("Name three colours.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = Engine(model, tok, max_seq_len=512, max_batch=2).generate(prompts, params)
    spec = Engine(model, tok, NgramProposer(1, 4), num_draft_tokens=k, max_seq_len=512, max_batch=2)
    got = spec.generate(prompts, params)
    assert [r.output for r in got] == [r.output for r in plain]
    assert got[0].stats.draft_tokens > 0 and got[0].stats.accepted_tokens > 0


@pytest.mark.parametrize("draft_kind", ["self", "random"])
def test_greedy_composite_equals_plain(smollm2, draft_kind):
    """n-gram first, draft model when there is no match; batched rows of different lengths."""
    from conftest import tiny_model
    from specdec.config import SamplingParams
    from specdec.engine import Engine
    from specdec.proposers import DraftModelProposer
    from specdec.proposers.composite import CompositeProposer

    model, tok = smollm2
    draft = model if draft_kind == "self" else tiny_model(seed=3, vocab=model.args.vocab_size, dim=32,
                                                          layers=1, max_seq_len=1024)
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [tok.encode_prompt(f"Repeat this code exactly:\n{code}"), tok.encode_prompt("Name three colours.")]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = Engine(model, tok, max_seq_len=512, max_batch=2).generate(prompts, params)
    comp = CompositeProposer([NgramProposer(1, 4), DraftModelProposer(draft, tok.vocab_size, 512)])
    got = Engine(model, tok, comp, num_draft_tokens=4, max_seq_len=512, max_batch=2).generate(prompts, params)
    assert [r.output for r in got] == [r.output for r in plain]
    assert all(r.stats.rounds > 0 for r in got)
