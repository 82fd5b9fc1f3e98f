"""GGUF-quantised weights for the few-row matmul: repacking, dequantisation, dispatch.

A GGUF matrix arrives as its blocks (`QuantTensor`: raw bytes [N, bytes per row]).  `pack`
rearranges them, still quantised and with the format's own scale fields, into the panel
records qlinear.cpp streams (its header describes the layout); `unpack` turns a packed
matrix back into fp32 with exactly the values `gguf.quants.dequantize` gives.

    qw = prepare_quant([QuantTensor(...), ...])   # row blocks of one fused weight (q, k, v)
    y = linear(x, qw, bias)                       # x: [..., K] -> y: [..., N]

The kernel quantises x to int8 blocks (d = amax / 127, round half to even; 32 elements per
block for Q8_0/Q4_0/Q4_1/Q5_0 weights; for Q4_K/Q6_K 256, refined per 32 by a power of two,
`quantise_activations`) and takes integer
dot products, so the model it computes is "GGUF weights, int8 activations";
`quantise_activations` is that activation step in torch, and the fallback (SPECDEC_KERNEL=torch,
no extension, non-fp32 or non-CPU input) is F.linear(quantise_activations(x, block), dequantised
W): the same math, a different summation order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.runtime.kernels.extension import linear_extension, load_extension

__all__ = ["QUANT_TYPES", "Q6_K2_FID", "QuantTensor", "QuantWeight", "prepare_quant", "linear", "pack",
           "unpack", "quantise_activations", "activation_block", "requantise"]

NR = 16  # outputs per panel; must match NR in qlinear.cpp


@dataclass(frozen=True)
class _Format:
    fid: int      # Fmt in qlinear.cpp
    block: int    # GGUF block size (k per block)
    tsize: int    # GGUF bytes per block
    rk: int       # k per packed record
    sb: int       # k per scale sub-block
    bits: int     # width of the weight code
    sbytes: int   # scale bytes per panel record


QUANT_TYPES = {
    "Q8_0": _Format(0, 32, 34, 32, 32, 8, 32),
    "Q4_0": _Format(1, 32, 18, 32, 32, 4, 32),
    "Q4_1": _Format(2, 32, 20, 32, 32, 4, 64),
    "Q5_0": _Format(3, 32, 22, 32, 32, 5, 32),
    "Q4_K": _Format(4, 256, 144, 256, 32, 4, 320),
    "Q6_K": _Format(5, 256, 210, 256, 16, 6, 288),
}


def _lo_bytes(f: _Format) -> int:  # low plane bytes per record
    return f.rk // 4 * (64 if f.bits == 8 else 32)


def _hi_bytes(f: _Format) -> int:  # high plane bytes per record
    return {5: f.rk * 2, 6: f.rk * 4}.get(f.bits, 0)


def record_bytes(qtype: str) -> int:
    f = QUANT_TYPES[qtype]
    return f.sbytes + _lo_bytes(f) + _hi_bytes(f)


@dataclass(frozen=True, eq=False)
class QuantTensor:
    """A GGUF matrix as stored: raw [N, K / block * bytes per block] uint8, shape (N, K)."""

    qtype: str
    raw: np.ndarray
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 by the gguf package (the reference every path is tested against)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.raw, GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.shape))


# --- GGUF blocks <-> (codes, scale fields) ----------------------------------------------------

def requantise(qt: QuantTensor, qtype: str = "Q4_0") -> QuantTensor:
    """qt's values (gguf's dequantisation) quantised again as `qtype` by the gguf package: fewer
    bytes per weight, a different (coarser) model.  For a draft, which only proposes tokens."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype not in QUANT_TYPES:
        raise ValueError(f"quant type must be one of {', '.join(QUANT_TYPES)}, got {qtype!r}")
    raw = quantize(qt.dequantize().numpy(), GGMLQuantizationType[qtype])
    return QuantTensor(qtype, raw, qt.shape)


def quantise(w: torch.Tensor, qtype: str = "Q8_0") -> QuantTensor:
    """A dense [N, K] matrix as `qtype` blocks by the gguf package (K a multiple of its block)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    f = QUANT_TYPES[qtype]
    if w.dim() != 2 or w.shape[1] % f.rk:
        raise ValueError(f"{qtype} needs a [N, K] matrix with K a multiple of {f.rk}, got {tuple(w.shape)}")
    a = np.ascontiguousarray(w.detach().to(torch.float32).cpu().numpy())
    return QuantTensor(qtype, quantize(a, GGMLQuantizationType[qtype]), tuple(w.shape))


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float16."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _decode_blocks(qt: QuantTensor) -> tuple[np.ndarray, list[np.ndarray]]:
    """-> codes q [N, K] uint8 (Q8_0: int8 bits), scale fields [N, K / rk, c] in record order."""
    f = QUANT_TYPES[qt.qtype]
    n, k = qt.shape
    blk = qt.raw.reshape(n, k // f.block, f.tsize)
    if qt.qtype == "Q8_0":
        return blk[..., 2:].reshape(n, k), [_f16(blk[..., :2])[..., None]]
    if qt.qtype in ("Q4_0", "Q4_1", "Q5_0"):
        qs = blk[..., f.tsize - 16:]  # 16 bytes: elements 0-15 low nibbles, 16-31 high
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, nb, 32]
        if qt.qtype == "Q5_0":
            qh = np.ascontiguousarray(blk[..., 2:6]).view(np.uint32)  # [n, nb, 1]: bit i = element i
            q = q | (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4)
        fields = [_f16(blk[..., :2])[..., None]]
        if qt.qtype == "Q4_1":
            fields.append(_f16(blk[..., 2:4])[..., None])
        return q.reshape(n, k), fields
    if qt.qtype == "Q4_K":
        from gguf.quants import Q4_K

        qs = blk[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blk[..., 4:16]).reshape(-1, 12))
        return ((qs & 0x0F).reshape(n, k),
                [_f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None],
                 sc.reshape(n, -1, 8), mn.reshape(n, -1, 8)])
    assert qt.qtype == "Q6_K", qt.qtype
    ql = blk[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blk[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (ql & 0x0F).reshape(n, -1, 256) | ((qh & 0x03).reshape(n, -1, 256) << 4)
    return q.reshape(n, k), [_f16(blk[..., 208:210])[..., None], blk[..., 192:208].view(np.int8)]


def _scales_to_weights(qtype: str, q: np.ndarray, fields: list[np.ndarray]) -> np.ndarray:
    """codes [N, K] + fields -> fp32 [N, K], with the gguf package's fp32 operations."""
    f = QUANT_TYPES[qtype]
    n, k = q.shape
    fl = [a.astype(np.float32) for a in fields]
    if qtype == "Q4_K":
        d, dmin, sc, mn = fl
        ws, wm = (d * sc).reshape(n, -1, 1), (dmin * mn).reshape(n, -1, 1)
        return (ws * q.reshape(n, -1, 32).astype(np.float32) - wm).reshape(n, k)
    if qtype == "Q6_K":
        ws = (fl[0] * fl[1]).reshape(n, -1, 1)
        return (ws * (q.reshape(n, -1, 16).astype(np.int8) - np.int8(32)).astype(np.float32)).reshape(n, k)
    qb = q.reshape(n, -1, 32)
    d = fl[0].reshape(n, -1, 1)
    if qtype == "Q4_1":
        return (d * qb.astype(np.float32) + fl[1].reshape(n, -1, 1)).reshape(n, k)
    off = {"Q8_0": 0, "Q4_0": 8, "Q5_0": 16}[qtype]
    signed = qb.view(np.int8) if qtype == "Q8_0" else qb.astype(np.int8) - np.int8(off)
    assert f.bits in (4, 5, 8)
    return (d * signed.astype(np.float32)).reshape(n, k)


# --- (codes, fields) <-> panel records ---------------------------------------------------------

Q6_K2_FID = 6  # Q6_K in the AVX2 routine's layout (qlinear.cpp's Q6_K2): same record size


PACK_ROWS = 8192  # rows packed at a time: whole panels, so the same records as all at once
assert PACK_ROWS % NR == 0


def pack(qt: QuantTensor, q6k_avx2: bool = False) -> torch.Tensor:
    """GGUF blocks -> uint8 [P, K / rk, record bytes] (P = ceil(N / 16), zero-padded).
    q6k_avx2: a Q6_K tensor's codes in the Q6_K2 layout (k-step pairs of three vectors, each
    byte a whole code plus two bits of the pair's fourth code) instead of low + high planes.
    A taller matrix goes PACK_ROWS rows at a time: the temporaries below take several bytes a
    weight, 0.8 GB more peak memory for Qwen2.5 1.5B's output head packed at once."""
    n, k = qt.shape
    if n > PACK_ROWS:
        return torch.cat([pack(QuantTensor(qt.qtype, qt.raw[s: s + PACK_ROWS], (min(PACK_ROWS, n - s), k)),
                               q6k_avx2) for s in range(0, n, PACK_ROWS)])
    f = QUANT_TYPES[qt.qtype]
    pairs = qt.qtype == "Q6_K" and q6k_avx2
    q, fields = _decode_blocks(qt)
    P = -(-n // NR)
    if P * NR != n:  # zero codes and scales: padded outputs are 0 and never stored
        q = np.concatenate([q, np.zeros((P * NR - n, k), q.dtype)])
        fields = [np.concatenate([a, np.zeros((P * NR - n, *a.shape[1:]), a.dtype)]) for a in fields]
    nrec, S = k // f.rk, k // 4
    parts = []
    for a in fields:  # [Np, nrec, c] -> [P, nrec, c, 16] -> bytes
        a = a.reshape(P, NR, nrec, -1).transpose(0, 2, 3, 1)
        parts.append(np.ascontiguousarray(a).view(np.uint8).reshape(P, nrec, -1))
    t = q.reshape(P, 2, 8, S, 4).transpose(0, 3, 1, 2, 4).reshape(P, S, 2, 32)  # [P, S, half, 32]
    if f.bits == 8:
        parts.append(t.reshape(P, nrec, -1))
    elif pairs:
        u = t.reshape(P, S // 2, 2, 2, 32)  # [P, pair, step, half, 32]
        c3 = u[:, :, 1, 1]
        v = [u[:, :, 0, 0] | ((c3 & 3) << 6), u[:, :, 0, 1] | (((c3 >> 2) & 3) << 6),
             u[:, :, 1, 0] | ((c3 >> 4) << 6)]
        parts.append(np.stack(v, axis=2).astype(np.uint8).reshape(P, nrec, -1))
    else:
        parts.append(((t[:, :, 0] & 0x0F) | ((t[:, :, 1] & 0x0F) << 4)).reshape(P, nrec, -1))
    if f.bits in (5, 6) and not pairs:
        b = f.bits - 4
        g = 4 if f.bits == 5 else 2  # k-steps per high-plane vector
        h = (t >> 4).reshape(P, S // g, g * 2, 32)  # field = 2 * step + half
        shifts = (np.arange(g * 2, dtype=np.uint8) * b).reshape(-1, 1)
        parts.append(np.bitwise_or.reduce(h << shifts, axis=2).astype(np.uint8).reshape(P, nrec, -1))
    rec = np.concatenate(parts, axis=-1)
    assert rec.shape[-1] == record_bytes(qt.qtype), (rec.shape, qt.qtype)
    return torch.from_numpy(np.ascontiguousarray(rec))


def unpack(packed: torch.Tensor, qtype: str, n: int, q6k_avx2: bool = False) -> torch.Tensor:
    """Inverse of pack, dequantised: uint8 [P, K / rk, rec] -> fp32 [n, K] (gguf's exact values)."""
    f = QUANT_TYPES[qtype]
    pairs = qtype == "Q6_K" and q6k_avx2
    rec = packed.numpy()
    P, nrec, _ = rec.shape
    k = nrec * f.rk
    S = k // 4
    widths = {"Q8_0": [(np.float16, 1)], "Q4_0": [(np.float16, 1)], "Q5_0": [(np.float16, 1)],
              "Q4_1": [(np.float16, 1)] * 2, "Q4_K": [(np.float16, 1)] * 2 + [(np.uint8, 8)] * 2,
              "Q6_K": [(np.float16, 1), (np.int8, 16)]}[qtype]
    fields, o = [], 0
    for dt, c in widths:
        nb = c * NR * np.dtype(dt).itemsize
        a = np.ascontiguousarray(rec[..., o:o + nb]).view(dt).reshape(P, nrec, c, NR)
        fields.append(a.transpose(0, 3, 1, 2).reshape(P * NR, nrec, c))
        o += nb
    planes = o
    lo = rec[..., o:o + _lo_bytes(f)].reshape(P, S, -1)
    o += _lo_bytes(f)
    if pairs:  # k-step pairs of three vectors, through the record's end
        v = rec[..., planes:].reshape(P, S // 2, 3, 32)
        c3 = ((v[:, :, 0] >> 6) | ((v[:, :, 1] >> 6) << 2) | ((v[:, :, 2] >> 6) << 4))
        t = np.stack([v[:, :, 0] & 0x3F, v[:, :, 1] & 0x3F, v[:, :, 2] & 0x3F, c3], axis=2)
        t = t.reshape(P, S, 2, 32)
    elif f.bits == 8:
        t = lo.reshape(P, S, 2, 32).copy()
    else:
        t = np.stack([lo & 0x0F, lo >> 4], axis=2)  # [P, S, half, 32]
    if f.bits in (5, 6) and not pairs:
        b = f.bits - 4
        g = 4 if f.bits == 5 else 2
        h = rec[..., o:o + _hi_bytes(f)].reshape(P, S // g, 1, 32)
        shifts = (np.arange(g * 2, dtype=np.uint8) * b).reshape(-1, 1)
        t |= (((h >> shifts) & ((1 << b) - 1)) << 4).reshape(P, S, 2, 32)
    q = t.reshape(P, S, 2, 8, 4).transpose(0, 2, 3, 1, 4).reshape(P * NR, k)
    return torch.from_numpy(_scales_to_weights(qtype, q, fields)[:n].copy())


# --- prepared weights and dispatch -------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class QuantWeight:
    """One (possibly fused) quantised weight [N, K] for `linear`.

    segments: (qtype, n) per row block, in output order.
    packed:   per segment, the records the kernel streams; None when the torch fallback is
              the main path (no kernel, or SPECDEC_KERNEL=torch at prepare time).
    fallback: [N, K] fp32 dequantised when packed is None; otherwise None, and `dense`
              unpacks on demand (keeping both would cost 7x the memory).
    """

    segments: tuple[tuple[str, int], ...]
    packed: list | None
    fallback: torch.Tensor | None
    n: int
    k: int
    dtype: str = "native"
    fids: tuple[int, ...] = ()  # the kernel's format of each packed segment (Q6_K may be Q6_K2)

    @property
    def dense(self) -> torch.Tensor:
        if self.fallback is not None:
            return self.fallback
        return torch.cat([unpack(p, qt, n, fid == Q6_K2_FID)
                          for p, (qt, n), fid in zip(self.packed, self.segments, self.fids)])

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams per call (the fallback's fp32 bytes without a kernel)."""
        if self.packed is None:
            return self.fallback.numel() * 4
        return sum(p.numel() for p in self.packed)


def prepare_quant(parts: list[QuantTensor]) -> QuantWeight:
    """Row blocks (same K) of one fused weight -> a QuantWeight."""
    k = parts[0].shape[1]
    for p in parts:
        if p.qtype not in QUANT_TYPES:
            raise ValueError(f"quant type must be one of {', '.join(QUANT_TYPES)}, got {p.qtype!r}")
        if p.shape[1] != k or k % QUANT_TYPES[p.qtype].rk:
            raise ValueError(f"{p.qtype} part has shape {p.shape}; expected K = {k}, "
                             f"a multiple of {QUANT_TYPES[p.qtype].rk}")
    segs = tuple((p.qtype, p.shape[0]) for p in parts)
    n = sum(s[1] for s in segs)
    if os.environ.get("SPECDEC_KERNEL") != "torch" and linear_extension() is not None and _qext() is not None:
        # Q6_K in the AVX2 routine's layout wherever that routine is the one that runs
        avx2 = os.environ.get("SPECDEC_KERNEL") == "avx2" or _qext().best_isa() == 2
        fids = tuple(Q6_K2_FID if avx2 and p.qtype == "Q6_K" else QUANT_TYPES[p.qtype].fid for p in parts)
        return QuantWeight(segs, [pack(p, avx2) for p in parts], None, n, k, fids=fids)
    return QuantWeight(segs, None, torch.cat([p.dequantize() for p in parts]), n, k)


XE = 3  # largest power-of-two refinement of a 32-block inside a 256-block; XE in qlinear.cpp


def activation_block(qtype: str) -> int:
    """Elements per activation scale the kernel uses with `qtype` weights: 256 for the K-quants
    (one scale per super-block, refined per 32 by a power of two, so their integer sub-block
    scales fold into exact integer sums), 32 for the 32-element formats."""
    return QUANT_TYPES[qtype].rk


def _zero_tiny(amax: torch.Tensor) -> torch.Tensor:
    """A block whose largest |x| is below 2^-100 (or NaN) quantises to zeros, as in the kernel:
    127 / amax * 2^e could overflow and amax / 127 * 2^-XE would be subnormal."""
    return torch.where(amax >= 2.0**-100, amax, torch.zeros_like(amax))


def quantise_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [..., K] -> the fp32 values the kernel multiplies.

    block 32 (Q8_0/Q4_0/Q4_1/Q5_0): d * round(x * (127 / amax)) per 32 elements.
    block 256 (Q4_K/Q6_K): d = amax / 127 per 256, and per 32 the largest e <= XE with
    amax32 * 2^e <= amax: (d * 2^-e) * round(x * ((127 / amax) * 2^e)).  (Plain per-256
    scales, llama.cpp's Q8_K, let one outlier block coarsen its neighbours: on Qwen 1.5B they
    quadrupled the logit error against fp32; the refinement keeps it near per-32's.)"""
    if block == 32:
        xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
        amax = _zero_tiny(xb.abs().amax(-1, keepdim=True))
        c127 = torch.full_like(amax, 127.0)  # tensor / tensor: torch turns scalar division into a
        d = amax / c127                       # multiplication by a reciprocal (not the kernel's bits)
        inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
        return ((xb * inv).round() * d).reshape(x.shape).to(x.dtype)
    if block != 256:
        raise ValueError(f"activation block must be 32 or 256, got {block}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 256, 8, 32)
    a32 = xb.abs().amax(-1, keepdim=True)
    amax = _zero_tiny(a32.amax(-2, keepdim=True))
    e = torch.zeros_like(a32)
    for i in range(1, XE + 1):  # the condition is monotone in i: the largest that holds
        e = torch.where(a32 * 2.0**i <= amax, torch.full_like(e, float(i)), e)
    scale = torch.ldexp(torch.ones_like(e), e.int())  # 2^e, exactly
    c127 = torch.full_like(amax, 127.0)
    d = amax / c127
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    return ((xb * (inv * scale)).round() * (d / scale)).reshape(x.shape).to(x.dtype)


_ext = None
_tried = False


def _qext():
    """The compiled qlinear extension, or None (built once per process, cached on disk)."""
    global _ext, _tried
    if not _tried:
        _tried = True
        _ext = load_extension("specdec_qlinear", ["qlinear.cpp"]) if linear_extension() is not None else None
    return _ext


# SPECDEC_KERNEL=avx2|avx512|amx pins the kernel's ISA (benchmarks, A/B runs); unset: the
# fastest this CPU has for the call's rows.
_ISA = {"avx2": 2, "avx512": 512, "amx": 1024}


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T (+ bias) with int8-quantised activation blocks."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {w.k}")
    mode = os.environ.get("SPECDEC_KERNEL")
    if (w.packed is not None and mode != "torch" and x.is_cpu
            and x.dtype == torch.float32 and not x.requires_grad):
        if w.__dict__.get("_args") is None:  # per-call list building costs ~1 us: build once
            object.__setattr__(w, "_args", (list(w.fids),
                                            [s[1] for s in w.segments]))
        fmts, ns = w.__dict__["_args"]
        return _ext.qlinear(x, w.packed, fmts, ns, bias, torch.get_num_threads(), _ISA.get(mode, 0))
    dense = w.dense.to(x.device, x.dtype)
    blocks = [activation_block(qt) for qt, _ in w.segments]
    if len(set(blocks)) == 1:
        return F.linear(quantise_activations(x, blocks[0]), dense, bias)
    xh = {blk: quantise_activations(x, blk) for blk in set(blocks)}  # once per block size
    ys, o = [], 0  # mixed activation blocks: each row block multiplies its own x^
    for (_, n), blk in zip(w.segments, blocks):
        ys.append(F.linear(xh[blk], dense[o:o + n]))
        o += n
    y = torch.cat(ys, -1)
    return y if bias is None else y + bias
