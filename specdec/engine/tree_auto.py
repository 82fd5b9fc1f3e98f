"""`draft_tree="auto"`: each round's tree shape chosen from measured costs and acceptances.

A shape is children per depth (specdec.tree.tree_from_widths: every node at depth d has w_d
children). For the round's depth K (the widest k the k policy gave a row), each shape of a small
family is priced like adaptive k prices a chain (specdec.engine.adaptive):

    a_d(w)   = alpha_d + (1 - alpha_d) (1 - prod_{i=1..w-1} (1 - beta_i))
    E_r      = 1 + sum_{d=1..k_r} prod_{j<=d} a_j(w_j)               (row r drafts k_r levels)
    cost     = t_target(B (N + 1)) + sum_d t_draft(B n_d)            (N nodes, n_d at depth d)
    shape*   = argmax  sum_r E_r / cost                              (a chain is one of them)

alpha_d is the acceptance of the first child at depth d (a chain's draft), beta_i that of
sibling i given siblings 0..i-1 were rejected (never above beta_{i-1}), both decayed, Beta-smoothed counts learnt from
the rounds themselves (a tree round tells, along its accepted path, which child each depth took;
where it took none, that all were tried). The target's cost is one curve over the verify
forward's tokens, the draft's over the nodes of one draft level (all rows), both measured.

So on a machine where a verify forward costs nearly the same at 5 and at 16 tokens (AVX-512
here) trees are chosen where the siblings' acceptance pays for their nodes, and where it
grows with the tokens (AVX2 here) chains are. Siblings are only learnt by trying them: a shape
that has never been tried is priced with the prior BETA_PRIOR, and every EXPLORE_EVERY-th round
in a row that chose a chain tries the cheapest tree (2, 1, ...) once, so a pessimistic first
measurement does not rule trees out for good.

Lossless: the shape is chosen from past rounds only, never from this round's draws, so every
round is an ordinary tree (or chain) round, and those are exact (docs/lossless.md).
"""

from __future__ import annotations

import torch

from specdec.config import MAX_TREE_NODES
from specdec.engine.estimates import DECAY, PRIOR_STRENGTH, Acceptance, CostCurve
from specdec.tree import children, depths

PRIOR_ALPHA = 0.6  # a first child's acceptance before anything is seen (as adaptive k's)
BETA_PRIOR = 0.25  # a later sibling's, given the earlier ones were rejected
VERIFY_PRIOR_SLOPE = 0.05  # target cost per extra verified token, as a fraction, until measured
DRAFT_PRIOR_SLOPE = 0.3  # a draft level's cost per extra node, as a fraction, until measured
EXPLORE_EVERY = 32
SIBLINGS = 4  # the widest width a shape of the family has


def family(K: int) -> list[tuple[int, ...]]:
    """The shapes priced for depth K: the chain, then one or two wide levels at the top (where
    a miss costs the most) and the rest chains, each within MAX_TREE_NODES."""
    if K <= 0:
        return [()]
    rest = (1,) * (K - 1)
    shapes = [(1,) * K] + [(w,) + rest for w in range(2, SIBLINGS + 1)]
    if K >= 2:
        shapes += [(2, 2) + rest[1:], (3, 2) + rest[1:]]
    return [s for s in shapes if nodes(s) <= MAX_TREE_NODES]


def nodes(widths: tuple[int, ...]) -> int:
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
    return total


class TreeAuto:
    def __init__(self):
        self.target = CostCurve(VERIFY_PRIOR_SLOPE)  # seconds per verify forward, over its tokens
        self.draft = CostCurve(DRAFT_PRIOR_SLOPE)  # seconds per draft level, over its nodes (all rows)
        self.first = Acceptance()  # the first child's acceptance per depth
        self.tried = [0.0] * SIBLINGS  # [i]: rounds in which sibling i was tried (0..i-1 rejected)
        self.hit = [0.0] * SIBLINGS  # [i]: ... and accepted
        self._chains = 0  # rounds in a row that chose a chain
        self.chosen: dict[tuple[int, ...], int] = {}  # shape -> rounds (a metric)

    def betas(self) -> list[float]:
        """[i]: sibling i's acceptance given 0..i-1 rejected, never above sibling i - 1's (a
        later candidate is a less likely one: a sibling not tried yet is priced no better than
        the last one measured)."""
        out = [(self.hit[i] + PRIOR_STRENGTH * BETA_PRIOR) / (self.tried[i] + PRIOR_STRENGTH)
               for i in range(SIBLINGS)]
        for i in range(2, SIBLINGS):
            out[i] = min(out[i], out[i - 1])
        return out

    def expected(self, widths: tuple[int, ...], k: int, alphas: list[float], betas: list[float]) -> float:
        """Committed tokens of a row that drafts the shape's first k levels."""
        total, run = 1.0, 1.0
        for d in range(min(k, len(widths))):
            miss = 1.0
            for i in range(1, widths[d]):
                miss *= 1.0 - betas[i]
            run *= alphas[d] + (1.0 - alphas[d]) * (1.0 - miss)
            total += run
        return total

    def cost(self, widths: tuple[int, ...], rows: int) -> float | None:
        """Seconds of the round's draft levels and verify forward; None before a verify forward
        has been measured."""
        t = self.target.estimate(rows * (nodes(widths) + 1))
        if t is None:
            return None
        level, draft = 1, 0.0
        for w in widths:
            d = self.draft.estimate(rows * level)  # a level drafts the children of the level above
            draft += 0.0 if d is None else d
            level *= w
        return t + draft

    def choose(self, ks: list[int]) -> tuple[int, ...]:
        """The round's shape for rows that draft ks[r] levels each (a chain until costs are known)."""
        K = max(ks, default=0)
        shapes = family(K)
        if K == 0 or self.cost(shapes[0], len(ks)) is None:
            return shapes[0]
        alphas = self.first.alphas(K, [PRIOR_ALPHA] * K)
        betas = self.betas()
        best, best_rate = shapes[0], -1.0
        for s in shapes:
            rate = sum(self.expected(s, k, alphas, betas) for k in ks) / max(self.cost(s, len(ks)), 1e-12)
            if rate > best_rate * (1 + 1e-9):  # ties go to the smaller shape (listed first)
                best, best_rate = s, rate
        if len(shapes) > 1 and best == shapes[0]:
            self._chains += 1
            if self._chains >= EXPLORE_EVERY:
                best = shapes[1]
        if best != shapes[0]:
            self._chains = 0
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    # ---- observations (the engine's, every round) --------------------------------------------
    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target.observe(tokens, seconds)

    def observe_draft(self, widths: tuple[int, ...], rows: int, seconds: float) -> None:
        """A proposing call that drafted the shape's levels for `rows` rows: seconds per level
        at the level's mean node count."""
        if widths and rows:
            self.draft.observe(max(1, round(rows * nodes(widths) / len(widths))), seconds / len(widths))

    def observe_rows(self, rows: list[tuple]) -> None:
        """A round's rows, each (parents, num_draft, path, accepted): a chain (parents None:
        num_draft drafts, `accepted` of them) or a tree (its parents [num_draft] and the
        accepted path, node indices)."""
        for i in range(SIBLINGS):
            self.tried[i] *= DECAY
            self.hit[i] *= DECAY
        self.first.decay()
        for parents, num_draft, path, accepted in rows:
            if not num_draft:
                continue
            if parents is None:
                self.first.observe(num_draft, accepted)
            else:
                self._observe_tree(parents, path)

    def _observe_tree(self, parents: list[int], path: list[int]) -> None:
        pt = torch.tensor(parents, dtype=torch.long)
        kids = children(pt)
        node, lead, leading = -1, 0, True  # node -1: the root
        for j in path + [None]:
            sibs = kids[node + 1]
            if not sibs:
                break
            idx = sibs.index(j) if j is not None else len(sibs)  # len: every child rejected
            for i in range(1, min(idx, len(sibs) - 1) + 1):  # the siblings tried after the first
                if i < SIBLINGS:
                    self.tried[i] += 1
                    self.hit[i] += float(i == idx)
            leading = leading and idx == 0
            lead += leading
            if j is None:
                break
            node = j
        self.first.observe(int(depths(pt).max()), lead)

