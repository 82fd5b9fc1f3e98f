"""The model runtime against transformers, and the KV cache's rollback/batching properties."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_state, tiny_args, tiny_model
from specdec.runtime.model import Transformer

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
          407, 19712, 8182, 2, 198, 1, 4093, 198, 7306, 1812, 314, 253, 2356, 30]


def _full(model, ids):
    cache = model.new_cache(1)
    T = len(ids)
    return model.forward(torch.tensor([ids]), torch.arange(T).view(1, T), cache)[0]


def _token_by_token(model, ids):
    cache = model.new_cache(1)
    out = []
    for i, t in enumerate(ids):
        out.append(model.forward(torch.tensor([[t]]), torch.tensor([[i]]), cache)[0, 0])
        cache.advance(0, 1)
    return torch.stack(out)


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    """Same GGUF, loaded by us and by transformers: fp32 logits agree to < 1e-3 (the issue's bound),
    over a whole prompt and token by token through the cache."""
    model, _ = smollm2
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([PROMPT])).logits[0]
    assert (_full(model, PROMPT) - ref).abs().max() < 1e-3
    assert (_token_by_token(model, PROMPT) - ref).abs().max() < 1e-3


def test_tiny_qwen2_with_biases_matches_transformers():
    """A random Qwen2 config with q/k/v biases and untied head, loaded into transformers' Qwen2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    args = tiny_args("qwen2", vocab=96, dim=64, layers=3, heads=4, kv_heads=2, inter=80)
    state = random_state(args, seed=3)
    ours = Transformer(args, state)
    cfg = Qwen2Config(**{k: v for k, v in args.to_hf_config().items() if k not in ("architectures",)})
    ref = Qwen2ForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        r = ref(torch.tensor([ids])).logits[0]
    assert (_full(ours, ids) - r).abs().max() < 1e-4
    assert (_token_by_token(ours, ids) - r).abs().max() < 1e-4


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_chunked_decode_with_rollbacks_equals_full_forward(data):
    """Random chunk sizes with rollbacks and re-decodes in between give the logits of one full
    forward of the final sequence: rollback is only arithmetic on the length, and stale slots
    past the length are never read."""
    model = tiny_model(seed=1)
    V = model.args.vocab_size
    rng = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    final = torch.randint(0, V, (data.draw(st.integers(2, 60)),), generator=rng).tolist()
    cache = model.new_cache(1)
    done = 0
    logits_at = {}
    while done < len(final):
        n = data.draw(st.integers(1, min(8, len(final) - done)))
        if data.draw(st.booleans()):  # decode garbage, then roll it back
            junk = torch.randint(0, V, (n,), generator=rng).view(1, n)
            model.forward(junk, torch.arange(done, done + n).view(1, n), cache)
            cache.advance(0, n)
            cache.rollback(0, n)
        chunk = torch.tensor([final[done:done + n]])
        out = model.forward(chunk, torch.arange(done, done + n).view(1, n), cache)[0]
        for j in range(n):
            logits_at[done + j] = out[j]
        cache.advance(0, n)
        done += n
    full = _full(model, final)
    got = torch.stack([logits_at[i] for i in range(len(final))])
    assert (got - full).abs().max() < 1e-4


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=4), seed=st.integers(0, 1000))
def test_batched_rows_of_different_lengths_equal_each_row_alone(lengths, seed):
    """Rows at different lengths in one batch (prefill padded, then one decode step each) give
    the same logits as each row run alone."""
    model = tiny_model(seed=2, arch="qwen2")
    V, B, T = model.args.vocab_size, len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n + 1,), generator=g).tolist() for n in lengths]
    cache = model.new_cache(B)
    tok = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        tok[b, :lengths[b]] = torch.tensor(s[:-1])
    pos = torch.arange(T).repeat(B, 1)
    model.forward(tok, pos, cache)  # pads write past each row's length: stale, never read
    for b, n in enumerate(lengths):
        cache.set_length(b, n)
    step_tok = torch.tensor([[s[-1]] for s in seqs])
    step_pos = torch.tensor([[n] for n in lengths])
    batched = model.forward(step_tok, step_pos, cache)[:, 0]
    for b, s in enumerate(seqs):
        alone = _full(model, s)[-1]
        assert (batched[b] - alone).abs().max() < 1e-4


def test_explicit_causal_mask_equals_default():
    """An explicit lower-triangular mask over the new tokens is the default causal attention;
    a different mask changes the result (so the mask is really used)."""
    model = tiny_model(seed=4)
    ids = list(range(5, 17))
    cache = model.new_cache(1)
    model.forward(torch.tensor([ids[:6]]), torch.arange(6).view(1, 6), cache)
    cache.advance(0, 6)
    new = torch.tensor([ids[6:]])
    pos = torch.arange(6, 12).view(1, 6)
    causal = model.forward(new, pos, cache)
    tril = torch.tril(torch.ones(6, 6, dtype=torch.bool)).unsqueeze(0)
    assert torch.allclose(model.forward(new, pos, cache, mask=tril), causal, atol=1e-5)
    diag = torch.eye(6, dtype=torch.bool).unsqueeze(0)  # each new token sees only history + itself
    other = model.forward(new, pos, cache, mask=diag)
    assert torch.allclose(other[:, 0], causal[:, 0], atol=1e-5)
    assert not torch.allclose(other[:, 1:], causal[:, 1:], atol=1e-3)


def test_return_hidden_gives_final_hidden_states():
    model = tiny_model(seed=5)
    cache = model.new_cache(1)
    logits, hidden = model.forward(torch.tensor([[1, 2, 3]]), torch.arange(3).view(1, 3), cache,
                                   return_hidden=True)
    assert hidden.shape == (1, 3, model.args.dim)
    assert torch.allclose(hidden @ model.lm_head.dense.float().T if hasattr(model.lm_head, "dense") else hidden,
                          logits, atol=1e-4)


def test_logits_at_selects_positions_bit_exactly_and_skips_the_head():
    """`logits_at` computes the output head on the chosen positions only: bit-identical to the
    same rows of the full [B, T, V] logits (the kernel is batch-invariant), the same KV written,
    and n = 0 returns no logits (a prefill)."""
    model = tiny_model(seed=5, vocab=200, dim=64, layers=2)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, 200, (2, 9), generator=g)
    pos = torch.arange(9).repeat(2, 1)
    c_full, c_sel, c_none = (model.new_cache(2) for _ in range(3))
    full = model.forward(tok, pos, c_full)
    at = torch.tensor([[8, 3], [0, 5]])
    sel = model.forward(tok, pos, c_sel, logits_at=at)
    assert sel.shape == (2, 2, 200)
    assert torch.equal(sel[0], full[0, [8, 3]]) and torch.equal(sel[1], full[1, [0, 5]])
    none = model.forward(tok, pos, c_none, logits_at=torch.zeros(2, 0, dtype=torch.long))
    assert none.shape == (2, 0, 200)
    for (k1, v1), (k2, v2), (k3, v3) in zip(c_full.layers, c_sel.layers, c_none.layers):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(k1, k3) and torch.equal(v1, v3)
