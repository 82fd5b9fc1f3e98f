"""Decoder-only transformer for the Llama family (Llama, SmolLM2, Mistral-style) and Qwen2.

RMSNorm, RoPE with the checkpoint's theta (rotate-half layout, as in Hugging Face checkpoints),
grouped-query attention, SwiGLU, tied or untied output head, optional q/k/v biases. The weights are
plain tensors (no nn.Module tree) so a decode step costs few Python calls; q/k/v and gate/up are
fused into one matmul each.

`forward(tokens [B, T], positions [B, T], cache)` writes the new keys/values at `positions` and
returns logits [B, T, V]. It never moves the cache's lengths; the caller does. Each query attends
to cache slots <= its own position (causal), or, with an explicit `mask` [B, T, T] over the new
tokens, to every slot before the block's first position plus the new tokens the mask allows.
The module knows nothing about tokenizers, sampling or speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.config import ModelArgs
from specdec.kv_cache import KVCache


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wqkv: object  # prepared [(H + 2 Hkv) * D, dim]
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) * D]
    wo: object  # prepared [dim, H * D]
    ffn_norm: torch.Tensor  # [dim]
    w_gate_up: object  # prepared [2 * I, dim]
    w_down: object  # prepared [dim, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, head_dim // 2] computed in float64 then rounded, like HF's fp32 path."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D/2]; rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
                rows: torch.Tensor | None = None):
        """tokens, positions: [B, T] int64. mask: [B, T, T] bool over the new tokens, or None
        for causal. rows: [B] cache rows to use (default 0..B-1). Returns logits [B, T, V]
        (and the final hidden states [B, T, dim] when return_hidden)."""
        a = self.args
        B, T = tokens.shape
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        if rows is None:  # the common case: batch row b is cache row b; views, no copies
            rows_slice = slice(0, B)
            rows = torch.arange(B, device=self.device)
        else:
            rows_slice = rows
        S = int(positions.max()) + 1  # slots any query can see
        assert S <= cache.capacity, (S, cache.capacity)
        slots = torch.arange(S, device=self.device)
        if mask is None:
            allowed = slots.view(1, 1, S) <= positions.unsqueeze(-1)  # [B, T, S]
        else:
            allowed = slots.view(1, 1, S) < positions[:, :1].unsqueeze(-1)  # history [B, 1, S]
            allowed = allowed.expand(B, T, S).clone()
            idx = positions.unsqueeze(1).expand(B, T, T)  # [B, T, T] slot of each new key
            allowed.scatter_(2, idx, mask)
        allowed = allowed.unsqueeze(1)  # [B, 1, T, S]
        cos = self.cos[positions].unsqueeze(1)  # [B, 1, T, D/2]
        sin = self.sin[positions].unsqueeze(1)
        row_idx = rows.view(B, 1).expand(B, T)

        x = self.embed[tokens]  # [B, T, dim]
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw.attn_norm, a.norm_eps)
            qkv = kernels.linear(h, lw.wqkv, lw.bqkv)  # [B, T, (H + 2 Hkv) D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = apply_rope(q.view(B, T, H, D).transpose(1, 2), cos, sin)  # [B, H, T, D]
            k = apply_rope(k.view(B, T, Hkv, D).transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            kc, vc = cache.k[li], cache.v[li]  # [Bc, Hkv, S_cap, D]
            kc[row_idx, :, positions] = k.transpose(1, 2)  # index [B, T] -> [B, T, Hkv, D]
            vc[row_idx, :, positions] = v.transpose(1, 2)
            keys = kc[rows_slice, :, :S]  # [B, Hkv, S, D]
            values = vc[rows_slice, :, :S]
            o = kernels.attention(q, keys, values, allowed)  # batch-invariant rows
            o = o.transpose(1, 2).reshape(B, T, H * D)
            x = x + kernels.linear(o, lw.wo)
            h = rms_norm(x, lw.ffn_norm, a.norm_eps)
            gate, up = kernels.linear(h, lw.w_gate_up).chunk(2, dim=-1)
            x = x + kernels.linear(F.silu(gate) * up, lw.w_down)
        hidden = rms_norm(x, self.norm, a.norm_eps)
        logits = kernels.linear(hidden, self.lm_head)  # [B, T, V]
        return (logits, hidden) if return_hidden else logits

    __call__ = forward
