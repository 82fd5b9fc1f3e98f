"""Vocabulary padding (docs/pitfalls.md 10) and draft/target tokenizer compatibility."""

from __future__ import annotations

import pytest
import torch

from conftest import random_state, tiny_args
from specdec.loader import check_draft_compatible
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.runtime.model import Transformer
from specdec.proposers import DraftModelProposer


def padded_model(seed, real=60, padded=72):
    """Embedding table padded to 72 rows, real vocabulary 60; the padding rows of the output
    head are made to dominate, so any sampler that reads past the real vocabulary would pick them."""
    args = tiny_args(vocab=padded)
    st = random_state(args, seed)
    probe = Transformer(args, st)
    logits = probe.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), probe.new_cache(1))[0, -1]
    st["lm_head.weight"][real:] = 20 * st["lm_head.weight"][int(logits[:real].argmax())]
    return Transformer(args, st)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_never_emits_padding_ids(temperature):
    target, draft = padded_model(1), padded_model(2)
    assert int(target.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), target.new_cache(1))[0, -1].argmax()) >= 60
    for proposer in (None, DraftModelProposer(draft, 60, 64)):
        eng = Engine(target, None, proposer, num_draft_tokens=3, max_seq_len=64, vocab_size=60)
        out = eng.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_tokens=30, seed=0))[0]
        assert len(out.output) == 30 and max(out.output) < 60


class FakeTok:
    def __init__(self, vocab):
        self.real_vocab = vocab
        self.vocab_size = max(vocab.values()) + 1


def test_incompatible_draft_tokenizer_is_refused_naming_both():
    a = FakeTok({"a": 0, "b": 1, "c": 2})
    b = FakeTok({"a": 0, "c": 1, "b": 2})
    with pytest.raises(SpecdecError, match=r"draft 'small'.*3 tokens.*target 'big'"):
        check_draft_compatible(a, b, "big", "small")
    assert check_draft_compatible(a, FakeTok(dict(a.real_vocab)), "big", "small") == 3
