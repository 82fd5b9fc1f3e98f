"""Qwen2.5-Coder 1.5B target + 0.5B draft, both `--dtype native` (1.5 GB of GGUF): `make test-slow`.

Greedy speculative output equals plain greedy output token for token on 10 HumanEval prompts x
128 tokens, k in {1, 3, 5, 8}, and batched: test_qwen_pair's tests, run on the native pair.  The
target is the 1.5B as the int8-activation kernel computes it (Q4_K/Q6_K blocks); the draft runs
its own Q5_0/Q8_0/Q4_K/Q6_K blocks, which only changes which drafts are accepted.  The native
target's logits stay close to the fp32-dequantised model's, within the bounds used (and
explained) for SmolLM2 in tests/test_quant_model.py.
"""

from __future__ import annotations

import pytest
import torch

# test_qwen_pair's prompts, plain run and greedy-equivalence tests, collected again here where
# `pair` is the native pair.
from test_qwen_pair import (plain, prompts, test_batched_rows_equal_plain,  # noqa: F401
                            test_greedy_spec_equals_plain)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair():
    from specdec.loader import check_draft_compatible, load_model

    target, tok = load_model("qwen2.5-coder-1.5b", "native", "cpu")
    draft, dtok = load_model("qwen2.5-coder-0.5b", "native", "cpu")
    V = check_draft_compatible(tok, dtok, "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    return target, draft, tok, V


def test_native_logits_close_to_fp32(pair, prompts):
    """Relative RMS logit error < 7.5% and argmax kept at >= 90% of prompt positions (the same
    bounds as SmolLM2's, tests/test_quant_model.py, which explains them)."""
    from specdec.loader import load_model

    target = pair[0]
    ref, _ = load_model("qwen2.5-coder-1.5b", "fp32", "cpu")
    ids = torch.tensor([prompts[0]])
    pos = torch.arange(ids.shape[1]).view(1, -1)
    a = target.forward(ids, pos, target.new_cache(1, 512))
    b = ref.forward(ids, pos, ref.new_cache(1, 512))
    rel = ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
    kept = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"qwen 1.5B native vs fp32: relative RMS {rel:.4f}, argmax kept {kept:.3f}, "
          f"max |delta| {(a - b).abs().max().item():.3f}")
    assert rel < 0.075 and kept >= 0.9
