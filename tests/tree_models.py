"""Tiny target and draft "models" as explicit conditional tables, and the machinery that gets the
exact (enumerated) and the sampled distribution of tree speculative decoding over them.

- `Tables`: p(. | h), q(. | h) for every output prefix h up to length L over V tokens: random
  logits keyed by the prefix, through specdec.sampling's transforms (so the transformed p *is*
  the target), renormalised in float64. A third table scores n-gram-like candidates that have
  nothing to do with q.
- `LazyRow`: one round's tree as `specdec.tree.walk_reference` reads it, drafted lazily: a
  candidate is drafted (with the same `next_without_replacement` the drafter uses) only when the
  walk first tries it. Subtrees the walk never enters are independent of everything it does
  (they are drafted from their own prefix with fresh randomness), so leaving them undrafted
  changes no probability; it keeps the enumeration small. Nodes deeper than the tokens still
  needed are left out for the same reason: they can only change tokens past the horizon.
- `joint_exact(round_fn)`: the exact joint of the first n tokens, by dynamic programming over
  committed prefixes and `enumerate_outcomes` (specdec.tools.distribution) over one round's
  choices: every draft draw, accept/reject coin and recovered/bonus sample is a branch weighted
  by its probability.
- `sample_rounds`: counts of the first n tokens from the batched fast path (`draft_tree` +
  `tree_verify_stochastic`), rows of a batch each decoding their own sequence.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from specdec import sampling, tree
from specdec.config import SamplingParams
from specdec.rejection import TorchRng
from specdec.tools.distribution import enumerate_outcomes

KINDS = ("top_m", "sampled", "ngram")  # candidates: top-m of q, m draws from q w/o replacement, fixed


class Tables:
    def __init__(self, V: int, L: int, params: SamplingParams, seed: int = 0, p_scale=1.0, q_scale=1.5):
        self.V = V
        n = (V ** (L + 1) - 1) // (V - 1)  # prefixes of length <= L: code(()) = 0, code(h + (x,)) = code(h) V + x + 1
        g = torch.Generator().manual_seed(seed)
        self.p = self._probs(torch.randn(n, V, generator=g) * p_scale, params)  # [n, V] float64
        self.q = self._probs(torch.randn(n, V, generator=g) * q_scale, params)
        self.score = torch.rand(n, V, generator=g, dtype=torch.float64)  # n-gram-like candidates: top-m

    @staticmethod
    def _probs(logits, params):
        p = sampling.probabilities(logits, params).double()
        return p / p.sum(-1, keepdim=True)

    def code(self, h) -> int:
        c = 0
        for x in h:
            c = c * self.V + int(x) + 1
        return c

    def target_joint(self, n: int = 3) -> dict:
        level = {(): 1.0}
        for _ in range(n):
            level = {h + (x,): w * float(pr) for h, w in level.items()
                     for x, pr in enumerate(self.p[self.code(h)]) if pr > 0}
        return level

    def position_codes(self, base: torch.Tensor, tokens: torch.Tensor | None, parents) -> torch.Tensor:
        """[B, N + 1] prefix codes of every position of a tree below committed prefixes base [B]."""
        N = len(parents)
        codes = base.view(-1, 1).repeat(1, N + 1)
        if tokens is not None:
            for j, u in enumerate(parents.tolist()):
                codes[:, j + 1] = codes[:, u + 1] * self.V + tokens[:, j] + 1
        return codes


def prune(parents, depth: int) -> torch.Tensor:
    """parents of the subtree of nodes at depth <= depth (a prefix: nodes are breadth-first)."""
    keep = tree.depths(parents)[1:] <= depth
    assert keep.cumprod(0).sum() == keep.sum(), "prune needs breadth-first node order"
    return parents[keep]


class LazyRow:
    """A tree below committed prefix h, drafted as `walk_reference` tries candidates.
    record: "drawn" records the q each candidate was drawn from (q without the earlier siblings);
    "full" records the parent's whole q (the with-replacement control)."""

    def __init__(self, tables: Tables, h: tuple, parents, kind: str, rng, record: str = "drawn"):
        self.t, self.kind, self.rng, self.record = tables, kind, rng, record
        self.kids = tree.children(parents)
        self.prefix = {0: tuple(h)}
        self.drawn: dict[int, tuple[int, list | None]] = {}
        self.at = 0  # the last position whose p the walk read: where its final sample is from

    def children(self, u: int):
        code = self.t.code(self.prefix[u])
        if self.kind != "sampled":
            scores = (self.t.q if self.kind == "top_m" else self.t.score)[code]
            tokens, _, _ = tree.draft_children(scores.unsqueeze(0), len(self.kids[u]))
            for j, c in zip(self.kids[u], tokens[0].tolist()):
                self._add(u, j, c, None)
                yield j
            return
        rest = self.t.q[code].unsqueeze(0)  # [1, V]
        for j in self.kids[u]:
            c, q_i, ok, rest = tree.next_without_replacement(rest, self.rng)
            if not bool(ok[0]):
                return  # q's support is used up: this candidate and the later ones do not exist
            q_rec = q_i[0] if self.record == "drawn" else self.t.q[code]
            self._add(u, j, int(c[0]), q_rec.tolist())
            yield j

    def _add(self, u, j, c, q):
        self.drawn[j] = (c, q)
        self.prefix[j + 1] = self.prefix[u] + (c,)

    def token(self, j: int) -> int:
        return self.drawn[j][0]

    def q(self, j: int):
        return self.drawn[j][1]

    def p(self, u: int) -> list[float]:
        self.at = u
        return self.t.p[self.t.code(self.prefix[u])].tolist()


class EnumDice:
    """walk_reference's dice answered by an enumerator (EnumRng): each coin and sample is a
    branch. A final sample past the horizon (the walk already emitted enough tokens) is not
    drawn: it cannot change the first n tokens."""

    def __init__(self, rng, row: LazyRow, depth_of, horizon: int):
        self.rng, self.row, self.depth_of, self.horizon = rng, row, depth_of, horizon

    def coin(self, j: int, prob: float) -> bool:
        return bool(self.rng.bernoulli(torch.tensor([prob], dtype=torch.float64))[0])

    def sample(self, probs: list[float]) -> int:
        if self.depth_of[self.row.at] >= self.horizon:
            return -1
        return int(self.rng.categorical(torch.tensor([probs], dtype=torch.float64))[0])


def reference_round(tables: Tables, parents, kind: str, n: int = 3, record: str = "drawn"):
    """round_fn(h, rng) -> emitted tokens (up to the horizon) of one reference round below h."""
    def round_fn(h, rng):
        horizon = n - len(h)
        par = prune(parents, horizon)
        row = LazyRow(tables, h, par, kind, rng, record)
        _, emitted = tree.walk_reference(row, EnumDice(rng, row, tree.depths(par).tolist(), horizon))
        return tuple(emitted[:horizon])
    return round_fn


def fast_round(tables: Tables, parents, kind: str, n: int = 3):
    """round_fn(h, rng) -> emitted tokens of one fast-path round (one row): draft_tree, then
    tree_verify_stochastic, every coin of the tree drawn (small trees only)."""
    def round_fn(h, rng):
        tok, q, valid = draft(tables, torch.tensor([tables.code(h)]), parents, kind, rng)
        p = tables.p[tables.position_codes(torch.tensor([tables.code(h)]), tok, parents)]
        res = tree.tree_verify_stochastic(p, q, tok, parents, rng, valid)
        return tuple(res.tokens[0, :int(res.num_emitted[0])].tolist())[:n - len(h)]
    return round_fn


def draft(tables: Tables, base: torch.Tensor, parents, kind: str, rng, record: str = "drawn"):
    """draft_tree below committed prefixes base [B] (codes); record "full": every child's q
    replaced by its parent's whole q (the with-replacement control)."""
    source = tables.score if kind == "ngram" else tables.q
    seen = {}

    def q_fn(u, tokens):
        code = base
        for j in tree.path_to(parents, u - 1):
            code = code * tables.V + tokens[:, j] + 1
        seen[u] = source[code]
        return seen[u]
    tok, q, valid = tree.draft_tree(parents, q_fn, rng if kind == "sampled" else None)
    if q is not None and record == "full":
        for u, js in enumerate(tree.children(parents)):
            if js:
                q[:, js] = seen[u].unsqueeze(1)
    return tok, q, valid


def joint_exact(round_fn, n: int = 3) -> dict:
    joint: dict = defaultdict(float)
    frontier = {(): 1.0}
    while frontier:
        nxt: dict = defaultdict(float)
        for h, w in frontier.items():
            for out, pw in enumerate_outcomes(lambda rng, h=h: round_fn(h, rng)).items():
                seq = h + out
                (joint if len(seq) >= n else nxt)[seq[:n]] += w * pw
        frontier = nxt
    return dict(joint)


def max_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def sample_rounds(tables: Tables, parents, kind: str, n_samples: int, seed: int, n: int = 3,
                  batch: int = 50_000, record: str = "drawn") -> dict:
    """Counts of the first n tokens: each row decodes its own sequence, round after round, with
    the batched fast path (draft_tree + tree_verify_stochastic), one TorchRng for everything.
    Returns (counts {tokens: n}, rounds by number of accepted nodes [N + 1])."""
    rng, V = TorchRng(seed), tables.V
    cells = torch.zeros(V ** n, dtype=torch.long)
    accepted = torch.zeros(len(parents) + 1, dtype=torch.long)  # rounds by accepted nodes
    for start in range(0, n_samples, batch):
        B = min(batch, n_samples - start)
        out = torch.zeros(B, dtype=torch.long)  # base-V code of the tokens so far
        length = torch.zeros(B, dtype=torch.long)
        code = torch.zeros(B, dtype=torch.long)  # Tables prefix code
        while (length < n).any():
            live = (length < n).nonzero().squeeze(1)
            tok, q, valid = draft(tables, code[live], parents, kind, rng, record)
            p = tables.p[tables.position_codes(code[live], tok, parents)]  # [b, N + 1, V]
            res = tree.tree_verify_stochastic(p, q, tok, parents, rng, valid)
            accepted += torch.bincount(res.num_emitted - 1, minlength=len(accepted))
            for i in range(res.tokens.shape[1]):
                take = (i < res.num_emitted) & (length[live] < n)
                x = res.tokens[:, i].clamp_min(0)
                out[live] = torch.where(take, out[live] * V + x, out[live])
                code[live] = torch.where(take, code[live] * V + x + 1, code[live])
                length[live] += take.long()
        cells += torch.bincount(out, minlength=V ** n)
    counts = {tuple(c // V ** (n - 1 - i) % V for i in range(n)): int(k) for c, k in enumerate(cells.tolist()) if k}
    return counts, accepted.tolist()
