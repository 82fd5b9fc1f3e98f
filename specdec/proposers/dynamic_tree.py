"""Dynamic draft trees (EAGLE-2): each row's tree grown by the draft's own confidence.

`--draft-tree dynamic[:N]`. A fixed shape gives every node the same number of children; the
draft knows better where its guesses are uncertain. Per row, for a round of depth k:

  - the root's BEAM most likely tokens (under the request's transforms) are candidates at depth 1,
    each scored by its log-probability under the draft;
  - at depth d = 2..k, the BEAM best-scored candidates of depth d - 1 are expanded: one draft
    forward over them and their ancestors (tree attention), and each gets its BEAM most likely
    children, scored by the path's summed log-probability;
  - the N best-scored candidates of all depths form the round's tree. A child's score is at most
    its parent's, so the N best (ties broken towards the shallower node) always include every
    selected node's ancestors: the selection is a tree.

Lossless: every node is a *deterministic candidate* (a function of the draft's logits on the
committed tokens, never a draw), siblings are distinct tokens, and the verifier takes them with
the deterministic-candidate rule (specdec.tree: accept a child with probability r(c), else zero
it and renormalise r; greedy and seed-stable rows take the child equal to their own token), which
is exact for any candidate set chosen without looking at the target. Sampled rows' q is not
recorded (Proposal.deterministic). The proposers supply the forwards: `root` logits per row and
`level(...)`, the logits of the nodes to expand given the fed nodes (draft model and head alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import rejection, sampling
from specdec.tree import ancestor_mask

BEAM = 4  # candidates expanded per depth, and children per expanded candidate (EAGLE-2's top-k)


@dataclass
class Pool:
    """One row's candidates, in the order they were drafted (so a parent precedes its children)."""

    parent: list[int] = field(default_factory=list)  # pool index, -1: the root
    token: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # summed draft log-probability of the path
    depth: list[int] = field(default_factory=list)  # 1: the root's children

    def add(self, parent: int, token: int, score: float, depth: int) -> None:
        self.parent.append(parent)
        self.token.append(token)
        self.score.append(score)
        self.depth.append(depth)

    def ancestors(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parent[i]
        return out


def top_candidates(req, logits: torch.Tensor, n: int, offset: int) -> list[tuple[int, float]]:
    """The n most likely next tokens [(token, log-probability)] from draft logits [V] under the
    request's transforms (greedy rows: the raw logits; seed-stable rows: ranked with the Gumbel
    noise of the children's output position, `offset` past the committed ones, so the first is
    the draft coupled to the target's own token). Tokens the transforms rule out are never
    candidates."""
    p = req.params
    lg = logits.float().unsqueeze(0)
    if not p.greedy:
        lg = sampling.filter_logits(lg, p)
    logp = lg.log_softmax(-1)[0]
    rank = lg
    if not p.greedy and p.stable:
        rank = lg + rejection.stable_noise([req], [0], 1, lg.shape[-1], lg.device, start=offset)
    top = rank[0].topk(min(n, rank.shape[-1]))
    return [(t, float(logp[t])) for t, v in zip(top.indices.tolist(), top.values.tolist())
            if v != float("-inf") and logp[t] != float("-inf")]


def select(pool: Pool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [m], tokens [m]) of the n best-scored candidates (m <= n), breadth-first."""
    best = sorted(range(len(pool.token)), key=lambda i: (-pool.score[i], pool.depth[i], i))[:n]
    keep = sorted(best, key=lambda i: (pool.depth[i], i))
    where = {i: j for j, i in enumerate(keep)}
    parents = torch.tensor([-1 if pool.parent[i] < 0 else where[pool.parent[i]] for i in keep], dtype=torch.long)
    tokens = torch.tensor([pool.token[i] for i in keep], dtype=torch.long)
    return parents, tokens


def union(trees: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The union trie of trees [(parents [m_i], tokens [m_i])], each a parent before its
    children, as (parents, tokens) of at most n nodes, breadth-first: the trees' nodes are added
    in order (the first tree's, then the next's) while there is room; a node whose path is
    already there is shared, one whose parent was left out is left out. Siblings stay distinct
    tokens, so the union is a set of deterministic candidates when each tree is."""
    pool, child = Pool(), {}  # child: (pool parent, token) -> pool index
    for parents, tokens in trees:
        where = {}  # this tree's node -> pool index
        for j, (p, t) in enumerate(zip(parents.tolist(), tokens.tolist())):
            if p >= 0 and p not in where:
                continue
            up = where[p] if p >= 0 else -1
            c = child.get((up, t))
            if c is None:
                if len(pool.token) == n:
                    continue
                c = child[(up, t)] = len(pool.token)  # scored by insertion: select keeps them all
                pool.add(up, t, -float(c), 1 if up < 0 else pool.depth[up] + 1)
            where[j] = c
    return select(pool, n)


@dataclass
class Level:
    """One row's part of a growth forward: the fed candidates (pool indices, ascending, so in
    topological order), their parents among them (-1: the root), tokens and depths, and which of
    them (positions in `pool_ids`) are expanded."""

    pool_ids: list[int]
    parents: torch.Tensor  # [m]
    tokens: list[int]
    depths: list[int]
    expand: list[int]

    @property
    def mask(self) -> torch.Tensor:
        """[m, m] each fed node sees itself and its ancestors among the fed."""
        return ancestor_mask(self.parents)[1:, 1:]


def level_layout(levels: list[Level], base: list[int]):
    """The batched layout of one growth forward: (tokens, positions, slots, mask), each [n, M]
    (mask [n, M, M]). Row b's candidate j sits at slot base[b] + j and position
    base[b] - 1 + depth, seeing itself and its fed ancestors; padding sees only its own slot."""
    n, M = len(levels), max(len(lv.tokens) for lv in levels)
    feed = torch.zeros(n, M, dtype=torch.long)
    positions = torch.zeros(n, M, dtype=torch.long)
    slots = torch.zeros(n, M, dtype=torch.long)
    mask = torch.eye(M, dtype=torch.bool).repeat(n, 1, 1)
    for b, lv in enumerate(levels):
        m = len(lv.tokens)
        feed[b, :m] = torch.tensor(lv.tokens)
        positions[b] = base[b]
        positions[b, :m] = base[b] - 1 + torch.tensor(lv.depths)
        slots[b] = base[b] + torch.arange(M)
        mask[b, :m, :m] = lv.mask
    return feed, positions, slots, mask


def grow(reqs, ks: list[int], n_nodes: int, root: torch.Tensor, level) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each row's dynamic tree: [(parents [m_b], tokens [m_b])], m_b <= n_nodes, depth <= ks[b].
    root [n, V]: draft logits at each row's last committed token; level(bs, levels) -> the logits
    [len(levels[i].expand), V] of each listed row's expanded candidates."""
    pools = [Pool() for _ in reqs]
    width = min(BEAM, n_nodes)
    for b, r in enumerate(reqs):
        for t, s in top_candidates(r, root[b], width, 0):
            pools[b].add(-1, t, s, 1)
    for d in range(2, max(ks) + 1):
        bs, levels = [], []
        for b, pool in enumerate(pools):
            if ks[b] < d:
                continue
            front = sorted((i for i in range(len(pool.token)) if pool.depth[i] == d - 1),
                           key=lambda i: (-pool.score[i], i))[:width]
            if not front:
                continue
            fed = sorted({a for i in front for a in pool.ancestors(i)})
            where = {i: j for j, i in enumerate(fed)}
            bs.append(b)
            levels.append(Level(fed, torch.tensor([where.get(pool.parent[i], -1) for i in fed], dtype=torch.long),
                                [pool.token[i] for i in fed], [pool.depth[i] for i in fed],
                                [where[i] for i in front]))
        if not bs:
            break
        for b, lv, lg in zip(bs, levels, level(bs, levels)):
            pool = pools[b]
            for j, logits in zip(lv.expand, lg):
                i = lv.pool_ids[j]
                for t, s in top_candidates(reqs[b], logits, width, d - 1):
                    pool.add(i, t, pool.score[i] + s, d)
    return [select(pool, n_nodes) for pool in pools]
