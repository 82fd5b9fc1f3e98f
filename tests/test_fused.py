"""The fused per-layer ops (specdec/runtime/kernels/fused.cpp) against the torch reference beside them.

Tolerances: the elementwise arithmetic is the reference's operation for operation, so the residual
add, the values written to the cache and the rotated keys are compared exactly (torch.equal).
The reductions (RMSNorm's sum of squares, q.k dot products, softmax sums) run in a different
order and exp is a different ~1-ulp polynomial, so normalised outputs, silu and attention agree
to fp32 rounding: rtol 1e-5 with atol 1e-6 on O(1) values (a wrong slot, head or sign gives O(1)
errors).  Batch invariance is exact: a row's bits do not depend on the other rows, on T, on the
cache rows used or on the thread count.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from specdec.runtime.kernels import fused
from specdec.runtime.model import rope_tables

pytestmark = pytest.mark.skipif(not fused.available(), reason="fused extension did not build here")


@contextlib.contextmanager
def _kernel_env(value):
    old = os.environ.get("SPECDEC_KERNEL")
    os.environ["SPECDEC_KERNEL"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["SPECDEC_KERNEL"]
        else:
            os.environ["SPECDEC_KERNEL"] = old


def _plan(fast, positions, rows, mask, cos, sin):
    with _kernel_env("auto" if fast else "torch"):
        step = fused.plan(positions, rows, mask, cos, sin)
    assert step.fast == fast
    return step


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 700), with_d=st.booleans(), seed=st.integers(0, 999))
def test_add_rms_norm_matches_torch(rows, cols, with_d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    d = torch.randn(rows, cols, generator=g) if with_d else None
    w = 1 + 0.1 * torch.randn(cols, generator=g)
    x_fast, x_ref = x.clone(), x.clone()
    h_fast = fused.add_rms_norm(x_fast, d, w, 1e-5, fast=True)
    h_ref = fused.add_rms_norm(x_ref, d, w, 1e-5, fast=False)
    assert torch.equal(x_fast, x_ref)  # the residual add, in place, exactly
    torch.testing.assert_close(h_fast, h_ref, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), inter=st.integers(1, 400), seed=st.integers(0, 999))
def test_silu_mul_matches_torch(rows, inter, seed):
    g = torch.Generator().manual_seed(seed)
    gu = 4 * torch.randn(rows, 2 * inter, generator=g)
    gu[0, 0] = -100.0  # exp overflow side: silu -> -0
    torch.testing.assert_close(fused.silu_mul(gu, fast=True), fused.silu_mul(gu, fast=False),
                               rtol=1e-5, atol=1e-6)


def _attend_case(data):
    """Random shapes, history lengths, cache rows and (sometimes) a mask over the new tokens."""
    B = data.draw(st.integers(1, 3), "B")
    T = data.draw(st.integers(1, 6), "T")
    Hkv = data.draw(st.integers(1, 3), "Hkv")
    H = Hkv * data.draw(st.integers(1, 6), "group")
    D = data.draw(st.sampled_from([2, 6, 8, 10, 16, 64, 128]), "D")
    seed = data.draw(st.integers(0, 9999), "seed")
    g = torch.Generator().manual_seed(seed)
    Bc, cap = B + 1, 48
    starts = [data.draw(st.integers(0, cap - T), f"start{b}") for b in range(B)]
    positions = torch.tensor([[s + t for t in range(T)] for s in starts])  # [B, T]
    rows = torch.randperm(Bc, generator=g)[:B] if data.draw(st.booleans(), "rows") else None
    mask = None
    if data.draw(st.booleans(), "mask"):
        mask = torch.rand(B, T, T, generator=g) < 0.5
        mask |= torch.eye(T, dtype=torch.bool)  # each new token sees itself: no empty row
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)
    kc = torch.randn(Bc, Hkv, cap, D, generator=g)
    vc = torch.randn(Bc, Hkv, cap, D, generator=g)
    cos, sin = rope_tables(D, cap, 10000.0)
    return qkv, positions, rows, mask, kc, vc, H, Hkv, cos, sin


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_attend_matches_torch(data):
    """RoPE + cache write + GQA attention against the model's previous op-by-op code."""
    qkv, positions, rows, mask, kc, vc, H, Hkv, cos, sin = _attend_case(data)
    kf, vf, kr, vr = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    o_fast = fused.attend(_plan(True, positions, rows, mask, cos, sin), qkv, kf, vf, H, Hkv)
    o_ref = fused.attend(_plan(False, positions, rows, mask, cos, sin), qkv, kr, vr, H, Hkv)
    assert torch.equal(vf, vr) and torch.equal(kf, kr)  # same slots, same rounded products
    torch.testing.assert_close(o_fast, o_ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_attend_rows_are_batch_invariant(data):
    """Each (batch row, token) computed alone -- T = 1, B = 1, one thread -- gives the bits of the
    batched call: what greedy speculative == plain decoding needs under quantised weights."""
    qkv, positions, rows, mask, kc, vc, H, Hkv, cos, sin = _attend_case(data)
    B, T, _ = qkv.shape
    kb, vb = kc.clone(), vc.clone()
    batched = fused.attend(_plan(True, positions, rows, mask, cos, sin), qkv, kb, vb, H, Hkv)
    rows = torch.arange(B) if rows is None else rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in range(B):
            k1, v1 = kb.clone(), vb.clone()  # the block's keys are in place, as after the batch
            for t in range(T):
                if mask is not None and not (mask[b, t, :t].all() and not mask[b, t, t + 1:].any()):
                    continue  # this row of a tree mask is not a causal prefix: no 1-row equivalent
                one = fused.attend(_plan(True, positions[b:b + 1, t:t + 1], rows[b:b + 1], None, cos, sin),
                                   qkv[b:b + 1, t:t + 1].contiguous(), k1, v1, H, Hkv)
                assert torch.equal(one[0, 0], batched[b, t])
    finally:
        torch.set_num_threads(threads)


def test_attend_rejects_positions_outside_the_cache():
    cos, sin = rope_tables(8, 64, 10000.0)
    qkv = torch.randn(1, 1, 3 * 8)
    kc = vc = torch.zeros(1, 1, 16, 8)
    step = _plan(True, torch.tensor([[16]]), None, None, cos, sin)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.attend(step, qkv, kc, vc, 1, 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_forward_fast_equals_fallback(arch):
    """A whole forward (prefill, then a 4-token verify block with a mask, on two cache rows) with
    the extension and under SPECDEC_KERNEL=torch, where the extension is never called."""
    model = tiny_model(seed=6, arch=arch)
    V = model.args.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (2, 12), generator=g)
    block = torch.randint(0, V, (2, 4), generator=g)
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(2, 4, 4)
    rows = torch.tensor([2, 0])

    def run():
        cache = model.new_cache(3)
        a = model.forward(prompt, torch.arange(12).repeat(2, 1), cache, rows=rows)
        b = model.forward(block, torch.arange(12, 16).repeat(2, 1), cache, mask=mask, rows=rows)
        return a, b, cache

    fa, fb, fc = run()
    saved = fused._ext
    fused._ext = None  # any call into the extension would now fail
    try:
        with _kernel_env("torch"):
            ra, rb, rc = run()
    finally:
        fused._ext = saved
    torch.testing.assert_close(fa, ra, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, rb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc.k, rc.k, rtol=1e-5, atol=1e-5)
    assert torch.equal(fc.k[:, 1], torch.zeros_like(fc.k[:, 1]))  # row 1 was never used


def test_failed_build_falls_back(monkeypatch):
    """No extension (a failed build): plan says so once, and the forward runs on torch ops."""
    monkeypatch.setattr(fused, "_ext", None)
    monkeypatch.setattr(fused, "_tried", True)
    monkeypatch.delenv("SPECDEC_KERNEL", raising=False)
    model = tiny_model(seed=7)
    step = fused.plan(torch.tensor([[0, 1]]), None, None, model.cos, model.sin)
    assert not step.fast and step.allowed is not None
    out = model.forward(torch.tensor([[3, 4]]), torch.tensor([[0, 1]]), model.new_cache(1))
    assert out.shape == (1, 2, model.args.vocab_size) and torch.isfinite(out).all()


def test_fallback_matches_sdpa_reference():
    """The fallback is the plain formula: RoPE by rotate-half, then masked softmax attention."""
    cos, sin = rope_tables(8, 32, 10000.0)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 3, (2 + 2) * 8, generator=g)
    kc, vc = torch.zeros(1, 1, 32, 8), torch.zeros(1, 1, 32, 8)
    pos = torch.tensor([[0, 1, 2]])
    out = fused.attend(_plan(False, pos, None, None, cos, sin), qkv, kc, vc, 2, 1)
    q, k, v = qkv.view(3, 4, 8)[:, :2], qkv.view(3, 4, 8)[:, 2], qkv.view(3, 4, 8)[:, 3]
    c, s = cos[:3].repeat(1, 2), sin[:3].repeat(1, 2)  # [T, D]: x * cos + rotate_half(x) * sin
    q = q * c[:, None] + torch.cat((-q[..., 4:], q[..., :4]), -1) * s[:, None]  # [T, H, D]
    k = k * c + torch.cat((-k[..., 4:], k[..., :4]), -1) * s  # [T, D]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.expand(2, 3, 8), v.expand(2, 3, 8),
                                         is_causal=True)  # [H, T, D]
    torch.testing.assert_close(out[0], ref.transpose(0, 1).reshape(3, 16), rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_attend_grouped_equals_per_query(data):
    """Causal attention without a mask runs the grouped path (query tiles sharing a KV head);
    the same causal pattern given as an explicit mask runs it with each query's list of visible
    slots (a draft tree's way, attend_tile's vis).  Same bits."""
    qkv, positions, rows, _, kc, vc, H, Hkv, cos, sin = _attend_case(data)
    B, T, _ = qkv.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    grouped = fused.attend(_plan(True, positions, rows, None, cos, sin), qkv, k1, v1, H, Hkv)
    per_query = fused.attend(_plan(True, positions, rows, causal, cos, sin), qkv, k2, v2, H, Hkv)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(grouped, per_query)


def _prompt_case(seed, T, history, Hkv, H, D):
    """A prompt chunk's inputs: T new tokens at positions history .. history + T - 1 of one cache
    row (random qkv, keys, values), its RoPE tables and its causal mask [1, T, T]."""
    g = torch.Generator().manual_seed(seed)
    cap = history + T + 8
    qkv = torch.randn(1, T, (H + 2 * Hkv) * D, generator=g)
    kc = torch.randn(1, Hkv, cap, D, generator=g)
    vc = torch.randn(1, Hkv, cap, D, generator=g)
    cos, sin = rope_tables(D, cap, 10000.0)
    positions = torch.arange(history, history + T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    return qkv, kc, vc, cos, sin, positions, causal


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 90), history=st.integers(0, 70), Hkv=st.integers(1, 3), group=st.integers(1, 7),
       D=st.sampled_from([8, 16, 24, 64, 128]), seed=st.integers(0, 9999))
def test_attend_prompt_chunks_are_batch_invariant_at_any_thread_count(T, history, Hkv, group, D, seed):
    """A prompt chunk (T new tokens after a history: the shapes prefill runs) at 1, 2 and 3
    threads (the items cut into runs of equal work; the score pass four keys at a time, their
    sums in one hsum4; partial last quads and tiles) gives the bits of each of its queries
    computed alone (T = 1 over the same cache, as decoding would) and of the chunk under an
    explicit causal mask.  Negative control: one query (seeing 2+ slots) moved by 1e-3 must
    change that query's output and no other (position, head)'s."""
    H = Hkv * group
    qkv, kc, vc, cos, sin, positions, causal = _prompt_case(seed, T, history, Hkv, H, D)

    def run(x=qkv, mask=None, threads=2, pos=positions, k=kc, v=vc):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return fused.attend(_plan(True, pos, None, mask, cos, sin), x, k, v, H, Hkv)
        finally:
            torch.set_num_threads(old)

    kk, vv = kc.clone(), vc.clone()
    ref = run(k=kk, v=vv, threads=1)  # (kk, vv now hold the chunk's keys and values)
    for threads in (1, 2, 3):
        assert torch.equal(run(k=kc.clone(), v=vc.clone(), threads=threads), ref), f"{threads} threads"
    assert torch.equal(run(mask=causal, k=kc.clone(), v=vc.clone()), ref)
    for t in sorted({0, T // 3, T // 2, T - 1}):
        one = run(qkv[:, t:t + 1].contiguous(), pos=positions[:, t:t + 1], k=kk.clone(), v=vv.clone(), threads=1)
        assert torch.equal(one[0, 0], ref[0, t]), f"position {t} alone"
    t, h = T - 1, H - 1  # a query that sees history + T slots (one slot: its output is that value)
    if history + T < 2:
        return
    moved = qkv.clone()
    moved[0, t, h * D:(h + 1) * D] *= 1.001
    diff = (run(moved, k=kc.clone(), v=vc.clone()) != ref)[0].view(T, H, D).any(-1)  # [T, H]
    assert diff[t, h], "moving a query did not change its output"
    diff[t, h] = False
    assert not diff.any(), "moving one query changed another query's output"


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


@pytest.mark.parametrize("T,group,D,history", [(37, 6, 128, 90), (5, 7, 64, 200), (64, 3, 64, 0), (13, 6, 16, 31)])
def test_attend_avx512_tile_equals_the_256_bit_tile(T, group, D, history):
    """On AVX-512 the grouped path runs tiles of 12 queries with two keys per zmm (scores) and 16
    output lanes per zmm; each lane's arithmetic is the 256-bit tile's, so the bits are the same:
    against SPECDEC_KERNEL=avx2 (the 256-bit tile, also of 12, its output pass in two parts of up
    to 6) and against an explicit causal mask (each query's list of visible slots), on prompt-like shapes (T new tokens after a history, partial last tiles).
    Negative control: one history key perturbed by 0.01 must change the output of every query of
    its KV head's query heads and of no other head."""
    ext = fused.build()
    if ext is None:
        pytest.skip("no fused extension on this CPU")
    wide = {"avx512f", "avx512dq", "avx512vl"} <= _cpu_flags()
    assert ext.attend_tile_queries() == 12
    with _kernel_env("avx2"):
        assert ext.attend_tile_queries() == 12
    if not wide:
        pytest.skip("this CPU has no AVX-512: the 256-bit tile is the only one (tested above)")
    Hkv = 2
    H = Hkv * group
    qkv, kc, vc, cos, sin, positions, causal = _prompt_case(T * 1000 + D, T, history, Hkv, H, D)

    def run(kernel, mask=None, k=kc):
        kk, vv = k.clone(), vc.clone()
        with _kernel_env(kernel):
            return fused.attend(_plan(True, positions, None, mask, cos, sin), qkv, kk, vv, H, Hkv)

    wide_out = run("auto")
    assert torch.equal(wide_out, run("avx2"))
    assert torch.equal(wide_out, run("auto", causal))
    if history:
        k2 = kc.clone()
        k2[0, 1, history - 1, 0] += 0.01  # a history key of KV head 1: every query of its heads sees it
        moved = run("auto", k=k2).view(T, H, D) != wide_out.view(T, H, D)
        assert moved[:, group:].any(dim=-1).all() and not moved[:, :group].any()
