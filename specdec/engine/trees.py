"""The engine's side of draft trees (specdec.tree has the shapes and the verification math).

A tree round, per row (L committed tokens; the root is the last one, at slot and position L - 1):
  - shape: the configured widths cut to the row's k levels (`shape_for`); a row whose sampling
    needs per-position state (penalties, a grammar, log-probabilities) gets a chain of k, which is
    a tree too, and the chain verifier;
  - the proposer fills every node (Proposal.parents [B, N] per row, nodes past num_draft and
    nodes marked invalid are never accepted);
  - one target forward over [root, node 0..N-1] (`forward_inputs`): node j has KV slot L + j and
    RoPE position L - 1 + depth(j), and attends to the committed prefix and its own ancestors
    (runtime tree attention: slots + mask), so its logits are bit-identical to a plain forward
    over its path;
  - verification (`verify_rows`) walks from the root: greedy takes the child equal to the argmax;
    seed-stable sampling the child equal to the position's own token (argmax of the transformed
    logits plus the Gumbel noise of its output position, the noise of depth d for every node at
    depth d), so the text of a seed is the same with trees, chains or none; other sampling tries
    the children in order: drawn from q without replacement (accept c with probability
    min(1, r(c) / q_c(c)), else r = normalise([r - q_c]+)), or deterministic candidates (accept c
    with probability r(c), else zero it and renormalise) when the draft samples greedily; both
    exact (docs/lossless.md);
  - commit: the accepted path's KV moves to slots L, L + 1, ... (KVCache.compact): afterwards the
    row is a plain prefix and rollback stays arithmetic.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specdec import rejection, sampling
from specdec.config import dynamic_nodes
from specdec.logits_state import sampling_groups
from specdec.tree import (ancestor_mask, chain, depths, tree_from_widths, tree_ok, tree_verify_greedy,
                          tree_verify_stochastic)


def shape_for(widths: tuple[int, ...], k: int, params) -> torch.Tensor:
    """parents [N] of the row's round: the widths' first k levels, a chain of k where the tree
    verifier does not serve the row, nothing at k = 0."""
    return _shape(tuple(widths), k, tree_ok(params))


def depth_cap(draft_tree, k_max: int) -> int:
    """Adaptive k's k_max: a fixed shape drafts at most its own depth."""
    return min(k_max, len(draft_tree)) if isinstance(draft_tree, tuple) else k_max


def verify_width(draft_tree):
    """Tokens a row verifies in a round of depth k, as adaptive k prices it: a fixed shape's
    first k levels' nodes + 1, a dynamic tree's node budget + 1 (None: a chain's k + 1; "auto"
    picks each round's shape after k, from its own measured costs)."""
    if dynamic_nodes(draft_tree, 1) is not None:
        return lambda k: dynamic_nodes(draft_tree, k) + 1
    if draft_tree is None or draft_tree == "auto":
        return None
    return lambda k: len(_shape(tuple(draft_tree), k, True)) + 1


@lru_cache(maxsize=256)
def _shape(widths: tuple[int, ...], k: int, tree: bool) -> torch.Tensor:
    """(Built once per widths, k and kind: every row asks every round. Read-only.)"""
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    if not tree or max(widths[:k]) == 1:
        return chain(k)
    return tree_from_widths(widths[:k])


def depth(parents: torch.Tensor) -> int:
    """Levels of a tree (a chain of k: k)."""
    return int(depths(parents.cpu()).max())


def is_chain(parents: torch.Tensor) -> bool:
    return torch.equal(parents, chain(len(parents)))


def forward_inputs(reqs, prop, device):
    """(feed [B, N + 1], positions, slots, mask [B, N + 1, N + 1]) of the tree verify forward.
    Padding nodes (past a row's num_draft) hang from the root: they see only the prefix and
    their logits are never read."""
    B, N = prop.tokens.shape
    positions = torch.empty(B, N + 1, dtype=torch.long)
    slots = torch.empty(B, N + 1, dtype=torch.long)
    mask = torch.empty(B, N + 1, N + 1, dtype=torch.bool)
    for b, r in enumerate(reqs):
        L = len(r.tokens)
        parents = prop.parents[b].cpu()
        positions[b] = L - 1 + depths(parents)
        slots[b] = L - 1 + torch.arange(N + 1)
        mask[b] = ancestor_mask(parents)
    last = torch.tensor([[r.tokens[-1]] for r in reqs])
    feed = torch.cat([last, prop.tokens.cpu()], dim=1)
    return feed.to(device), positions.to(device), slots.to(device), mask.to(device)


def row_hidden(hidden: torch.Tensor, path: list[int] | None, n: int) -> torch.Tensor:
    """The hidden states [n, dim] at the inputs whose logits produced a row's n committed tokens:
    the first n positions of a chain; the root and then the accepted nodes (position 1 + node
    index) of a tree."""
    if path is None:
        return hidden[:n]
    return hidden[torch.tensor([0] + [j + 1 for j in path])[:n]]


def tree_rows(reqs, prop) -> list[int]:
    """The rows verified as trees: those that drafted something that is not a plain chain, and
    every row of deterministic candidates (a dynamic tree may be a chain; it has no q)."""
    nd = prop.num_draft.tolist()
    det = [False] * len(reqs) if prop.deterministic is None else prop.deterministic.tolist()
    return [b for b in range(len(reqs)) if nd[b] and tree_ok(reqs[b].params)
            and (det[b] or not is_chain(prop.parents[b, : nd[b]].cpu()))]


def verify_rows(reqs, rows: list[int], logits: torch.Tensor, prop, V: int, out: torch.Tensor,
                n_emit: torch.Tensor) -> dict[int, list[int]]:
    """Verify the tree rows, those that share sampling params, rng and tree shape in one batched
    call (specdec.tree's fast paths), writing emitted tokens into out [B, N + 1] and n_emit [B];
    returns {row: accepted node indices, root's child first}."""
    paths, wanted = {}, set(rows)
    for params, rng, idx in sampling_groups(reqs):
        shapes: dict[tuple, list[int]] = {}
        for b in idx:
            if b in wanted:
                n = int(prop.num_draft[b])
                det = prop.deterministic is not None and bool(prop.deterministic[b])
                shapes.setdefault((det, tuple(prop.parents[b, :n].tolist())), []).append(b)
        for (det, shape), bs in shapes.items():
            res = _verify_group(reqs, bs, torch.tensor(shape, dtype=torch.long), logits, prop, params, rng, V, det)
            for g, b in enumerate(bs):
                m = int(res.num_emitted[g])
                out[b, :m] = res.tokens[g, :m].to(out.device)  # (the rest stays PLACEHOLDER)
                n_emit[b] = m
                paths[b] = [j for j in res.path[g].tolist() if j >= 0]
    return paths


def _verify_group(reqs, bs: list[int], parents: torch.Tensor, logits, prop, params, rng, V: int,
                  deterministic: bool = False):
    n, G = len(parents), len(bs)
    ix = torch.tensor(bs)
    tokens = prop.tokens[ix, :n].cpu()
    valid = None if prop.valid is None else prop.valid[ix, :n].cpu()
    lg = logits[ix, : n + 1].float().cpu().flatten(0, 1)  # [G (n + 1), V]
    if params.greedy:
        return tree_verify_greedy(sampling.greedy_tokens(lg, params).view(G, n + 1), tokens, parents, valid)
    if params.stable:  # each position's token is fixed by its row's noise at the node's depth
        pos_depth = depths(parents)
        D1 = int(pos_depth.max()) + 1
        noise = rejection.stable_noise(reqs, bs, D1, lg.shape[-1], lg.device).view(G, D1, -1)[:, pos_depth]
        own = sampling.stable_tokens(lg, params, noise.flatten(0, 1)).view(G, n + 1)
        return tree_verify_greedy(own, tokens, parents, valid)
    p = sampling.probabilities(lg, params).view(G, n + 1, V)
    q = None if prop.q is None or deterministic else prop.q[ix, :n].cpu()  # None: deterministic candidates
    return tree_verify_stochastic(p, q, tokens, parents, rng, valid)
