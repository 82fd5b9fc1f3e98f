"""specdec.runtime.kernels: the few-row C++ kernel must equal torch's F.linear.

Tolerances, and why:
* fp32 storage: torch.allclose(rtol=1e-5, atol=1e-5) against F.linear in fp32.
  Both sides round the same products; only the summation order differs
  (kernel: one sequential FMA chain per output; MKL: blocked).  With
  w ~ N(0, 1/K) the outputs are O(1) and order-induced differences are
  ~sqrt(K) * 2^-24 ~ 1e-6 for K <= 300, well inside 1e-5.  For large K
  (K = 1536..8960) that margin thins, so there the check is against a float64
  reference with the rigorous worst-case bound for *any* summation order:
  |y - y64| <= (K + 1) * 2^-24 * (|x| @ |W|^T + |b|)   (gamma_{K+1}, u = 2^-24),
  which needs no assumption about the data's scale.
* bf16 storage: the same rtol=1e-5, atol=1e-5 against F.linear with the weight
  rounded to bf16 by torch (round-to-nearest-even), because the math is the
  same: identical bf16-rounded weights, fp32 products and fp32 accumulation;
  again only the summation order differs.  A kernel that rounded differently
  (e.g. truncation) or accumulated in bf16 would be off by ~2^-9 relative,
  ~100x the tolerance, so the tolerance does not hide that.
* Integer-valued data (|x|, |w| <= 4, K <= 300) makes every partial sum exact
  in fp32 (and the weights exact in bf16), so there the kernel must equal
  F.linear bit for bit: this pins the packing, tails and bias exactly.
* Batch invariance is exact: row m of an M-row call is torch.equal to the row
  computed alone (also across thread counts and AVX2 vs AVX-512 tiles).

The kernel tests do not skip on x86 with AVX2+FMA: if the extension fails to
build there, they fail.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.runtime.kernels as K
from specdec.runtime.kernels.extension import cpu_has_avx2_fma

U = 2.0**-24  # fp32 unit roundoff


@pytest.fixture(scope="module", autouse=True)
def _auto_dispatch():
    """Run this module with SPECDEC_KERNEL=auto whatever the caller's environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPECDEC_KERNEL", raising=False)
        yield


def _expect_kernel() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and cpu_has_avx2_fma()


def require_kernel():
    """Fail (not skip) when the kernel should build here but did not."""
    if _expect_kernel():
        assert K.kernel_available(), "C++ kernel failed to build on an AVX2+FMA x86 CPU"
    elif not K.kernel_available():
        pytest.skip("no AVX2+FMA x86 CPU: kernel not expected")


def make_x(gen: torch.Generator, layout: str, m: int, k: int, b: int, t: int,
           integer: bool = False) -> torch.Tensor:
    """x with M = m rows of k features in the given memory layout (values random)."""
    def rnd(*shape):
        if integer:
            return torch.randint(-4, 5, shape, generator=gen).float()
        return torch.randn(*shape, generator=gen)

    if layout == "contig":
        return rnd(m, k)                                  # [M, K]
    if layout == "transposed":
        return rnd(k, m).t()                              # [M, K], strides (1, M)
    if layout == "sliced":
        return rnd(m, 2 * k + 3)[:, 1:2 * k + 1:2]        # [M, K], stride 2
    if layout == "vector":
        return rnd(k)                                     # [K] -> M = 1
    if layout == "batched":
        return rnd(b, t, k)                               # [B, T, K]
    if layout == "batched_perm":
        return rnd(t, b, k).transpose(0, 1)               # [B, T, K], non-contiguous
    raise ValueError(layout)


LAYOUTS = ["contig", "transposed", "sliced", "vector", "batched", "batched_perm"]


@st.composite
def cases(draw, max_nk: int = 300):
    layout = draw(st.sampled_from(LAYOUTS))
    if layout.startswith("batched"):
        b = draw(st.integers(1, 4))
        t = draw(st.integers(1, 16 // b))
        m = b * t
    else:
        b = t = 0
        m = 1 if layout == "vector" else draw(st.integers(1, 16))
    n = draw(st.integers(1, max_nk))
    k = draw(st.integers(1, max_nk))
    return dict(layout=layout, m=m, n=n, k=k, b=b, t=t,
                bias=draw(st.booleans()), dtype=draw(st.sampled_from(["fp32", "bf16"])),
                seed=draw(st.integers(0, 2**31 - 1)))


def setup(c: dict, integer: bool = False):
    gen = torch.Generator().manual_seed(c["seed"])
    x = make_x(gen, c["layout"], c["m"], c["k"], c["b"], c["t"], integer)
    if integer:
        w = torch.randint(-4, 5, (c["n"], c["k"]), generator=gen).float()
        bias = torch.randint(-4, 5, (c["n"],), generator=gen).float() if c["bias"] else None
    else:
        w = torch.randn(c["n"], c["k"], generator=gen) / c["k"] ** 0.5
        bias = torch.randn(c["n"], generator=gen) if c["bias"] else None
    return x, w, bias


def ref_weight(w: torch.Tensor, dtype: str) -> torch.Tensor:
    """The values the kernel multiplies by: w, or w rounded to bf16 by torch."""
    return w if dtype == "fp32" else w.to(torch.bfloat16).float()


def assert_within_gamma(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias):
    """|y - y64| <= (K+1) u (|x| |W|^T + |b|): rigorous for any summation order."""
    x64, w64 = x.double(), w.double()
    ref = F.linear(x64, w64, None if bias is None else bias.double())
    mag = F.linear(x64.abs(), w64.abs(), None if bias is None else bias.double().abs())
    bound = (w.shape[1] + 1) * U * 1.01 * mag + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"


# ---------------------------------------------------------------- kernel path


def test_kernel_builds_and_is_dispatched():
    require_kernel()
    assert K.kernel_isa() in ("avx2", "avx512")
    pw = K.prepare_weight(torch.randn(24, 40))
    for m in (1, 5, K.MAX_KERNEL_ROWS):
        assert K._use_kernel(torch.randn(m, 40), m)
    assert not K._use_kernel(torch.randn(K.MAX_KERNEL_ROWS + 1, 40), K.MAX_KERNEL_ROWS + 1)
    assert not K._use_kernel(torch.randn(3, 40, dtype=torch.float64), 3)
    assert not K._use_kernel(torch.randn(3, 40, requires_grad=True), 3)
    assert K.linear(torch.randn(2, 3, 40), pw).shape == (2, 3, 24)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_kernel_matches_f_linear(c):
    require_kernel()
    x, w, bias = setup(c)
    pw = K.prepare_weight(w, c["dtype"])
    assert K._use_kernel(x, c["m"])
    y = K.linear(x, pw, bias)
    wr = ref_weight(w, c["dtype"])
    assert torch.equal(pw.dense, wr)  # packing round-trips exactly (tails, lane order)
    ref = F.linear(x, wr, bias)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5), (y - ref).abs().max().item()
    assert_within_gamma(y.reshape(-1, c["n"]), x.reshape(-1, c["k"]), wr, bias)


@settings(max_examples=100, deadline=None)
@given(cases())
def test_kernel_exact_on_integer_data(c):
    """Every partial sum is exact, so any layout/tail/bias slip shows up bit-wise."""
    require_kernel()
    x, w, bias = setup(c, integer=True)
    y = K.linear(x, K.prepare_weight(w, c["dtype"]), bias)
    assert torch.equal(y, F.linear(x, w, bias))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (1000, 8960), (256, 1536)])
def test_kernel_large_k_within_fp32_bound(n, k, dtype):
    require_kernel()
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn(16, k, generator=gen)
    y = K.linear(x, K.prepare_weight(w, dtype), bias)
    assert_within_gamma(y, x, ref_weight(w, dtype), bias)


def test_bf16_really_rounds_weights():
    require_kernel()
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=gen), torch.randn(4, 256, generator=gen)
    pw = K.prepare_weight(w, "bf16")
    assert pw.packed.element_size() == 2 and torch.equal(pw.dense, w.to(torch.bfloat16).float())
    y = K.linear(x, pw)
    assert torch.allclose(y, F.linear(x, w.to(torch.bfloat16).float()), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- batch invariance


@settings(max_examples=100, deadline=None)
@given(cases())
def test_batch_invariance(c):
    """Each row of an M-row call is bit-identical to that row computed alone."""
    require_kernel()
    x, w, bias = setup(c)
    pw = K.prepare_weight(w, c["dtype"])
    rows = x.reshape(-1, c["k"])                      # [M, K]
    y = K.linear(x, pw, bias).reshape(-1, c["n"])     # [M, N]
    for i in range(rows.shape[0]):
        assert torch.equal(y[i], K.linear(rows[i:i + 1], pw, bias)[0]), f"row {i} of {c['m']}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_batch_invariance_across_threads_isas_and_chunks(dtype):
    """K spans several k-chunks, N has a tail; 1 vs 2 threads; AVX2 vs AVX-512 tiles."""
    require_kernel()
    gen = torch.Generator().manual_seed(3)
    n, k = 1000, 1000
    w, bias = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    x = torch.randn(16, k, generator=gen)
    pw = K.prepare_weight(w, dtype)
    isas = [2] + ([512] if K._ext.best_isa() == 512 else [])
    full = K._ext.linear(x, pw.packed, bias, n, 1, 2)  # [16, N]: 1 thread, AVX2
    for nt in (1, 2):
        for isa in isas:
            for m in (1, 3, 7, 13, 16):
                y = K._ext.linear(x[:m].contiguous(), pw.packed, bias, n, nt, isa)
                assert torch.equal(y, full[:m]), (nt, isa, m)
    assert_within_gamma(full, x, ref_weight(w, dtype), bias)


@pytest.mark.parametrize("m", [17, 100, K.MAX_KERNEL_ROWS])
def test_many_rows_on_kernel(m):
    """Past the hypothesis range (M <= 16): still correct and batch-invariant."""
    require_kernel()
    gen = torch.Generator().manual_seed(m)
    n, k = 333, 517
    w, bias = torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    assert K._use_kernel(x, m)
    for dtype in ("fp32", "bf16"):
        pw = K.prepare_weight(w, dtype)
        y = K.linear(x, pw, bias)
        assert torch.allclose(y, F.linear(x, ref_weight(w, dtype), bias), rtol=1e-5, atol=1e-5)
        for i in (0, m // 2, m - 1):
            assert torch.equal(y[i], K.linear(x[i], pw, bias))


# ---------------------------------------------------------------- fallback path


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forced_fallback_is_used_and_equal(monkeypatch, dtype):
    """SPECDEC_KERNEL=torch after packing: F.linear on the exactly unpacked weight."""
    gen = torch.Generator().manual_seed(5)
    w, bias = torch.randn(77, 130, generator=gen) / 130**0.5, torch.randn(77, generator=gen)
    x = torch.randn(2, 3, 130, generator=gen)  # [B, T, K]
    pw = K.prepare_weight(w, dtype)
    y_auto = K.linear(x, pw, bias)
    monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    assert not K._use_kernel(x, 6)
    y_torch = K.linear(x, pw, bias)
    assert torch.equal(pw.dense, ref_weight(w, dtype))  # unpacking is exact
    assert torch.equal(y_torch, F.linear(x, ref_weight(w, dtype), bias))
    assert torch.allclose(y_auto, y_torch, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weight_stored_once(monkeypatch, dtype):
    """One copy: packed when the kernel runs; fp32 fallback copy only if prepared under torch mode."""
    require_kernel()
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    pw = K.prepare_weight(w, dtype)
    assert pw.packed is not None and pw.fallback is None
    monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    pt = K.prepare_weight(w, dtype)
    assert pt.packed is None and torch.equal(pt.fallback, ref_weight(w, dtype))
    monkeypatch.delenv("SPECDEC_KERNEL")
    assert torch.equal(K.linear(x, pt), F.linear(x, ref_weight(w, dtype)))  # no packed: torch


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_many_rows_fall_back(dtype):
    m = K.MAX_KERNEL_ROWS + 1
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(50, 33, generator=gen), torch.randn(m, 33, generator=gen)
    assert not K._use_kernel(x, m)
    y = K.linear(x, K.prepare_weight(w, dtype))
    assert torch.equal(y, F.linear(x, ref_weight(w, dtype)))


def test_bad_arguments():
    with pytest.raises(ValueError):
        K.prepare_weight(torch.randn(4, 4), "fp16")
    with pytest.raises(ValueError):
        K.prepare_weight(torch.randn(4))
    with pytest.raises(ValueError):
        K.linear(torch.randn(2, 5), K.prepare_weight(torch.randn(4, 4)))


def test_env_torch_never_builds(tmp_path):
    """SPECDEC_KERNEL=torch works without the extension (fresh interpreter)."""
    import subprocess
    import sys

    code = ("import torch, specdec.runtime.kernels as K; pw = K.prepare_weight(torch.ones(3, 2)); "
            "print(K.linear(torch.ones(2), pw).tolist(), K._ext is None)")
    env = dict(os.environ, SPECDEC_KERNEL="torch", SPECDEC_CACHE=str(tmp_path))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[2.0, 2.0, 2.0] True"
