"""specdec.runtime.kernels.quant: GGUF-quantised weights in the few-row matmul.

What is checked, and why the tolerances are right:
* Repacking loses nothing: `unpack(pack(blocks))` equals `gguf.quants.dequantize(blocks)` bit
  for bit, for every supported block type, on random blocks (every code and scale bit pattern;
  the fp16 scale fields are set to finite values) and on real rows of SmolLM2-135M.
* The kernel computes exactly "GGUF weights x int8 activation blocks": against a float64
  reference built from the same integers (x^ = dx * xq from `quantise_activations` with the
  format's activation block: 32, or for the K-quants 256 refined per 32 by a power of two;
  w = ws * q + wm with the format's
  scales, exact in fp32: an fp16 times a <= 8-bit integer), the only differences are the
  kernel's own fp32 roundings: per 32-element block one product and two FMAs per output; per
  256-element K-quant record at most two int->float conversions, two products and two FMAs
  (the integer sums are exact).  So with nsub 16/32-element sub-blocks (nsub >= 3 records)
  |y - y64| <= (3 nsub + 2) u sum_k |x^_k| (|ws q_k| + |wm|)  (u = 2^-24, gamma bound).  A
  mis-decoded bit or mis-paired scale is off by at least |ws * x^| ~ 1e-2 relative, orders
  above this.
* Against F.linear on the dequantised fp32 weight with the *unquantised* x, the difference is
  the activation rounding, |x - x^| <= dx / 2 per element, so
  |y - F.linear(x, W)| <= sum_b (dx_b / 2) sum_{k in b} |W_k| + the fp32 term above.
  That is the model change `--dtype native` makes (the target is the model as this kernel
  computes it), stated as a bound rather than a measured constant.
* Batch invariance is exact: each row of an M-row call (M = 1..16, and 40) is torch.equal to the
  row computed alone, with 1 and 2 threads (and the AVX-512 path, where the CPU has it).
* The torch fallback (SPECDEC_KERNEL=torch) computes the same math: it quantises x to the same
  bits as the kernel and then multiplies in fp32, so it agrees within the fp32 bound.
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.runtime.kernels as K
from specdec.runtime.kernels.extension import cpu_has_avx2_fma
from specdec.runtime.kernels import quant as Q

U = 2.0**-24
TYPES = list(Q.QUANT_TYPES)
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


@pytest.fixture(scope="module", autouse=True)
def _auto_dispatch():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPECDEC_KERNEL", raising=False)
        yield


def have_kernel() -> bool:
    ok = K.kernel_available() and Q._qext() is not None
    if platform.machine().lower() in ("x86_64", "amd64") and cpu_has_avx2_fma():
        assert ok, "quantised C++ kernel failed to build on an AVX2+FMA x86 CPU"
    return ok


def random_blocks(qtype: str, n: int, k: int, seed: int, scale: float = 0.02) -> Q.QuantTensor:
    """Random GGUF blocks: random bytes (every code/scale pattern), finite fp16 scale fields."""
    f = Q.QUANT_TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // f.block, f.tsize), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((n, k // f.block)) * scale).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // f.block, 2)
    return Q.QuantTensor(qtype, raw.reshape(n, -1), (n, k))


def exact_terms(qt: Q.QuantTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """float64 (W = ws * q + wm exactly, |ws q| + |wm|, sub-blocks per row) as the kernel sees W."""
    n, k = qt.shape
    f = Q.QUANT_TYPES[qt.qtype]
    q, fields = Q._decode_blocks(qt)
    fl = [torch.from_numpy(a.astype(np.float32)) for a in fields]  # fp32 scales, as the kernel forms
    if qt.qtype == "Q4_K":
        ws, wm = fl[0] * fl[2], -(fl[1] * fl[3])
    elif qt.qtype == "Q6_K":
        ws = fl[0] * fl[1]
        wm = -32 * ws
    elif qt.qtype == "Q4_1":
        ws, wm = fl
    else:
        ws = fl[0]
        wm = {"Q8_0": 0, "Q4_0": -8, "Q5_0": -16}[qt.qtype] * ws
    codes = torch.from_numpy(q.view(np.int8) if qt.qtype == "Q8_0" else q).double().view(n, -1, f.sb)
    ws, wm = ws.double().reshape(n, -1, 1), wm.double().reshape(n, -1, 1)
    w = (ws * codes + wm).view(n, k)
    a = ((ws * codes).abs() + wm.abs()).view(n, k)
    return w, a, k // f.sb


def check_against_exact(y: torch.Tensor, x: torch.Tensor, qt: Q.QuantTensor, bias=None) -> None:
    w, a, nsub = exact_terms(qt)
    xh = Q.quantise_activations(x, Q.activation_block(qt.qtype)).double()
    y64 = xh @ w.T + (0 if bias is None else bias.double())
    tol = (3 * nsub + 2) * U * (xh.abs() @ a.T + (0 if bias is None else bias.double().abs()))
    err = (y.double() - y64).abs()
    assert (err <= tol + 1e-30).all(), float((err - tol).max())


@pytest.mark.parametrize("qtype", TYPES)
def test_unpack_equals_gguf_dequantize(qtype):
    f = Q.QUANT_TYPES[qtype]
    for n, k, seed in [(16, f.rk, 0), (37, 3 * f.rk, 1), (1, 2 * f.rk, 2)]:
        qt = random_blocks(qtype, n, k, seed)
        got = Q.unpack(Q.pack(qt), qtype, n)
        assert torch.equal(got, qt.dequantize()), (n, k)
        if qtype == "Q6_K":  # the AVX2 routine's layout too
            packed = Q.pack(qt, q6k_avx2=True)
            assert packed.shape == Q.pack(qt).shape
            assert torch.equal(Q.unpack(packed, qtype, n, q6k_avx2=True), qt.dequantize()), (n, k)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_tall_matrix_packs_in_chunks_to_the_same_records(qtype, monkeypatch):
    """A matrix taller than PACK_ROWS (an output head) is packed PACK_ROWS rows at a time, to
    bound pack's temporaries: whole 16-row panels, so the records are those of one pack."""
    monkeypatch.setattr(Q, "PACK_ROWS", 32)
    qt = random_blocks(qtype, 32 * 3 + 7, Q.QUANT_TYPES[qtype].rk, 3)
    for avx2 in (False, True):
        chunked = Q.pack(qt, avx2)
        monkeypatch.setattr(Q, "PACK_ROWS", 1 << 30)
        assert torch.equal(chunked, Q.pack(qt, avx2))
        monkeypatch.setattr(Q, "PACK_ROWS", 32)


def test_q6k_layouts_give_the_same_bits():
    """Q6_K's two layouts (low + high planes, and Q6_K2's three-vector k-step pairs) through the
    AVX2 routine: the same codes, so the same integer sums and the same bits, M = 1..16.
    Negative control: one code changed in the Q6_K2 records changes the output."""
    if not have_kernel():
        pytest.skip("no C++ kernel on this machine")
    n, k = 40, 512
    qt = random_blocks("Q6_K", n, k, 7)
    planes, pairs = Q.pack(qt), Q.pack(qt, q6k_avx2=True)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    for m in range(1, 17):
        a = Q._ext.qlinear(x[:m], [planes], [Q.QUANT_TYPES["Q6_K"].fid], [n], None, 2, 2)
        b = Q._ext.qlinear(x[:m], [pairs], [Q.Q6_K2_FID], [n], None, 2, 2)
        assert torch.equal(a, b), m
    bad = pairs.clone()
    bad[0, 0, -1] ^= 0x80  # a high bit of the last pair's fourth code (output 15, a real row)
    assert not torch.equal(Q._ext.qlinear(x, [bad], [Q.Q6_K2_FID], [n], None, 2, 2),
                           Q._ext.qlinear(x, [pairs], [Q.Q6_K2_FID], [n], None, 2, 2))


def test_unpack_equals_gguf_on_real_rows():
    """Real SmolLM2-135M rows (Q4_1 matrices, Q8_0 embedding) round-trip bit for bit."""
    from gguf import GGUFReader

    from specdec.runtime.hub import model_path

    r = GGUFReader(str(model_path("smollm2-135m")))
    seen = set()
    for t in r.tensors:
        qtype = t.tensor_type.name
        if qtype in Q.QUANT_TYPES and qtype not in seen:
            seen.add(qtype)
            n, k = min(int(t.shape[1]), 50), int(t.shape[0])
            qt = Q.QuantTensor(qtype, np.asarray(t.data[:n]), (n, k))
            assert torch.equal(Q.unpack(Q.pack(qt), qtype, n), qt.dequantize()), t.name
    assert seen == {"Q4_1", "Q8_0"}


def isas() -> list[int]:
    return list(Q._ext.isas()) if Q._ext is not None else [2]


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 70), blocks=st.integers(1, 3),
       m=st.integers(1, 16), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_kernel_exact_math_and_batch_invariance(qtype, n, blocks, m, bias, seed):
    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    f = Q.QUANT_TYPES[qtype]
    k = blocks * f.rk
    qt = random_blocks(qtype, n, k, seed)
    qw = Q.prepare_quant([qt])
    g = torch.Generator().manual_seed(seed)
    block_scale = torch.rand(m, k // 32, 1, generator=g).expand(m, k // 32, 32).reshape(m, k)
    x = torch.randn(m, k, generator=g) * block_scale  # blocks of different magnitude
    b = torch.randn(n, generator=g) if bias else None
    y = K.linear(x, qw, b)
    check_against_exact(y, x, qt, b)
    # the model change native makes: activation rounding, bounded per block
    W = qt.dequantize().double()
    blk = Q.activation_block(qtype)
    dx = x.abs().view(m, -1, blk).amax(-1) / 127  # [m, K/blk]
    act = (dx.double().repeat_interleave(blk, 1) / 2) @ W.abs().T
    _, a, nsub = exact_terms(qt)
    ref = x.double() @ W.T + (0 if b is None else b.double())
    tol = act * (1 + 1e-6) + (3 * nsub + 2 + k) * U * (x.double().abs() @ a.T + 1)
    assert ((y.double() - ref).abs() <= tol).all()
    for isa in isas():
        for nt in (1, 2):
            for i in range(m):
                yi = Q._ext.qlinear(x[i:i + 1].contiguous(), qw.packed, list(qw.fids), [n], b, nt, isa)
                assert torch.equal(yi[0], y[i]), (isa, nt, i)


# Byte ranges of each block type that hold weight codes (GGUF layout), and the byte that puts
# every code at its extreme: the largest integer sums the kernel can form.
CODE_BYTES = {"Q8_0": [(2, 34)], "Q4_0": [(2, 18)], "Q4_1": [(4, 20)], "Q5_0": [(2, 22)],
              "Q4_K": [(16, 144)], "Q6_K": [(0, 192)]}


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("code_byte", [0xFF, 0x80, 0x00])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_kernel_extreme_codes_do_not_saturate(qtype, code_byte, sign):
    """Every code at its maximum (0xFF; Q8_0: -1, and 0x80 = -128) or zero (Q6_K: q - 32 = -32,
    the largest offset code) against |xq| = 127 of one sign in every position: the integer sums
    reach their bound (the AVX2 path adds up to 8 k-steps of maddubs results in int16 before
    widening; Q6_K's wrap and are offset back).  Any saturation or wrong wrap-around would be
    off by far more than the fp32 tolerance of check_against_exact."""
    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    f = Q.QUANT_TYPES[qtype]
    n, k = 19, 2 * f.rk
    qt = random_blocks(qtype, n, k, seed=7)
    raw = qt.raw.reshape(n, k // f.block, f.tsize).copy()
    for a, b in CODE_BYTES[qtype]:
        raw[..., a:b] = code_byte
    qt = Q.QuantTensor(qtype, raw.reshape(n, -1), (n, k))
    qw = Q.prepare_quant([qt])
    x = torch.full((5, k), sign)
    x[1] *= torch.linspace(0.5, 1.0, k)  # still one sign, |xq| up to 127
    y = K.linear(x, qw)
    check_against_exact(y, x, qt)
    for isa in isas():
        for i in range(5):
            yi = Q._ext.qlinear(x[i:i + 1].contiguous(), qw.packed, list(qw.fids), [n], None, 1, isa)
            assert torch.equal(yi[0], y[i]), (isa, i)


# Byte ranges of the K-quants' sub-block scale fields (GGUF layout) and the bytes that put them
# at their extremes: Q4_K's 6-bit scales and mins all 63 (0xFF), Q6_K's int8 scales -128 (0x80).
SCALE_BYTES = {"Q4_K": ((4, 16), 0xFF), "Q6_K": ((192, 208), 0x80)}


@pytest.mark.parametrize("code_byte", [0xFF, 0x00])
@pytest.mark.parametrize("m", [9, 13, 40, 100])
def test_wide_k_quant_routine_at_its_bounds(code_byte, m):
    """The AVX-512 routine for calls of more than 8 rows of K-quants (groups of up to 12 rows,
    scales shifted by each row's block exponent, Q6_K's offset folded into int16 pairs, see
    avx512::panel_wide) forms each record's integer sum in another order than the narrow
    routines: here at its bounds, with every code and every sub-block scale at its extreme, a
    Q4_K and a Q6_K segment fused in one call, |xq| = 127 and 32-blocks 1, 1/2, 1/4, 1/8 and 1/16
    of the row's largest (every exponent 0..3).  Each row equals the row computed alone on the
    AVX2 routine, bit for bit, and the exact math within its bound; a wrong wrap, an int16 pair
    out of range or a row of another group would be off by far more."""
    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    k = 1024
    parts = []
    for i, qtype in enumerate(("Q4_K", "Q6_K")):
        f = Q.QUANT_TYPES[qtype]
        n = 21 + 12 * i
        raw = random_blocks(qtype, n, k, seed=11 + i).raw.reshape(n, k // f.block, f.tsize).copy()
        for a, b in CODE_BYTES[qtype]:
            raw[..., a:b] = code_byte
        (a, b), v = SCALE_BYTES[qtype]
        raw[..., a:b] = v
        parts.append(Q.QuantTensor(qtype, raw.reshape(n, -1), (n, k)))
    qw = Q.prepare_quant(parts)
    g = torch.Generator().manual_seed(m)
    sign = torch.where(torch.rand(m, 1, generator=g) < 0.5, -1.0, 1.0)
    blocks = torch.tensor([1.0, 0.5, 0.25, 0.125, 0.0625]).repeat(k // 32 // 5 + 1)[: k // 32]
    x = sign * blocks.repeat_interleave(32) * (1 + 0.01 * torch.rand(m, k, generator=g))
    call = lambda xx, isa, nt=2: Q._ext.qlinear(xx.contiguous(), qw.packed, list(qw.fids), [p.shape[0] for p in parts],
                                               None, nt, isa)
    y = call(x, 0)
    o = 0
    for p in parts:
        check_against_exact(y[:, o:o + p.shape[0]], x, p)
        o += p.shape[0]
    for isa in isas():
        assert torch.equal(call(x, isa), y), isa
        assert torch.equal(call(x, isa, 1), y), isa
    for i in range(m):
        assert torch.equal(call(x[i:i + 1], 2, 1)[0], y[i]), i


@pytest.mark.parametrize("qtype", TYPES)
def test_fused_segments_many_rows_and_fallback(qtype, monkeypatch):
    """Mixed-format row blocks in one call (as q/k/v fuse), M = 40 rows, bias; the torch
    fallback agrees within the fp32 bound, and the kernel rows equal the M = 1 rows."""
    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    k = 256
    parts = [random_blocks(qtype, 24, k, 3), random_blocks("Q8_0", 8, k, 4), random_blocks("Q6_K", 33, k, 5)]
    qw = Q.prepare_quant(parts)
    x = torch.randn(40, k)
    b = torch.randn(qw.n)
    y = K.linear(x.view(4, 10, k), qw, b).view(40, -1)
    o = 0
    for p in parts:
        check_against_exact(y[:, o:o + p.shape[0]], x, p, b[o:o + p.shape[0]])
        o += p.shape[0]
    assert all(torch.equal(K.linear(x[i], qw, b), y[i]) for i in (0, 17, 39))
    monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    yf = K.linear(x, qw, b)
    _, a, _ = zip(*(exact_terms(p) for p in parts))
    xa = torch.cat([Q.quantise_activations(x, Q.activation_block(p.qtype)).double().abs() @ ap.T
                    for p, ap in zip(parts, a)], 1)  # each row block multiplies its own x^
    tol = (k + 8) * U * (xa + b.double().abs())
    assert ((yf.double() - y.double()).abs() <= 2 * tol).all()


def test_fallback_without_kernel_matches(monkeypatch):
    """Prepared under SPECDEC_KERNEL=torch: dequantised fp32 storage, same math."""
    qt = random_blocks("Q4_K", 40, 512, 7)
    monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    qw = Q.prepare_quant([qt])
    assert qw.packed is None and torch.equal(qw.dense, qt.dequantize())
    x = torch.randn(3, 512)
    y = K.linear(x, qw)
    xh = Q.quantise_activations(x, 256)
    assert torch.allclose(y, F.linear(xh, qt.dequantize()), rtol=0, atol=1e-4)
    assert not torch.allclose(y, F.linear(Q.quantise_activations(x, 32), qt.dequantize()),
                              rtol=0, atol=1e-4)  # the K-quants' activation block is 256


def test_quantise_activations_matches_kernel_rounding():
    """Half-way cases round to even in both, and an all-zero block stays zero."""
    x = torch.zeros(2, 64)
    x[0, :32] = torch.arange(32) - 15.5  # many x * 127 / amax land near .5
    x[1, 32:] = torch.linspace(-3, 3, 32)
    xh = Q.quantise_activations(x)
    assert torch.equal(xh[0, 32:], torch.zeros(32)) and torch.equal(xh[1, :32], torch.zeros(32))
    if have_kernel():  # with W = identity-like Q8_0 rows the kernel returns x^ itself
        raw = np.zeros((64, 2, 34), np.uint8)
        raw[..., :2] = np.array([1.0], np.float16).view(np.uint8)
        for i in range(64):
            raw[i, i // 32, 2 + i % 32] = 1
        qw = Q.prepare_quant([Q.QuantTensor("Q8_0", raw.reshape(64, -1), (64, 64))])
        assert torch.equal(K.linear(x, qw), xh)


@pytest.mark.skipif(not have_kernel(), reason="no C++ kernel on this CPU")
@pytest.mark.parametrize("k", [256, 2048])
def test_kernel_activation_quantiser_matches_torch_random(k):
    """The kernel's vectorised quantiser (max, round-to-even, int8 packing, sums) against the
    torch definition, on identity-like Q8_0 rows: random blocks of every magnitude, exact
    halves, all-zero blocks, M = 1..7.  A lane-order or rounding slip changes y.  At k = 2048
    most calls have M * K >= 8192, where the threads split the blocks between them: one
    thread's share quantised wrongly or twice changes y too."""
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[..., :2] = np.array([1.0], np.float16).view(np.uint8)
    for i in range(k):
        raw[i, i // 32, 2 + i % 32] = 1
    qw = Q.prepare_quant([Q.QuantTensor("Q8_0", raw.reshape(k, -1), (k, k))])
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        m = 1 + trial % 7
        scale = torch.rand(m, k // 32, 1, generator=g).expand(m, k // 32, 32).reshape(m, k)
        x = torch.randn(m, k, generator=g) * scale * 10.0 ** (trial % 5 - 2)
        if trial % 3 == 0:
            x = (x * 4).round() / 4  # many x * 127 / amax on exact halves
        if trial % 4 == 0:
            x[:, 32:64] = 0
        ref = Q.quantise_activations(x)
        assert torch.equal(K.linear(x, qw), ref), trial
        for nt in (1, 2, 3):
            assert torch.equal(Q._ext.qlinear(x, qw.packed, list(qw.fids), [k], None, nt, 2), ref), (trial, nt)


def identity_kquant(qtype: str, k: int) -> Q.QuantTensor:
    """A K-quant [k, k] identity built from raw GGUF bytes: Q4_K with d = 1, sc = 1, mins 0;
    Q6_K with d = 1, sc = 1 and codes 32 (zero) except 33 on the diagonal, so the kernel's
    -32 * sum(sc * S16) term must cancel exactly."""
    f = Q.QUANT_TYPES[qtype]
    raw = np.zeros((k, k // 256, f.tsize), np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    for i in range(k):
        b, e = divmod(i, 256)
        if qtype == "Q4_K":
            raw[i, :, 0:2] = one
            raw[i, :, 4:8], raw[i, :, 12:16] = 1, 1  # 6-bit sc = 1 for all 8 sub-blocks, mins 0
            raw[i, b, 16 + (e // 64) * 32 + e % 32] = 1 << (4 * ((e % 64) // 32))
        else:
            raw[i, :, 128:192] = 0xAA  # high 2 bits of every code: 2 -> code 32
            raw[i, :, 192:208] = 1
            raw[i, :, 208:210] = one
            raw[i, b, (e // 128) * 64 + e % 64] = 1 << (4 * ((e % 128) // 64))
    qt = Q.QuantTensor(qtype, raw.reshape(k, -1), (k, k))
    assert torch.equal(qt.dequantize(), torch.eye(k))
    return qt


@pytest.mark.skipif(not have_kernel(), reason="no C++ kernel on this CPU")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("k", [512, 2048])
def test_kernel_256_block_quantiser_matches_torch(qtype, k):
    """The K-quant path's activation side (blocks of 256 with per-32 power-of-two refinements,
    the shifts folded into integer sums, Q6_K's -32 * sum(sc * S16) term through the int16 pairs
    of 16-element sums) on identity weights returns x^ itself, bit for bit, as
    `quantise_activations(x, 256)` defines it; a 32-element quantiser would not.  The 32-blocks'
    magnitudes vary up to ~1000x, so every exponent occurs.  (With sc = 1 and mins 0 this does
    not check the scale and min indexing: the random-block tests above do, within their bound.)
    At k = 2048 the calls from M = 4 on split the quantisation over the threads."""
    qw = Q.prepare_quant([identity_kquant(qtype, k)])
    g = torch.Generator().manual_seed(1)
    differs = 0
    for trial in range(30):
        m = 1 + trial % 6
        scale = torch.rand(m, k // 32, 1, generator=g).pow(3).expand(m, k // 32, 32).reshape(m, k)
        x = torch.randn(m, k, generator=g) * scale * 10.0 ** (trial % 5 - 2)
        if trial % 3 == 0:
            x = (x * 4).round() / 4
        if trial % 4 == 0:
            x[:, 256:] = 0
        y = K.linear(x, qw)
        assert torch.equal(y, Q.quantise_activations(x, 256)), trial
        differs += not torch.equal(y, Q.quantise_activations(x, 32))
        for isa in isas():
            for nt in (2, 3):
                assert torch.equal(Q._ext.qlinear(x, qw.packed, list(qw.fids), [k], None, nt, isa), y)
    assert differs >= 25, differs  # (a few trials round to all zeros at the smallest scale)


@pytest.mark.skipif(not have_kernel(), reason="no C++ kernel on this CPU")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_tiny_blocks_quantise_to_zero(qtype):
    """A block whose largest |x| is below 2^-100 is zeros in the kernel and in torch (its
    reciprocal, times 2^3 for the K-quants, would overflow: -128 codes, NaN in torch); a block
    at 2^-99 still quantises normally."""
    k = 512
    qw = Q.prepare_quant([identity_kquant(qtype, k)] if qtype == "Q4_K" else [identity_q8(k)])
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    x[0, :256] *= 2.0**-125  # 127 / amax * 8 overflows fp32 here
    b = x[1, :256].view(8, 32)  # every 32-block's largest |x| exactly 2^-99
    x[1, :256] = (b / b.abs().amax(-1, keepdim=True) * 2.0**-99).view(-1)
    y = K.linear(x, qw)
    ref = Q.quantise_activations(x, Q.activation_block(qtype))
    assert torch.isfinite(y).all() and torch.equal(y, ref)
    assert torch.equal(y[0, :256], torch.zeros(256)) and (y[1, :256] != 0).sum() > 200


def identity_q8(k: int) -> Q.QuantTensor:
    raw = np.zeros((k, k // 32, 34), np.uint8)
    raw[..., :2] = np.array([1.0], np.float16).view(np.uint8)
    for i in range(k):
        raw[i, i // 32, 2 + i % 32] = 1
    return Q.QuantTensor("Q8_0", raw.reshape(k, -1), (k, k))


def test_bad_inputs():
    with pytest.raises(ValueError, match="quant type"):
        Q.prepare_quant([Q.QuantTensor("Q2_K", np.zeros((1, 84), np.uint8), (1, 256))])
    with pytest.raises(ValueError, match="multiple of"):
        Q.prepare_quant([random_blocks("Q4_K", 2, 256, 0), random_blocks("Q8_0", 2, 32, 0)])
    qw = Q.prepare_quant([random_blocks("Q8_0", 2, 64, 0)])
    with pytest.raises(ValueError, match="features"):
        K.linear(torch.zeros(1, 32), qw)


def test_kernel_lists_the_isas_this_cpu_has():
    """isas() is what the invariance tests sweep: AVX2 always, AVX-512 VNNI and AMX where the CPU
    has them (read from /proc/cpuinfo here, independently of the kernel's own CPUID check) and,
    for AMX, Linux grants the tile state (asked here through libc, as the kernel asks)."""
    import ctypes

    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    vnni = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    amx = vnni and {"amx_tile", "amx_int8"} <= flags
    if amx:  # SYS_arch_prctl = 158 on x86-64; ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18
        amx = ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    assert Q._ext.isas() == [2] + [512] * vnni + [1024] * amx


@settings(max_examples=36, deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.integers(1, 512), n=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_rows_bit_identical_at_every_width_and_isa(qtype, m, n, seed):
    """Batch invariance across widths: row i of an M-row call (M = 1..512, as in a verify of a
    few rows, a server batch of 80 or a 512-row prompt chunk) equals row i computed alone on the
    narrow AVX2 routine, bit for bit, on every ISA this CPU has (AMX tiles from 16 rows, and
    forced at any M; K = 2048 makes calls past 128 rows run in several row blocks).  Integer
    sums are exact in any order and each row's fp32 epilogue is the same sequence, so equality,
    not a tolerance.  Negative control: one row's input scaled by 1 + 2^-16 (its activation
    scales move by ~128 ulp, its codes mostly not at all) must change that row and no other: a
    comparison blind to changes that small, or a kernel mixing rows, would fail it.  (One ulp
    alone can round away in the sum of a single output.)"""
    if not have_kernel():
        pytest.skip("no C++ kernel on this CPU")
    k = 2048
    qt = random_blocks(qtype, n, k, seed)
    qw = Q.prepare_quant([qt])
    g = torch.Generator().manual_seed(seed)
    block_scale = torch.rand(m, k // 32, 1, generator=g).expand(m, k // 32, 32).reshape(m, k)
    x = torch.randn(m, k, generator=g) * block_scale
    call = lambda xx, isa, nt=2: Q._ext.qlinear(xx.contiguous(), qw.packed, list(qw.fids), [n], None, nt, isa)
    y = call(x, 0)
    for isa in isas():
        assert torch.equal(call(x, isa), y), isa
    rows = sorted({0, m - 1, *torch.randint(0, m, (6,), generator=g).tolist()})
    for i in rows:
        assert torch.equal(call(x[i:i + 1], 2, 1)[0], y[i]), i
    i = rows[len(rows) // 2]
    x2 = x.clone()
    x2[i] *= 1 + 2.0**-16
    y2 = call(x2, 0)
    assert not torch.equal(y2[i], y[i]), "a 2^-16 change of a row's scale went unseen"
    others = torch.arange(m) != i
    assert torch.equal(y2[others], y[others]), "a change in one row moved another"
