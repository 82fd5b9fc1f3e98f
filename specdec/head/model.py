"""The draft head: one decoder layer that drafts from the target's own hidden states (EAGLE-style).

One vocabulary (docs/architecture.md): the target's final hidden state f_j at position j is what
its output head turns into the logits for token j + 1. The head reads *pairs*: pair j is
(f_j, x_{j+1}), the feature at position j and the token that followed it. From pair j it predicts
g_j ~ f_{j+1} (the next feature) and, through the target's own output head restricted to a draft
vocabulary, the logits of token x_{j+2}. Drafting k tokens: the committed pairs give d_1 (their
features are the target's, from the verify forward); then pair (g, d_1) gives d_2, and so on, each
step feeding its own predicted feature back in.

    z = fc([rms(embed(x_{j+1})) * w_e ; rms(u_j) * w_f])      embedding: the target's, frozen
    x = z + attn(rms(z) * w_a)                                 RoPE at position j, own KV cache
    x = x + mlp(rms(x) * w_m)                                  SwiGLU
    g = rms(x) * w_o                                           ~ f_{j+1} (the target's final norm)
    logits = g @ W[vocab]^T                                    W: the target's output head rows

u_j is f_j itself, or for a head with `taps` (EAGLE-3's fused features) fuse([rms(h^a_j); ...;
rms(f_j)]), the residual streams after target layers a, b, ... and f_j mixed by a learnt linear
map (it starts as "take f_j", so a tapped head starts where an untapped one does). A drafted pair
feeds the head's own g in u's place, in both kinds.

The draft vocabulary (`vocab` ids, the most frequent tokens of the training data) keeps the head
cheap on a 49k-152k vocabulary; q is zero outside it, which verification handles like any other q
(lossless by construction). The module holds no reference to the engine; the proposer
(specdec.proposers.head) owns the cache lengths, `specdec.head.train` the training loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specdec.errors import SpecdecError
from specdec.runtime.kernels import fused, linear, prepare_int8
from specdec.runtime.model import rope_tables

HEAD_FORMAT = 1  # bumped when the saved layout changes
LINEARS = ("fuse", "fc", "wqkv", "wo", "w_gate_up", "w_down")  # (fuse: only a head with taps)
NORMS = ("w_e", "w_f", "w_a", "w_m", "w_o")
WEIGHTS, CONFIG = "head.safetensors", "head.json"


@dataclass
class HeadConfig:
    """What a saved head is and how it was made (head.json beside head.safetensors)."""

    target: str  # the target's registry name or path, as given to train-head
    target_sha256: str  # of the target's file: a head is only valid for the weights it read
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    norm_eps: float
    vocab_size: int  # the target's vocabulary V
    draft_vocab: int  # Vd: the ids the head can draft
    taps: list[int] = field(default_factory=list)  # target layers whose residual streams it reads
    train: dict = field(default_factory=dict)  # data, seed, steps, tokens, minutes
    held_out: dict = field(default_factory=dict)  # acceptance on prompts never trained on
    format: int = HEAD_FORMAT

    @classmethod
    def for_target(cls, args, target: str, sha256: str, draft_vocab: int, intermediate: int | None = None,
                   taps: tuple[int, ...] = ()):
        return cls(target=target, target_sha256=sha256, dim=args.dim, n_heads=args.n_heads,
                   n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                   intermediate=intermediate or args.intermediate_size, rope_theta=args.rope_theta,
                   norm_eps=args.norm_eps, vocab_size=args.vocab_size, draft_vocab=draft_vocab,
                   taps=list(taps))

    @property
    def feature_dim(self) -> int:
        """Width of the target's features for one pair: the taps' streams, then f_j."""
        return (len(self.taps) + 1) * self.dim


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout. x [B, T, H, D]; cos, sin [B, T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class HeadCache:
    """One layer's KV for the head, per engine row: [rows, Hkv, S, D]. A row holds pairs
    start..length-1 (slot = pair index = RoPE position); start > 0 when the target's features for
    an earlier prefix never reached the head (a prompt served from the target's prefix cache)."""

    def __init__(self, rows: int, n_kv_heads: int, head_dim: int, capacity: int):
        self.k = torch.zeros(rows, n_kv_heads, capacity, head_dim)
        self.v = torch.zeros(rows, n_kv_heads, capacity, head_dim)
        self.capacity = capacity
        self.start = [0] * rows
        self.length = [0] * rows

    @property
    def rows(self) -> int:
        return len(self.length)


class DraftHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        d, H, Hkv, D, inter = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
        self.w_e = nn.Parameter(torch.ones(d))
        self.w_f = nn.Parameter(torch.ones(d))
        if cfg.taps:
            self.fuse = nn.Linear(cfg.feature_dim, d, bias=False)
            with torch.no_grad():  # starts as "take f_j" (the last block): an untapped head's input
                self.fuse.weight.zero_()
                self.fuse.weight[:, -d:] = torch.eye(d)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.w_a = nn.Parameter(torch.ones(d))
        self.wqkv = nn.Linear(d, (H + 2 * Hkv) * D, bias=False)
        self.wo = nn.Linear(H * D, d, bias=False)
        self.w_m = nn.Parameter(torch.ones(d))
        self.w_gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.w_down = nn.Linear(inter, d, bias=False)
        self.w_o = nn.Parameter(torch.ones(d))
        self.register_buffer("vocab", torch.arange(cfg.draft_vocab, dtype=torch.long))  # [Vd] target ids
        with torch.no_grad():  # a residual layer that starts near "pass the input through"
            self.wo.weight.mul_(0.1)
            self.w_down.weight.mul_(0.1)
        self.embed: torch.Tensor | None = None  # [V, d] the target's embedding (not saved)
        self.out: torch.Tensor | None = None  # [Vd, d] the target's output rows for `vocab`
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kernels: dict | None = None  # prepared weights for drafting (`prepare`)
        self._rows: tuple | None = None  # (vocabulary size, ids inside it, their prepared output rows)

    # ---- the target's parts ----------------------------------------------------------------
    def attach(self, embed: torch.Tensor, output: torch.Tensor) -> "DraftHead":
        """Borrow the target's embedding [V, d] and output head [V, d] (fp32; frozen)."""
        if embed.shape[1] != self.cfg.dim or output.shape[1] != self.cfg.dim:
            raise SpecdecError(f"the head was trained for hidden size {self.cfg.dim}, the target has "
                               f"{embed.shape[1]}")
        self.embed = embed
        self.out = output[self.vocab].contiguous()
        self._kernels = self._rows = None
        return self

    def prepare(self) -> "DraftHead":
        """Draft on the runtime's own batch-invariant kernels: each linear as Q8_0 on the int8
        kernels (a quarter of fp32's bytes: between two draft steps the target's forward streams
        its whole weights through the caches, so a step reads the head's from memory) or, where
        those cannot run it, as bf16. Training never calls this (its weights move); `unroll`
        and the unprepared step compute in fp32, which drafting matches up to the int8
        rounding of weights and activations."""
        if self._kernels is not None:  # (engines share a loaded head: quantise it once)
            return self
        self._kernels = {n: prepare_int8(getattr(self, n).weight) for n in LINEARS if hasattr(self, n)}
        self._kernels.update({n: getattr(self, n).detach().float().contiguous() for n in NORMS})
        return self

    def draft_rows(self, vocab_size: int):
        """(draft ids below vocab_size [Vd'], the target's output rows for them prepared like the
        head's weights [Vd', d]): what drafting multiplies g by."""
        if self._rows is None or self._rows[0] != vocab_size:
            keep = self.vocab < vocab_size
            self._rows = (vocab_size, self.vocab[keep], prepare_int8(self.out[keep]))
        return self._rows[1], self._rows[2]

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self._kernels is not None:
            return linear(x.contiguous(), self._kernels[name])
        return getattr(self, name)(x)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 1
        if self._rope is None or self._rope[0].shape[0] < need:
            self._rope = rope_tables(self.cfg.head_dim, max(need, 4096) * 2, self.cfg.rope_theta)
        cos, sin = self._rope
        return cos[positions], sin[positions]

    # ---- the layer, in pieces shared by training and drafting ----------------------------
    def _feature(self, feats: torch.Tensor) -> torch.Tensor:
        """u [B, T, d]: the target's features [B, T, feature_dim] (fused when the head has taps),
        or the head's own g [B, T, d] as it is."""
        f = feats.float()
        d = self.cfg.dim
        if f.shape[-1] == d:
            return f
        parts = f.unflatten(-1, (f.shape[-1] // d, d))
        parts = parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return self._lin("fuse", parts.flatten(-2).contiguous())

    def _input(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z [B, T, d] from features (u_j's source, `_feature`) and next tokens x_{j+1} [B, T]."""
        eps = self.cfg.norm_eps
        e = self.embed[tokens]
        return self._lin("fc", torch.cat([rms(e, self.w_e, eps), rms(self._feature(feats), self.w_f, eps)], -1))

    def _qkv(self, z: torch.Tensor, positions: torch.Tensor):
        """q [B, H, T, D], k, v [B, Hkv, T, D] with RoPE at `positions` [B, T]."""
        c = self.cfg
        B, T, _ = z.shape
        qkv = self._lin("wqkv", rms(z, self.w_a, c.norm_eps))
        q, k, v = qkv.split([c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim], -1)
        cos, sin = self.rope(positions)
        q = rotate(q.view(B, T, c.n_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = rotate(k.view(B, T, c.n_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        return q, k, v.view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)

    def _finish(self, z: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """g [B, T, d] from z and the attention output o [B, H, T, D]."""
        eps = self.cfg.norm_eps
        B, H, T, D = o.shape
        x = z + self._lin("wo", o.transpose(1, 2).reshape(B, T, H * D))
        gate, up = self._lin("w_gate_up", rms(x, self.w_m, eps)).chunk(2, -1)
        x = x + self._lin("w_down", F.silu(gate) * up)
        return rms(x, self.w_o, eps)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd]."""
        return g @ self.out.T

    # ---- training: teacher forcing, unrolled draft steps ---------------------------------
    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, steps: int):
        """[g_1, ..., g_steps], each [B, T, d]: g_s at index j is the head's prediction of
        f_{j+1} after s - 1 draft steps fed its own predictions, as drafting sees it: step s
        at pair j attends the true pairs <= j - s + 1 and the step-t keys at j - s + t
        (t = 2..s; training-time test). feats [B, T, feature_dim] (f_j last), tokens x_{j+1} [B, T]."""
        c = self.cfg
        z = self._input(feats, tokens)
        q, k, v = self._qkv(z, positions)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        g = self._finish(z, o)
        out, keys, values = [g], [k], [v]
        rep = c.n_heads // c.n_kv_heads
        k1, v1 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, T, D]
        T = feats.shape[1]
        for s in range(2, steps + 1):
            prev = torch.cat([g[:, :1], g[:, :-1]], 1)  # index j reads g_{s-1} at j - 1
            z = self._input(prev, tokens)
            q, k, v = self._qkv(z, positions)
            keys.append(k.repeat_interleave(rep, 1))
            values.append(v.repeat_interleave(rep, 1))
            scale = 1.0 / math.sqrt(c.head_dim)
            s1 = (q @ k1.transpose(-1, -2)) * scale  # [B, H, T, T]
            allowed = torch.ones(T, T, dtype=torch.bool).tril(-(s - 1))
            s1 = s1.masked_fill(~allowed, float("-inf"))
            diag, vals = [], []
            for t in range(2, s + 1):
                shift = s - t
                kt = _shift(keys[t - 1], shift)
                vals.append(_shift(values[t - 1], shift))
                d = (q * kt).sum(-1, keepdim=True) * scale  # [B, H, T, 1]
                if shift:
                    d[:, :, :shift] = float("-inf")
                diag.append(d)
            p = torch.cat([s1] + diag, -1).softmax(-1)
            o = p[..., :T] @ v1
            for i, vt in enumerate(vals):
                o = o + p[..., T + i: T + i + 1] * vt
            g = self._finish(z, o)
            out.append(g)
        return out

    # ---- drafting: the cached forward -------------------------------------------------------
    def step(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: HeadCache, rows: list[int], mask: torch.Tensor | None = None,
             slots: torch.Tensor | None = None) -> torch.Tensor:
        """g [B, T, d] for pairs at `positions` [B, T] of cache `rows`; writes their KV at their
        positions, or at `slots` [B, T] with a draft tree's `mask` [B, T, T] (which new pairs
        each new pair sees: its ancestors and itself). Each query attends the row's slots from
        `start` up to its own position, or with a tree those before the first new slot."""
        if self._kernels is not None and not any(cache.start[r] for r in rows):
            return self._step_layer(feats, tokens, positions, cache, rows, mask, slots)
        return self._step_torch(feats, tokens, positions, cache, rows, mask, slots)

    def _step_torch(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    cache: HeadCache, rows: list[int], mask: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
        """`step` in torch ops (training's pieces; a row whose cache starts past slot 0)."""
        z = self._input(feats, tokens)
        q, k, v = self._qkv(z, positions)
        ix = torch.tensor(rows)
        B, T = positions.shape
        where = positions if slots is None else slots
        bi = ix.view(B, 1).expand(B, T)
        cache.k[bi, :, where] = k.transpose(1, 2)
        cache.v[bi, :, where] = v.transpose(1, 2)
        S = int(where.max()) + 1
        K, V = cache.k[ix, :, :S], cache.v[ix, :, :S]  # [B, Hkv, S, D]
        slot = torch.arange(S).view(1, 1, S)
        start = torch.tensor([cache.start[r] for r in rows]).view(B, 1, 1)
        if mask is None:
            allowed = (slot <= positions.unsqueeze(2)) & (slot >= start)
        else:  # history: the slots before the tree's first; then the tree's own mask
            allowed = ((slot < where[:, :1].unsqueeze(2)) & (slot >= start)).expand(B, T, S).clone()
            allowed.scatter_(2, where.unsqueeze(1).expand(B, T, T), mask)
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=allowed.unsqueeze(1), enable_gqa=True)
        return self._finish(z, o)

    def _step_layer(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    cache: HeadCache, rows: list[int], mask: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None) -> torch.Tensor:
        """`step` for a prepared head whose rows' caches start at slot 0: the same layer on the
        runtime's fused glue (the target's own decoder-layer path: norms, RoPE, KV write and
        attention in one call each), a dozen calls where the torch ops are sixty; a draft step
        is mostly glue on a small head. Same arithmetic up to float summation order."""
        c, k = self.cfg, self._kernels
        eps = c.norm_eps
        self.rope(positions)  # (grows the tables to cover positions)
        st = fused.plan(positions, torch.tensor(rows, dtype=torch.int64), mask, *self._rope, slots=slots)
        norm = fused.add_rms_norm
        e = self.embed[tokens]
        f = self._feature(feats).contiguous()
        z = self._lin("fc", torch.cat([norm(e, None, k["w_e"], eps, st.fast),
                                       norm(f, None, k["w_f"], eps, st.fast)], -1))
        qkv = self._lin("wqkv", norm(z, None, k["w_a"], eps, st.fast))
        o = fused.attend(st, qkv, cache.k, cache.v, c.n_heads, c.n_kv_heads)
        h = norm(z, self._lin("wo", o), k["w_m"], eps, st.fast)  # z becomes the residual stream
        d = self._lin("w_down", fused.silu_mul(self._lin("w_gate_up", h), st.fast))
        return norm(z, d, k["w_o"], eps, st.fast)

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: Path, dtype=torch.bfloat16) -> None:
        """head.safetensors (weights in `dtype`, the vocabulary as int32) + head.json."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {n: (t.to(torch.int32) if n == "vocab" else t.detach().to(dtype)).contiguous()
                 for n, t in self.state_dict().items()}
        tmp = path / (WEIGHTS + ".tmp")
        save_file(state, str(tmp), metadata={"format": str(HEAD_FORMAT)})
        tmp.replace(path / WEIGHTS)
        (path / CONFIG).write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "DraftHead":
        path = Path(path).expanduser()
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise SpecdecError(f"head {path} is not a trained head: it needs {CONFIG} and {WEIGHTS} "
                               "(written by `specdec train-head`)", "head")
        try:
            cfg = HeadConfig(**json.loads((path / CONFIG).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise SpecdecError(f"head {path}/{CONFIG} is not a head config ({e})", "head") from None
        if cfg.format != HEAD_FORMAT:
            raise SpecdecError(f"head {path} has format {cfg.format}; this specdec reads format {HEAD_FORMAT}: "
                               "train it again with `specdec train-head`", "head")
        try:
            state = load_file(str(path / WEIGHTS))
        except (SafetensorError, OSError) as e:
            raise SpecdecError(f"head {path}/{WEIGHTS} cannot be read ({e})", "head") from None
        head = cls(cfg)
        state = {n: t.long() if n == "vocab" else t.float() for n, t in state.items()}
        if any(not torch.isfinite(t).all() for n, t in state.items() if n != "vocab"):
            raise SpecdecError(f"head {path}/{WEIGHTS} has non-finite weights", "head")
        head.vocab = torch.empty(cfg.draft_vocab, dtype=torch.long)
        try:
            head.load_state_dict(state)
        except RuntimeError as e:
            raise SpecdecError(f"head {path}/{WEIGHTS} does not match {CONFIG} ({str(e).splitlines()[0]})",
                               "head") from None
        if int(head.vocab.min()) < 0 or int(head.vocab.max()) >= cfg.vocab_size:
            raise SpecdecError(f"head {path}: draft vocabulary ids outside [0, {cfg.vocab_size})", "head")
        return head.eval()


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, H, T, D] moved n steps later along T (index j reads j - n; the first n are zeros)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :, :n]), x[:, :, :-n]], 2)
