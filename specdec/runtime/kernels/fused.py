"""The per-layer glue of a forward between the matmuls: fused C++ ops (fused.cpp) + torch reference.

    step = plan(positions, rows, mask, cos, sin)     # once per forward: what every layer shares
    h = add_rms_norm(x, d, w, eps)                   # x += d in place; rms_norm(x) * w
    o = attend(step, qkv, k_cache, v_cache, H, Hkv)  # RoPE, KV write, GQA attention -> [B, T, H D]
    a = silu_mul(gate_up)                            # silu(gate) * up

`plan` decides once per forward which path runs: the extension (built on first use, like the
matmul's; SPECDEC_KERNEL=torch or a failed build selects the fallback) or the torch reference
below, which is the model's original op-by-op code.  Both compute each row on its own, so a row's
result does not depend on the batch or on T; the two differ by fp32 rounding (reduction order
and exp), which tests/test_fused.py bounds.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runtime.kernels.extension import cpu_has_avx2_fma, load_extension

__all__ = ["Step", "plan", "add_rms_norm", "attend", "silu_mul", "build", "available"]

log = logging.getLogger(__name__)

_ext = None
_tried = False


CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]  # the elementwise ops are torch's, unfused


def build(verbose: bool = False):
    """Compile/load the fused extension (cached on disk, next to the matmul's); None on failure."""
    global _ext, _tried
    if _ext is not None or _tried:
        return _ext
    _tried = True
    if not cpu_has_avx2_fma():
        log.warning("specdec.runtime.kernels.fused: CPU lacks AVX2+FMA; using the torch fallback")
        return None
    _ext = load_extension("specdec_fused", ["fused.cpp"], verbose, CFLAGS)
    return _ext


def available() -> bool:
    return build() is not None


@dataclass
class Step:
    """What every layer of one forward shares.  fast: the extension runs this forward."""

    fast: bool
    positions: torch.Tensor  # [B, T] int64
    rows: torch.Tensor | None  # [B] cache rows, None for 0..B-1
    mask: torch.Tensor | None  # [B, T, T] bool over the new tokens, None for causal
    cos: torch.Tensor  # fast: the whole table [P, D/2]; fallback: gathered [B, 1, T, D/2]
    sin: torch.Tensor
    allowed: torch.Tensor | None = None  # fallback: [B, 1, T, S] bool
    rows_index: object = None  # fallback: slice or [B] index of the cache rows
    S: int = 0  # fallback: slots any query can see
    slots: torch.Tensor | None = None  # [B, T] int64 KV slot of each new token (a draft tree's,
    # with a mask), None: its position


def plan(positions: torch.Tensor, rows: torch.Tensor | None, mask: torch.Tensor | None,
         cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor | None = None) -> Step:
    """positions [B, T]; cos, sin: the model's RoPE tables [P, D/2]; slots [B, T] (only with a
    mask): where each new token's KV goes when that is not its position (a draft tree's siblings
    share a position); the history any new token sees is then the slots before the first one."""
    if slots is not None:
        if mask is None:
            raise ValueError("slots need a mask (a draft tree's)")
        slots = slots.to(torch.int64).contiguous()
    if (os.environ.get("SPECDEC_KERNEL") != "torch" and positions.is_cpu and cos.dtype == torch.float32
            and (_ext is not None or available())):
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else \
            positions.to(torch.int64).contiguous()
        return Step(True, pos, rows, mask, cos, sin, slots=slots)
    B, T = positions.shape
    where = positions if slots is None else slots  # [B, T] the KV slot of each new token
    S = int(where.max()) + 1  # slots any query can see (the fallback's one host sync)
    every = torch.arange(S, device=positions.device)
    if mask is None:
        allowed = every.view(1, 1, S) <= positions.unsqueeze(-1)  # [B, T, S]
    else:
        allowed = every.view(1, 1, S) < where[:, :1].unsqueeze(-1)  # history [B, 1, S]
        allowed = allowed.expand(B, T, S).clone()
        idx = where.unsqueeze(1).expand(B, T, T)  # [B, T, T] slot of each new key
        allowed.scatter_(2, idx, mask.expand(B, T, T))
    return Step(False, positions, rows, mask, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1),
                allowed.unsqueeze(1), slice(0, B) if rows is None else rows, S, slots)


def add_rms_norm(x: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor, eps: float,
                 fast: bool = False) -> torch.Tensor:
    """x [..., C] += d (in place; d may be None); returns rms_norm(x) * w [..., C].
    fast: the forward's Step.fast (the extension, when x is contiguous)."""
    if fast and x.is_contiguous():
        return _ext.add_rms_norm(x, None if d is None else d.contiguous(), w, eps)
    if d is not None:
        x.add_(d)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def silu_mul(gu: torch.Tensor, fast: bool = False) -> torch.Tensor:
    """gu [..., 2I] = [gate | up] -> silu(gate) * up [..., I].  fast: the forward's Step.fast."""
    if fast:
        return _ext.silu_mul(gu.contiguous())
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D/2]; rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attend(step: Step, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, H: int,
           Hkv: int) -> torch.Tensor:
    """qkv [B, T, (H + 2 Hkv) D]; kc, vc [Bc, Hkv, S_cap, D] one layer's cache.  Writes rope(k)
    and v at (rows, positions), returns softmax(q k^T / sqrt(D) | visible) v as [B, T, H D]."""
    if step.fast:
        return _ext.attend(qkv.contiguous(), step.positions, step.cos, step.sin, kc, vc, step.rows,
                           step.mask, H, Hkv, torch.get_num_threads(), step.slots)
    B, T, N = qkv.shape
    D = N // (H + 2 * Hkv)
    positions = step.positions
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rope(q.view(B, T, H, D).transpose(1, 2), step.cos, step.sin)  # [B, H, T, D]
    k = apply_rope(k.view(B, T, Hkv, D).transpose(1, 2), step.cos, step.sin)  # [B, Hkv, T, D]
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    rows = torch.arange(B, device=qkv.device) if step.rows is None else step.rows
    row_idx = rows.view(B, 1).expand(B, T)
    where = positions if step.slots is None else step.slots
    kc[row_idx, :, where] = k.transpose(1, 2)  # index [B, T] -> [B, T, Hkv, D]
    vc[row_idx, :, where] = v.transpose(1, 2)
    keys = kc[step.rows_index, :, :step.S]  # [B, Hkv, S, D]
    values = vc[step.rows_index, :, :step.S]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.allowed,
                                       enable_gqa=True)  # [B, H, T, D]
    return o.transpose(1, 2).reshape(B, T, H * D)
