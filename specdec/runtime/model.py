"""Decoder-only transformer for the Llama family (Llama, SmolLM2, Mistral-style) and Qwen2.

RMSNorm, RoPE with the checkpoint's theta (rotate-half layout, as in Hugging Face checkpoints),
grouped-query attention, SwiGLU, tied or untied output head, optional q/k/v biases. The weights are
plain tensors (no nn.Module tree) so a decode step costs few Python calls; q/k/v and gate/up are
fused into one matmul each, and what runs between the matmuls is three fused ops per sub-layer
(specdec/runtime/kernels/fused.py: residual add + RMSNorm; RoPE + KV write + attention; SiLU * up).

`forward(tokens [B, T], positions [B, T], cache)` writes the new keys/values at `positions` and
returns logits [B, T, V]. It never moves the cache's lengths; the caller does. Each query attends
to cache slots <= its own position (causal), or, with an explicit `mask` [B, T, T] over the new
tokens, to every slot before the block's first position plus the new tokens the mask allows.
The module knows nothing about tokenizers, sampling or speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels import fused
from specdec.config import ModelArgs
from specdec.runtime.kv_cache import KVCache


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wqkv: object  # prepared [(H + 2 Hkv) * D, dim]
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) * D]
    wo: object  # prepared [dim, H * D]
    ffn_norm: torch.Tensor  # [dim]
    w_gate_up: object  # prepared [2 * I, dim]
    w_down: object  # prepared [dim, I]


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, head_dim // 2] computed in float64 then rounded, like HF's fp32 path."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    return freqs.cos(), freqs.sin()


class Transformer:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: str = "fp32",
                 device: str = "cpu"):
        """state: Hugging Face parameter names (model.layers.N.self_attn.q_proj.weight, ...)."""
        self.args = args
        self.device = torch.device(device)
        self.weight_dtype = dtype
        a = args

        def t(name):  # fp32 on device; a GGUF-quantised tensor ("native") is dequantised
            w = state[name]
            return (w.dequantize() if isinstance(w, kernels.QuantTensor) else w).to(self.device, torch.float32)

        def prep(*names):  # row blocks of one (fused) weight, prepared for kernels.linear
            ws = [state[n] for n in names]
            if all(isinstance(w, kernels.QuantTensor) for w in ws):  # "native": stays quantised
                return kernels.prepare_quant(ws)
            w = torch.cat([t(n) for n in names], 0) if len(names) > 1 else t(names[0])
            return kernels.prepare_weight(w.contiguous(), "fp32" if dtype == "native" else dtype)

        self.embed = t("model.embed_tokens.weight")  # [V, dim]
        self.layers: list[LayerWeights] = []
        for i in range(a.n_layers):
            p = f"model.layers.{i}."
            bqkv = (torch.cat([t(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
                    if a.qkv_bias else None)
            self.layers.append(LayerWeights(
                attn_norm=t(p + "input_layernorm.weight"),
                wqkv=prep(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")), bqkv=bqkv,
                wo=prep(p + "self_attn.o_proj.weight"),
                ffn_norm=t(p + "post_attention_layernorm.weight"),
                w_gate_up=prep(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                w_down=prep(p + "mlp.down_proj.weight"),
            ))
        self.norm = t("model.norm.weight")
        tied = a.tie_embeddings or "lm_head.weight" not in state
        self.lm_head = prep("model.embed_tokens.weight" if tied else "lm_head.weight")
        cos, sin = rope_tables(a.head_dim, a.max_seq_len + 64, a.rope_theta)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, headroom: int = 33) -> KVCache:
        a = self.args
        return KVCache(a.n_layers, batch_size, a.n_kv_heads, a.head_dim,
                       max_seq_len or a.max_seq_len, headroom=headroom, device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, return_hidden: bool = False,
                rows: torch.Tensor | None = None, logits_at: torch.Tensor | None = None):
        """tokens, positions: [B, T] int64. mask: [B, T, T] bool over the new tokens, or None
        for causal. rows: [B] cache rows to use (default 0..B-1). logits_at: [B, n] indices
        into the T new positions that need logits (None: all T); a prefill needs none (n = 0)
        and a catch-up one, and the output head is the largest matmul of a small model.
        Returns logits [B, T or n, V] (and the final hidden states [B, T, dim] when
        return_hidden)."""
        a = self.args
        H, Hkv, eps = a.n_heads, a.n_kv_heads, a.norm_eps
        step = fused.plan(positions, rows, mask, self.cos, self.sin)  # what every layer shares
        fast, linear = step.fast, kernels.linear
        x = self.embed[tokens]  # [B, T, dim], the residual stream, updated in place
        d = None  # the last layer's MLP output, added at the next norm
        for lw, (kc, vc) in zip(self.layers, cache.layers):  # kc, vc: [Bc, Hkv, S_cap, D] views
            h = fused.add_rms_norm(x, d, lw.attn_norm, eps, fast)
            qkv = linear(h, lw.wqkv, lw.bqkv)  # [B, T, (H + 2 Hkv) D]
            o = fused.attend(step, qkv, kc, vc, H, Hkv)  # [B, T, H D]
            h = fused.add_rms_norm(x, linear(o, lw.wo), lw.ffn_norm, eps, fast)
            d = linear(fused.silu_mul(linear(h, lw.w_gate_up), fast), lw.w_down)
        hidden = fused.add_rms_norm(x, d, self.norm, eps, fast)
        if logits_at is None:
            logits = linear(hidden, self.lm_head)  # [B, T, V]
        elif logits_at.shape[1] == 0:
            logits = hidden.new_empty(hidden.shape[0], 0, self.lm_head.n)
        else:  # rows are computed alone or together to the same bits (batch-invariant kernels)
            b = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1)
            logits = linear(hidden[b, logits_at], self.lm_head)  # [B, n, V]
        return (logits, hidden) if return_hidden else logits

    __call__ = forward
