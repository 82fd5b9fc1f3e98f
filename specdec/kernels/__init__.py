"""Few-row linear layers on CPU that read each weight from memory once.

Speculative decoding verifies k+1 tokens in one forward, so a linear layer
sees M = 1..16 rows.  Torch/MKL switch from gemv to a GEMM path at M >= 2 and
the cost jumps; the C++ kernel (linear.cpp) streams a prepacked weight once and
applies it to all M rows while it is in registers/L1, on torch's thread count.

    pw = prepare_weight(w)            # w: [N, K] fp32, as F.linear takes it
    y = linear(x, pw, bias)           # x: [..., K] -> y: [..., N]

The kernel runs when the extension is available, x is an fp32 CPU tensor and
M = x.numel() // K <= MAX_KERNEL_ROWS (256); anything else goes to F.linear on the
same math (for "bf16" storage: weights rounded to bf16, fp32 accumulation).
SPECDEC_KERNEL=torch forces the fallback; SPECDEC_KERNEL=auto (default) uses
the extension if it builds and the CPU has AVX2+FMA, with its AVX-512 tiles
when the CPU has those (same results bit for bit); SPECDEC_KERNEL=avx2 keeps
it on the AVX2 tiles.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["PreparedWeight", "prepare_weight", "linear", "kernel_available", "kernel_isa", "build",
           "MAX_KERNEL_ROWS", "NR"]

log = logging.getLogger(__name__)

# Largest row count sent to the C++ kernel; more rows go to F.linear (MKL).
# Measured on the dev box (Zen 5, 1 thread, fp32 and bf16; benchmarks/kernels.py
# --crossover for 2 threads): the kernel is >= 1.5x F.linear at every M up to
# 2048 on its AVX-512 tiles, and >= 1.15x up to M = 256 on its AVX2 tiles, at
# parity around M = 512..1024 (MKL runs AVX2 code on this AMD CPU).  256 keeps
# the AVX2 path on the winning side, and covers speculative verification
# (M = k+1 <= 16) with room for short prefills, which then get the same
# batch-invariant arithmetic as decoding.
MAX_KERNEL_ROWS = 256
NR = 16  # output features per packed panel; must match NR in linear.cpp

_SRC = Path(__file__).with_name("linear.cpp")
_ext = None          # the loaded extension module, once built
_build_tried = False  # build at most once per process, even if it failed


@dataclass(frozen=True, eq=False)
class PreparedWeight:
    """A weight packed for the kernel, plus what the torch fallback needs.

    packed: fp32 [P, K, NR] panels, or int16 [P, K, NR] bf16 bits with lanes
            interleaved (j, 8+j) -- see linear.cpp; P = ceil(N / NR), zero-padded.
    dense:  [N, K] weight for the fallback: the caller's fp32 tensor (shared,
            not copied, when it is already contiguous fp32), or the
            bf16-rounded weight as torch.bfloat16 (widened per fallback call).
    """

    packed: torch.Tensor
    dense: torch.Tensor
    n: int
    k: int
    dtype: str  # "fp32" | "bf16"

    def dense_fp32(self) -> torch.Tensor:
        """[N, K] fp32 weight with exactly the values the kernel multiplies by."""
        return self.dense if self.dtype == "fp32" else self.dense.float()


def prepare_weight(w: torch.Tensor, dtype: str = "fp32") -> PreparedWeight:
    """Pack w [N, K] (out_features x in_features) for `linear`."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if w.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
    n, k = w.shape
    p = -(-n // NR)
    padded = w.new_zeros(p * NR, k)
    padded[:n] = w
    panels = padded.view(p, NR, k).transpose(1, 2)  # [P, K, NR]
    if dtype == "fp32":
        return PreparedWeight(panels.contiguous(), w, n, k, dtype)
    # Round-to-nearest-even to bf16 (torch's rounding), keep the bits as int16.
    bits = panels.to(torch.bfloat16).contiguous().view(torch.int16)  # [P, K, NR]
    # Interleave so 32-bit lane j holds (feature j, feature 8+j).
    order = torch.arange(NR).view(2, NR // 2).t().reshape(-1)  # 0,8,1,9,...,7,15
    return PreparedWeight(bits[..., order].contiguous(), w.to(torch.bfloat16), n, k, dtype)


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    # Not Linux: torch's dispatch level implies AVX2+FMA when it is AVX2 or higher.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _build_dir() -> Path:
    root = os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")
    return Path(root).expanduser() / "ext"


def build(verbose: bool = False):
    """Compile/load the extension (cached on disk); returns it, or None on failure."""
    global _ext, _build_tried
    if _ext is not None or _build_tried:
        return _ext
    _build_tried = True
    if not _cpu_has_avx2_fma():
        log.warning("specdec.kernels: CPU lacks AVX2+FMA; using the torch fallback")
        return None
    try:
        from torch.utils import cpp_extension

        # ninja lives next to the interpreter in a venv that was not activated.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        bdir = _build_dir()
        bdir.mkdir(parents=True, exist_ok=True)
        _ext = cpp_extension.load(
            name="specdec_linear",
            sources=[str(_SRC)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(bdir),
            verbose=verbose,
        )
    except Exception as e:  # noqa: BLE001 -- any build failure means "fall back"
        log.warning("specdec.kernels: extension build failed, using torch fallback: %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        _ext = None
    return _ext


def kernel_available() -> bool:
    """True if the C++ kernel can run here (builds it on first call)."""
    return build() is not None


def kernel_isa() -> str:
    """Instruction set `linear` runs the kernel with here: "avx512", "avx2" or "none"."""
    if not kernel_available():
        return "none"
    return "avx2" if os.environ.get("SPECDEC_KERNEL") == "avx2" or _ext.best_isa() == 2 else "avx512"


def _use_kernel(x: torch.Tensor, m: int, mode: str | None = None) -> bool:
    """Dispatch rule for `linear`: kernel for up to MAX_KERNEL_ROWS fp32 CPU rows.

    mode: the SPECDEC_KERNEL value, if the caller has read it already.
    """
    if mode is None:
        mode = os.environ.get("SPECDEC_KERNEL")
    return (mode != "torch" and 0 < m <= MAX_KERNEL_ROWS and x.dtype == torch.float32
            and x.is_cpu and not x.requires_grad and (_ext is not None or kernel_available()))


def linear(x: torch.Tensor, w: PreparedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T (+ bias), like F.linear on the prepared weight."""
    k = w.k
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    mode = os.environ.get("SPECDEC_KERNEL")  # read once: ~0.5 us per lookup
    if _use_kernel(x, x.numel() // k if k else 0, mode):
        # x [..., K] with any strides -> [..., N]; shapes are handled in C++
        # (a Python reshape/view costs ~0.7 us each, comparable to small layers).
        return _ext.linear(x, w.packed, bias, w.n, torch.get_num_threads(),
                           2 if mode == "avx2" else 0)  # isa 0: best available
    return F.linear(x, w.dense_fp32(), bias)


def _kernel_linear(x: torch.Tensor, w: PreparedWeight,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ kernel for any row count, without dispatch checks (benchmarks use it)."""
    isa = 2 if os.environ.get("SPECDEC_KERNEL") == "avx2" else 0
    return _ext.linear(x, w.packed, bias, w.n, torch.get_num_threads(), isa)
