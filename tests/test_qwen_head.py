"""A draft head on Qwen2.5-Coder-1.5B at its native quantisation (issue #21): run by `make test-slow`.

Exactness does not depend on how well a head predicts, so the test trains its own head with a
few minutes of `specdec train-head` (the real command, on the real model: Qwen's grouped-query
attention, biases and 151,936-row padded vocabulary) unless SPECDEC_TEST_QWEN_HEAD names a
trained one (the head measured in docs/draft-head.md). Greedy speculative output with the head
equals plain greedy token for token, batched and one at a time, chain and tree, with drafts
accepted.
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec.config import SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen():
    from specdec.loader import load_models

    torch.set_num_threads(2)
    return load_models("qwen2.5-coder-1.5b", dtype="native")


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    if os.environ.get("SPECDEC_TEST_QWEN_HEAD"):
        return os.environ["SPECDEC_TEST_QWEN_HEAD"]
    from specdec.cli import main

    out = tmp_path_factory.mktemp("qwen-head") / "head"
    assert main(["train-head", "--model", "qwen2.5-coder-1.5b", "--out", str(out), "--minutes", "4",
                 "--harvest-tokens", "3000", "--max-new", "64", "--epochs", "2", "--draft-vocab", "2048",
                 "--intermediate", "256", "--batch-pairs", "256", "--threads", "2"]) == 0
    return str(out)


def test_head_greedy_equals_plain_on_qwen(qwen, head_dir):
    from specdec.head import DraftHead
    from specdec.loader import build_engine
    from specdec.tools.prompts import CHAT_PROMPTS, humaneval

    head = DraftHead.load(head_dir)
    assert head.cfg.dim == 1536 and head.cfg.n_kv_heads == 2  # a head of this target
    tok = qwen.tokenizer
    prompts = [tok.encode_prompt(p) for p in humaneval(2) + CHAT_PROMPTS[:1]]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = [r.output for r in build_engine(qwen, None, max_model_len=1024, max_batch=3).generate(prompts, params)]
    for k, tree in ((3, None), ("auto", None), (2, (2, 1))):
        eng = build_engine(qwen, SpeculativeConfig(proposer="head", head=head_dir, num_draft_tokens=k,
                                                   draft_tree=tree), max_model_len=1024, max_batch=3)
        got = eng.generate(prompts, params)
        assert [r.output for r in got] == want, (k, tree)
        assert eng.generate([prompts[0]], params)[0].output == want[0], (k, tree)
        drafted = sum(r.stats.draft_tokens for r in got)
        accepted = sum(r.stats.accepted_tokens for r in got)
        if k == "auto":
            # Adaptive k starts from the head's held-out acceptance (head.json); this few-minute
            # head's (~0.15) prices it out, so it drafts only when adaptive k explores it (after
            # EXPLORE_EVERY plain rounds of a row): a longer answer alone gets there.
            from specdec.engine.adaptive import EXPLORE_EVERY

            longer = SamplingParams(temperature=0, max_tokens=2 * EXPLORE_EVERY + 8)
            plain = build_engine(qwen, None, max_model_len=1024, max_batch=1).generate([prompts[0]], longer)[0]
            r = eng.generate([prompts[0]], longer)[0]
            assert r.output == plain.output
            assert r.stats.draft_tokens > 0, r.stats.to_dict()
            continue
        assert drafted > 0 and accepted > 0, (k, tree, accepted, drafted)
