"""Few-row linear layers on CPU that read each weight from memory once.

Speculative decoding verifies k+1 tokens in one forward, so a linear layer
sees M = 1..16 rows.  Torch/MKL switch from gemv to a GEMM path at M >= 2 and
the cost jumps; the C++ kernel (linear.cpp) streams a prepacked weight once and
applies it to all M rows while it is in registers/L1, on torch's thread count.

    pw = prepare_weight(w)            # w: [N, K] fp32, as F.linear takes it
    y = linear(x, pw, bias)           # x: [..., K] -> y: [..., N]

The kernel runs when the extension is available, x is an fp32 CPU tensor and
M = x.numel() // K <= MAX_KERNEL_ROWS; anything else goes to F.linear on the
same math (for "bf16" storage: weights rounded to bf16, fp32 accumulation).
Each row's result is the same bits whatever M is (batch invariance).

SPECDEC_KERNEL (read per call): "auto" (default) uses the extension if it
builds and the CPU has AVX2+FMA, on AVX-512 tiles where the CPU has them (same
bits); "avx2" keeps it on its AVX2 tiles; "torch" forces the fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runtime.kernels import extension, quant
from specdec.runtime.kernels.extension import CFLAGS  # noqa: F401 -- benchmarks build with it

__all__ = ["PreparedWeight", "prepare_weight", "prepare_quant", "QuantTensor", "linear",
           "kernel_available", "kernel_isa", "build", "MAX_KERNEL_ROWS", "NR", "weight_state",
           "weight_from_state", "packed_layout"]

log = logging.getLogger(__name__)

# Largest row count sent to the C++ kernel; more rows go to F.linear (MKL).
# Measured on the dev box (benchmarks/fp32_kernels.py --crossover, and 1-thread
# sweeps to M = 2048): the kernel beats F.linear at every M up to 2048 on its
# AVX-512 tiles (>= 1.5x), and up to M = 256 on its AVX2 tiles (>= 1.15x),
# with parity around M = 512..1024 (MKL runs AVX2 code on this AMD CPU).
# 256 keeps either path on the winning side; it covers speculative
# verification (M = k+1) and short prefills, which then get the same
# batch-invariant arithmetic as decoding.
MAX_KERNEL_ROWS = 256
NR = 16    # output features per panel; must match NR in linear.cpp
UNIT = 2   # panels per unit, interleaved per k-step; must match UNIT in linear.cpp
KS = UNIT * NR

# bf16 panels store lane pairs (j, 8+j) in each 32-bit word (see linear.cpp).
_LANES = (torch.arange(NR).view(2, NR // 2).t().reshape(-1)          # 0, 8, 1, 9, ..., 7, 15
          + NR * torch.arange(UNIT).view(-1, 1)).reshape(-1)          # ... per panel of the unit
_LANES_INV = torch.argsort(_LANES)

_ext = None  # the loaded extension module, once built


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight stored once, in the form the path that will run it wants.

    packed:   kernel layout, when the kernel is available: units of two
              16-feature panels, [U, K, 32] (U = ceil(N / 32), zero-padded):
              fp32, or int16 bf16 bits with each panel's lanes interleaved
              (j, 8+j) -- see linear.cpp.  Otherwise None.
    fallback: [N, K] fp32 (bf16-rounded values for "bf16") when the fallback
              is the main path (no kernel, or SPECDEC_KERNEL=torch at prepare
              time).  Otherwise None, and the rare fallback call (M >
              MAX_KERNEL_ROWS, or SPECDEC_KERNEL=torch set later) unpacks
              `packed`, exactly, for that call: keeping both would double
              the model's memory.
    """

    packed: torch.Tensor | None
    fallback: torch.Tensor | None
    n: int
    k: int
    dtype: str  # "fp32" | "bf16"

    @property
    def dense(self) -> torch.Tensor:
        """[N, K] fp32 with exactly the values the kernel multiplies by.

        A fresh unpacked copy on every access when only `packed` is stored.
        """
        return self.fallback if self.fallback is not None else _unpack(self.packed, self.n, self.dtype)


def prepare_weight(w: torch.Tensor, dtype: str = "fp32") -> PreparedWeight:
    """Store w [N, K] (out_features x in_features) for `linear`, as fp32 or bf16."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if w.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()  # [N, K]
    if dtype == "bf16":  # round to nearest even, as torch does; every path uses these values
        w = w.to(torch.bfloat16).float()
    n, k = w.shape
    if os.environ.get("SPECDEC_KERNEL") != "torch" and kernel_available():
        return PreparedWeight(_pack(w, dtype), None, n, k, dtype)
    return PreparedWeight(None, w, n, k, dtype)


def prepare_int8(w: torch.Tensor) -> PreparedWeight | quant.QuantWeight:
    """w [N, K] as Q8_0 blocks on the int8 kernels (about half the bytes of bf16, for a small
    network's weights that a larger one's stream evicts from the caches between its calls), or
    as bf16 panels where K is not a multiple of 32 or the int8 kernels cannot run here."""
    if w.dim() == 2 and w.shape[1] % 32 == 0 and kernel_available() and quant._qext() is not None \
            and os.environ.get("SPECDEC_KERNEL") != "torch":
        return quant.prepare_quant([quant.quantise(w, "Q8_0")])
    return prepare_weight(w, "bf16")


def _pack(w: torch.Tensor, dtype: str) -> torch.Tensor:
    """[N, K] fp32 -> [U, K, KS] units (fp32, or int16 bf16 bits in lane-pair order)."""
    n, k = w.shape
    u = -(-n // KS)
    if u * KS != n:
        w = torch.cat([w, w.new_zeros(u * KS - n, k)])  # [U*KS, K], zero rows never reach out
    units = w.view(u, KS, k)  # [U, KS, K]
    if dtype == "bf16":  # values are bf16 already, so this conversion is exact
        units = units.to(torch.bfloat16).view(torch.int16)[:, _LANES, :]
    return units.transpose(1, 2).contiguous()  # [U, K, KS]: one k-step of a unit is contiguous


def _unpack(packed: torch.Tensor, n: int, dtype: str) -> torch.Tensor:
    """Inverse of _pack: [U, K, KS] -> [N, K] fp32 (a fresh copy)."""
    if dtype == "bf16":
        packed = packed[..., _LANES_INV].view(torch.bfloat16)
    u, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(u * KS, k)[:n].float()


def build(verbose: bool = False):
    """Compile/load the extension (cached on disk); returns it, or None on failure."""
    global _ext
    if _ext is None:
        _ext = extension.linear_extension(verbose)
    return _ext


def kernel_available() -> bool:
    """True if the C++ kernel can run here (builds it on first call)."""
    return build() is not None


def kernel_isa() -> str:
    """Instruction set `linear` runs the kernel with here: "avx512", "avx2" or "none"."""
    if not kernel_available():
        return "none"
    avx2 = os.environ.get("SPECDEC_KERNEL") == "avx2" or _ext.best_isa() == 2
    return "avx2" if avx2 else "avx512"


def _use_kernel(x: torch.Tensor, m: int, mode: str | None = None) -> bool:
    """Dispatch rule for `linear`: kernel for up to MAX_KERNEL_ROWS fp32 CPU rows.

    mode: the SPECDEC_KERNEL value, if the caller has read it already.
    """
    if mode is None:
        mode = os.environ.get("SPECDEC_KERNEL")
    return (mode != "torch" and 0 < m <= MAX_KERNEL_ROWS and x.dtype == torch.float32
            and x.is_cpu and not x.requires_grad and (_ext is not None or kernel_available()))


prepare_quant = quant.prepare_quant
QuantTensor = quant.QuantTensor


def weight_state(w: PreparedWeight | quant.QuantWeight) -> dict | None:
    """A prepared weight as plain data (tensors, ints, strings) for the prepared-weights cache,
    packed records only; None for a weight held in the fallback's dense fp32 (nothing to gain
    from caching what any load rebuilds the same way)."""
    if w.packed is None:
        return None
    if isinstance(w, quant.QuantWeight):
        return {"kind": "quant", "segments": [list(s) for s in w.segments], "packed": list(w.packed),
                "n": w.n, "k": w.k, "fids": list(w.fids)}
    return {"kind": "panels", "packed": w.packed, "n": w.n, "k": w.k, "dtype": w.dtype}


def weight_from_state(d: dict) -> PreparedWeight | quant.QuantWeight:
    """Inverse of weight_state: the same weight, on the tensors given (a mapped file's)."""
    if d["kind"] == "quant":
        return quant.QuantWeight(tuple((q, n) for q, n in d["segments"]), list(d["packed"]), None,
                                 d["n"], d["k"], fids=tuple(d["fids"]))
    return PreparedWeight(d["packed"], None, d["n"], d["k"], d["dtype"])


def packed_layout(dtype: str) -> str | None:
    """The kernel layout weights of `dtype` get packed in here: "panels" (fp32 / bf16), "q6k"
    or "q6k2" (GGUF blocks; Q6_K in the AVX2 routine's layout or not); None where the torch
    fallback holds dense weights instead."""
    if os.environ.get("SPECDEC_KERNEL") == "torch" or not kernel_available():
        return None
    if dtype != "native":
        return "panels"
    qext = quant._qext()
    if qext is None:
        return None
    return "q6k2" if os.environ.get("SPECDEC_KERNEL") == "avx2" or qext.best_isa() == 2 else "q6k"


def linear(x: torch.Tensor, w: PreparedWeight | quant.QuantWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T (+ bias), like F.linear on the prepared weight."""
    if isinstance(w, quant.QuantWeight):
        return quant.linear(x, w, bias)
    k = w.k
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    mode = os.environ.get("SPECDEC_KERNEL")  # read once: ~0.5 us per lookup
    if w.packed is not None and w.n and _use_kernel(x, x.numel() // k if k else 0, mode):
        # x [..., K] with any strides -> [..., N]; shapes are handled in C++
        # (a Python reshape/view costs ~0.7 us each, comparable to small layers).
        return _ext.linear(x, w.packed, bias, w.n, torch.get_num_threads(),
                           2 if mode == "avx2" else 0)  # isa 0: best available
    return F.linear(x, w.dense, bias)


def _kernel_linear(x: torch.Tensor, w: PreparedWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ kernel for any row count, without dispatch checks (benchmarks use it)."""
    isa = 2 if os.environ.get("SPECDEC_KERNEL") == "avx2" else 0
    return _ext.linear(x, w.packed, bias, w.n, torch.get_num_threads(), isa)
