"""`--dtype native`: SmolLM2-135M run on its own GGUF blocks (Q4_1 matrices, Q8_0 embedding/head).

* Loading reads the GGUF itself (not the fp32 conversion cache): every matrix stays a quantised
  kernel weight, norms stay fp32, the tied head is the quantised embedding.
* Greedy speculative output equals plain greedy output token for token with the native target:
  n-gram proposer, and the native model as its own draft (batch-invariant kernel and attention,
  so the verify forward over k + 1 rows gives each row the bits of the 1-row decode step).
* Logits against the fp32-dequantised model.  The native model multiplies int8-rounded
  activations (|x - x^| <= amax / 254 per 32-block, ~0.4% of a block's largest entry) and the
  rounding compounds over 30 layers.  Measured on these three prompts (all positions): relative
  RMS logit error 2.8-3.7%, max |delta logit| 1.95 on logits up to ~39, the fp32 model's argmax
  kept at 97-100% of positions.  The test allows 2x (relative RMS < 7.5%, argmax kept >= 90%):
  a decoding or packing bug gives O(1) relative error and argmax agreement near chance.
"""

from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.runtime.model import RowEmbedding


@pytest.fixture(scope="module")
def native():
    from specdec.loader import load_model

    return load_model("smollm2-135m", "native", "cpu")


def test_native_loads_quantised_weights(native):
    from specdec.runtime.kernels.quant import QuantWeight

    model, _ = native
    lw = model.layers[0]
    for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down, model.lm_head):
        assert isinstance(w, QuantWeight)
    assert lw.wqkv.segments == (("Q4_1", 576), ("Q4_1", 192), ("Q4_1", 192))
    assert model.lm_head.segments == (("Q8_0", 49152),)
    assert lw.attn_norm.dtype == torch.float32
    # the embedding kept as stored: looked-up rows are the whole table's dequantised rows
    assert isinstance(model.embed, RowEmbedding) and model.embed.qt.qtype == "Q8_0"
    ids = torch.tensor([[0, 5, 49151], [17, 17, 3]])
    assert torch.equal(model.embed[ids], model.embed.qt.dequantize()[ids])


def test_logits_close_to_fp32_dequantised(native, smollm2):
    model, tok = native
    ref, _ = smollm2
    prompts = ["Write a Python function that reverses a list.", "What is the capital of France?",
               "def fibonacci(n):"]
    errs, kept = [], []
    for p in prompts:
        ids = torch.tensor([tok.encode_prompt(p)])
        pos = torch.arange(ids.shape[1]).view(1, -1)
        a = model.forward(ids, pos, model.new_cache(1, 256))
        b = ref.forward(ids, pos, ref.new_cache(1, 256))
        errs.append(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item())
        kept.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
    assert max(errs) < 0.075, errs
    assert min(kept) >= 0.9, kept


def test_native_logits_at_is_bit_exact(native):
    """The native head on selected positions equals those rows of the full logits, bit for bit."""
    model, _ = native
    tok = torch.randint(0, 49152, (1, 7), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(7).view(1, 7)
    full = model.forward(tok, pos, model.new_cache(1))
    sel = model.forward(tok, pos, model.new_cache(1), logits_at=torch.tensor([[6, 2]]))
    assert torch.equal(sel[0], full[0, [6, 2]])


def test_wide_prefill_rows_equal_every_isa_and_the_row_alone(native, monkeypatch):
    """A 300-token prompt in one forward (every matmul 300 rows wide: AMX tiles where the CPU
    has them; the 1536-wide down projection in row blocks of 160) gives logits at every
    position bit-identical to the AVX-512 and AVX2 routines' (each ISA this CPU has), and its
    last row equals that token decoded alone after the 299-token prefix: the batch invariance a
    greedy verify and a server batch rely on, on the real Q4_1/Q8_0 weights."""
    from specdec.runtime.kernels import quant as Q

    if Q._qext() is None:
        pytest.skip("no C++ kernel on this CPU")
    model, _ = native
    t = 300
    tok = torch.randint(0, 49152, (1, t), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(t)[None]
    names = {2: "avx2", 512: "avx512", 1024: "amx"}
    monkeypatch.delenv("SPECDEC_KERNEL", raising=False)
    auto = model.forward(tok, pos, model.new_cache(1, t + 8))
    for isa in Q._qext().isas():
        monkeypatch.setenv("SPECDEC_KERNEL", names[isa])
        assert torch.equal(model.forward(tok, pos, model.new_cache(1, t + 8)), auto), names[isa]
    monkeypatch.delenv("SPECDEC_KERNEL")
    cache = model.new_cache(1, t + 8)
    model.forward(tok[:, :-1], pos[:, :-1], cache)
    cache.advance(0, t - 1)
    assert torch.equal(model.forward(tok[:, -1:], pos[:, -1:], cache)[0, 0], auto[0, -1])


def test_prefill_in_pieces_equals_one_forward(native):
    """Prompt processing in pieces of PREFILL_PIECE tokens (kv_cache.prefill, what the engine
    and the draft model run) leaves the cache's keys and values and the hidden states the head
    proposer is told bit-identical to one forward over the whole prompt, and took several
    forwards; a piece of a different size gives the same bits too. Negative control: one
    prompt token changed in the last piece changes KV there and none before it."""
    from types import SimpleNamespace

    from specdec.runtime import kv_cache

    model, _ = native
    t = 2 * kv_cache.PREFILL_PIECE + 77
    prompt = torch.randint(0, 49152, (t,), generator=torch.Generator().manual_seed(9)).tolist()

    def run(tokens, piece):
        cache = model.new_cache(1, t + 8)
        seen, calls = [], []
        orig = model.forward

        def counted(*a, **kw):
            calls.append(a[0].shape[1])
            return orig(*a, **kw)

        model.forward = counted
        try:
            fed = kv_cache.prefill(model, cache, [SimpleNamespace(row=0, tokens=tokens)], piece=piece,
                                   on_hidden=lambda r, start, h: seen.append((start, h.clone())))
        finally:
            del model.forward
        assert len(fed) == 1 and cache.lengths[0] == t - 1
        assert [s for s, _ in seen] == [sum(calls[:i]) for i in range(len(calls))]
        return cache, torch.cat([h for _, h in seen]), calls

    whole, h_whole, calls = run(prompt, 10**9)
    assert calls == [t - 1]
    for piece in (kv_cache.PREFILL_PIECE, 100):
        cache, h, calls = run(prompt, piece)
        assert len(calls) == -(-(t - 1) // piece) and max(calls) == piece
        assert torch.equal(h, h_whole)
        assert torch.equal(cache.k[:, :, :, : t - 1], whole.k[:, :, :, : t - 1])
        assert torch.equal(cache.v[:, :, :, : t - 1], whole.v[:, :, :, : t - 1])
    changed = list(prompt)
    j = t - 20
    changed[j] = (changed[j] + 1) % 49152
    cache, _, _ = run(changed, kv_cache.PREFILL_PIECE)
    assert torch.equal(cache.k[:, :, :, :j], whole.k[:, :, :, :j])
    assert not torch.equal(cache.k[:, :, :, j:t - 1], whole.k[:, :, :, j:t - 1])


def _prompts(tok):
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    return [tok.encode_prompt(f"Repeat this code exactly, then add a mul function:\n{code}"),
            tok.encode_prompt("Name three colours."),
            tok.encode_prompt("Write a Python function that checks whether a string is a palindrome.")]


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_ngram_equals_plain_native(native, k):
    from specdec.engine import Engine
    from specdec.proposers.ngram import NgramProposer

    model, tok = native
    prompts = _prompts(tok)
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [Engine(model, tok, max_seq_len=512).generate([p], params)[0].output for p in prompts]
    spec = Engine(model, tok, NgramProposer(1, 4), num_draft_tokens=k, max_seq_len=512, max_batch=3)
    got = spec.generate(prompts, params)
    assert [r.output for r in got] == plain
    assert sum(r.stats.accepted_tokens for r in got) > 0


def _draft_vs_plain(model, tok, draft, prompts, k):
    """(plain greedy outputs, speculative results with `draft` drafting k), one prompt at a time."""
    from specdec.engine import Engine
    from specdec.proposers import DraftModelProposer

    params = SamplingParams(temperature=0, max_tokens=32)
    plain = [Engine(model, tok, max_seq_len=512).generate([p], params)[0].output for p in prompts]
    eng = Engine(model, tok, DraftModelProposer(draft, tok.vocab_size, 512), num_draft_tokens=k,
                 max_seq_len=512)
    return plain, [eng.generate([p], params)[0] for p in prompts]


def test_greedy_self_draft_equals_plain_native(native):
    """The native model drafting for itself: every draft accepted, output unchanged."""
    model, tok = native
    plain, got = _draft_vs_plain(model, tok, model, _prompts(tok)[1:], 5)
    assert [r.output for r in got] == plain
    assert all(r.stats.accepted_tokens == r.stats.draft_tokens > 0 for r in got)


def test_api_native_speculative_ngram():
    """Through the public API (what `--dtype native --proposer ngram` runs)."""
    import specdec

    params = specdec.SamplingParams(temperature=0, max_tokens=24)
    prompt = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    plain = specdec.LLM(model="smollm2-135m", dtype="native").generate([prompt], params)[0]
    spec = specdec.LLM(model="smollm2-135m", dtype="native",
                       speculative_config={"proposer": "ngram", "num_draft_tokens": 4})
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids and out.stats["rounds"] > 0


def test_requantise_to_q4_0_is_gguf_q4_0_of_the_values():
    """requantise = gguf's own Q4_0 quantiser on gguf's dequantised values: every value within
    one Q4_0 step (|d| = amax / 8; the code range -8..7 clips the far end of the other sign by
    up to a step) of the original, and the bytes are gguf's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specdec.runtime.kernels.quant import QuantTensor, requantise

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)).numpy()
    q8 = QuantTensor("Q8_0", quantize(w, GGMLQuantizationType.Q8_0), (48, 256))
    q4 = requantise(q8, "Q4_0")
    assert q4.qtype == "Q4_0" and q4.shape == (48, 256)
    src = q8.dequantize().reshape(48, 8, 32)
    err = (q4.dequantize().reshape(48, 8, 32) - src).abs().amax(-1)
    step = src.abs().amax(-1) / 8
    assert (err <= step * 1.01).all() and err.max() > 0  # (d is stored as fp16)
    assert (q4.raw == quantize(src.reshape(48, 256).numpy(), GGMLQuantizationType.Q4_0)).all()


def test_q4_0_draft_leaves_greedy_output_unchanged(native):
    """`--draft-dtype q4_0`: the draft's matrices (Q4_1 blocks and the tied Q8_0 head/embedding)
    become Q4_0, a different model: greedy speculative output still equals plain output."""
    from specdec.loader import load_model

    model, tok = native
    draft, _ = load_model("smollm2-135m", "q4_0", "cpu")
    assert draft.lm_head.segments == (("Q4_0", 49152),)
    assert {s[0] for s in draft.layers[0].w_gate_up.segments} == {"Q4_0"}
    plain, got = _draft_vs_plain(model, tok, draft, _prompts(tok), 4)
    assert [r.output for r in got] == plain
    assert all(r.stats.rounds > 0 for r in got)
    acc = sum(r.stats.accepted_tokens for r in got) / sum(r.stats.draft_tokens for r in got)
    assert 0.3 < acc < 1.0, acc  # the same network, coarser: mostly, not always, right


def test_native_needs_gguf(tmp_path):
    from specdec.loader import load_model
    from specdec.errors import SpecdecError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecdecError, match="native"):
        load_model(str(tmp_path), "native", "cpu")
