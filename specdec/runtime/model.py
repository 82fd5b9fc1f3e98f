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

A `Part` builds only some of the model: a range of layers and, or not, the embedding, the final
norm and the output head (pipeline parallel: specdec/distributed/pipeline.py runs `forward`'s
pieces, `plan`, `run_layers`, `final_norm` and `output`, in several processes, to the same bits).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import gguf.quants as gguf_quants
import numpy as np
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


@dataclass(frozen=True)
class Part:
    """The pieces of the model one process builds: layers [first, last), the token embedding,
    the final norm, the output head. embed_rows: keep a block-quantised embedding as stored and
    dequantise only the rows a forward looks up (RowEmbedding), not the whole table in fp32
    (False: the fp32 table, 0.9 GB for Qwen2.5 1.5B, ~0.1-0.2 ms less per forward)."""

    first: int
    last: int
    embed: bool = True
    norm: bool = True
    head: bool = True
    embed_rows: bool = True

    @staticmethod
    def whole(n_layers: int) -> "Part":
        return Part(0, n_layers)

    def needs(self, name: str) -> bool:
        """Whether building this part reads the Hugging Face tensor `name`."""
        if name.startswith("model.layers."):
            return self.first <= int(name.split(".")[2]) < self.last
        if name == "model.embed_tokens.weight":
            return self.embed or self.head  # a tied head is the embedding
        return {"model.norm.weight": self.norm, "lm_head.weight": self.head}.get(name, False)


class RowEmbedding:
    """A block-quantised embedding [V, dim] kept as stored; `emb[tokens]` dequantises the rows
    looked up, to the same bits as the whole table's dequantisation (a block never straddles two
    rows), for ~0.1-0.2 ms a forward instead of V * dim * 4 bytes held (0.9 GB for Qwen2.5 1.5B)."""

    def __init__(self, qt: kernels.QuantTensor, device: torch.device, copy: bool = True):
        # copy: its own memory, where qt's lies in a file mapping that may close (the GGUF
        # reader's); a prepared-weights cache's mapping lives as long as the tensor over it
        self.qt = replace(qt, raw=np.array(qt.raw)) if copy else qt
        self.device = device
        # the format's own block decoder: the values gguf.quants.dequantize gives, without its
        # per-call wrapping (520 us -> 70 us for a Qwen2.5 row, on every forward)
        self._decode = getattr(gguf_quants, qt.qtype).dequantize_blocks
        self._tsize = kernels.quant.QUANT_TYPES[qt.qtype].tsize

    @property
    def shape(self) -> tuple[int, int]:
        return self.qt.shape

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, dim] fp32
        ids = tokens.reshape(-1).cpu().numpy()
        rows = self._decode(self.qt.raw[ids].reshape(-1, self._tsize)).astype(np.float32, copy=False)
        return torch.from_numpy(rows.reshape(len(ids), -1)).view(*tokens.shape, -1).to(self.device)


def rope_tables(head_dim: int, max_pos: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, head_dim // 2] computed in float64 then rounded, like HF's fp32 path."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    return freqs.cos(), freqs.sin()


class Transformer:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], dtype: str = "fp32",
                 device: str = "cpu", part: Part | None = None):
        """state: Hugging Face parameter names (model.layers.N.self_attn.q_proj.weight, ...);
        only those `part` needs are read (default: the whole model)."""
        self.args = args
        self.device = torch.device(device)
        self.weight_dtype = dtype
        self.part = part = part or Part.whole(args.n_layers)
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

        self.embed = None  # [V, dim] (or a RowEmbedding) where the part looks tokens up
        if part.embed:
            w = state["model.embed_tokens.weight"]
            rows = part.embed_rows and isinstance(w, kernels.QuantTensor)
            self.embed = RowEmbedding(w, self.device) if rows else t("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(part.first, part.last):
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
        self.norm = t("model.norm.weight") if part.norm else None
        self.lm_head = None
        if part.head:
            tied = a.tie_embeddings or "lm_head.weight" not in state
            self.lm_head = prep("model.embed_tokens.weight" if tied else "lm_head.weight")
        self._rope()

    def _rope(self) -> None:
        a = self.args
        cos, sin = rope_tables(a.head_dim, a.max_seq_len + 64, a.rope_theta)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)

    # ---- the prepared-weights cache (specdec.runtime.prepared) ---------------------------------
    def export(self) -> dict | None:
        """The model as plain data (ints, strings, tensors: what torch.load(weights_only=True)
        reads back), its weights in the packed form the kernels stream; None where a weight is
        held dense by the torch fallback or lies off the CPU (nothing worth caching)."""
        if self.device.type != "cpu":
            return None

        def w(x):
            if x is None:
                return None
            if isinstance(x, torch.Tensor):
                return {"kind": "tensor", "t": x}
            if isinstance(x, RowEmbedding):
                return {"kind": "rows", "qtype": x.qt.qtype, "raw": torch.from_numpy(x.qt.raw),
                        "shape": list(x.qt.shape)}
            return kernels.weight_state(x)

        layers = [{f.name: w(getattr(lw, f.name)) for f in fields(LayerWeights)} for lw in self.layers]
        out = {"args": asdict(self.args), "dtype": self.weight_dtype, "part": asdict(self.part),
               "embed": w(self.embed), "norm": w(self.norm), "lm_head": w(self.lm_head), "layers": layers}
        # a prepared weight's state is None where the fallback holds it dense
        packed = [lw[n] for lw in layers for n in ("wqkv", "wo", "w_gate_up", "w_down")]
        packed += [out["lm_head"]] if self.lm_head is not None else []
        return None if any(p is None for p in packed) else out

    @classmethod
    def from_export(cls, d: dict) -> "Transformer":
        """The model `export` described, on the tensors given (a mapped cache file's): the
        same weights, so the same bits, as the model that was exported."""
        self = cls.__new__(cls)
        self.args, self.part = ModelArgs(**d["args"]), Part(**d["part"])
        self.device, self.weight_dtype = torch.device("cpu"), d["dtype"]

        def w(x):
            if x is None:
                return None
            if x["kind"] == "tensor":
                return x["t"]
            if x["kind"] == "rows":
                qt = kernels.QuantTensor(x["qtype"], x["raw"].numpy(), tuple(x["shape"]))
                return RowEmbedding(qt, self.device, copy=False)
            return kernels.weight_from_state(x)

        self.embed, self.norm, self.lm_head = w(d["embed"]), w(d["norm"]), w(d["lm_head"])
        self.layers = [LayerWeights(**{k: w(v) for k, v in lw.items()}) for lw in d["layers"]]
        self._rope()
        return self

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, headroom: int = 33) -> KVCache:
        """KV buffers for this part's layers."""
        a = self.args
        return KVCache(len(self.layers), batch_size, a.n_kv_heads, a.head_dim,
                       max_seq_len or a.max_seq_len, headroom=headroom, device=self.device)

    def weight_bytes(self) -> int:
        """Bytes of the weights this part holds, as stored (packed, quantised or fp32)."""
        def size(w) -> int:
            if w is None:
                return 0
            if isinstance(w, torch.Tensor):
                return w.numel() * w.element_size()
            if isinstance(w, RowEmbedding):
                return w.qt.raw.nbytes
            packed = w.packed if isinstance(w.packed, list) else [w.packed]  # QuantWeight: a list
            return sum(size(p) for p in packed) + size(w.fallback)

        layers = [getattr(lw, f.name) for lw in self.layers for f in fields(LayerWeights)]
        return sum(size(w) for w in [self.embed, self.norm, self.lm_head, *layers])

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, return_hidden: bool = False,
                rows: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                slots: torch.Tensor | None = None, taps: tuple[int, ...] = ()):
        """tokens, positions: [B, T] int64. mask: [B, T, T] bool over the new tokens, or None
        for causal. rows: [B] cache rows to use (default 0..B-1). logits_at: [B, n] indices
        into the T new positions that need logits (None: all T); a prefill needs none (n = 0)
        and a catch-up one, and the output head is the largest matmul of a small model.
        slots: [B, T] the KV slot of each new token when it is not its position (a draft tree:
        siblings share a position; needs `mask`, and the history is the slots before slots[:, 0]).
        Returns logits [B, T or n, V] (and the final hidden states [B, T, dim] when
        return_hidden; with `taps`, layer indices, [B, T, (len(taps) + 1) dim]: the residual
        stream after each of those layers, then the final hidden states: a draft head's input)."""
        step = self.plan(positions, rows, mask, slots)
        tapped = [] if taps else None
        x, d = self.run_layers(self.embed[tokens], None, step, cache, taps, tapped)  # x: [B, T, dim]
        hidden = self.final_norm(x, d, step)
        logits = self.output(hidden, logits_at)
        if not return_hidden:
            return logits
        return logits, (torch.cat([*tapped, hidden], -1) if taps else hidden)

    __call__ = forward

    def plan(self, positions: torch.Tensor, rows: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> fused.Step:
        """What every layer of one forward shares (fused.plan on this model's RoPE tables)."""
        return fused.plan(positions, rows, mask, self.cos, self.sin, slots)

    def run_layers(self, x: torch.Tensor, d: torch.Tensor | None, step: fused.Step,
                   cache: KVCache, taps: tuple[int, ...] = (),
                   tapped: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This part's layers on the residual stream x [B, T, dim] (updated in place) plus d, an
        output still to be added to it (None: nothing). Returns (x, d): d is the last layer's MLP
        output, which the next norm adds (x + d is the stream after the last layer). The stream
        after each layer in `taps` (this part's indices) is appended to `tapped`."""
        a = self.args
        H, Hkv, eps = a.n_heads, a.n_kv_heads, a.norm_eps
        fast, linear = step.fast, kernels.linear
        for i, (lw, (kc, vc)) in enumerate(zip(self.layers, cache.layers)):  # kc, vc: [Bc, Hkv, S_cap, D]
            h = fused.add_rms_norm(x, d, lw.attn_norm, eps, fast)
            qkv = linear(h, lw.wqkv, lw.bqkv)  # [B, T, (H + 2 Hkv) D]
            o = fused.attend(step, qkv, kc, vc, H, Hkv)  # [B, T, H D]
            h = fused.add_rms_norm(x, linear(o, lw.wo), lw.ffn_norm, eps, fast)
            d = linear(fused.silu_mul(linear(h, lw.w_gate_up), fast), lw.w_down)
            if i in taps:
                tapped.append(x + d)
        return x, d

    def final_norm(self, x: torch.Tensor, d: torch.Tensor | None, step: fused.Step) -> torch.Tensor:
        """The final hidden states [B, T, dim]: the norm of x + d."""
        return fused.add_rms_norm(x, d, self.norm, self.args.norm_eps, step.fast)

    def output(self, hidden: torch.Tensor, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T or n, V] from the final hidden states [B, T, dim] at logits_at [B, n]
        (None: every position)."""
        linear = kernels.linear
        if logits_at is None:
            return linear(hidden, self.lm_head)  # [B, T, V]
        if logits_at.shape[1] == 0:
            return hidden.new_empty(hidden.shape[0], 0, self.lm_head.n)
        # rows are computed alone or together to the same bits (batch-invariant kernels)
        return linear(select_positions(hidden, logits_at), self.lm_head)  # [B, n, V]


def select_positions(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] at at [B, n] -> [B, n, C]."""
    b = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    return x[b, at]
