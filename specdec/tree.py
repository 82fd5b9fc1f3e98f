"""Draft trees: their shape, drafting candidates from q, and lossless multi-candidate verification.

Vocabulary (rejection.py's, extended to trees):
  - a tree of N draft nodes hangs below the *root*, the last committed token. `parents` [N] gives
    each node's parent node index (-1: the root), in topological order (parents[j] < j), and
    siblings are tried in index order. Per-node tensors use *positions*: position 0 is the root,
    position j + 1 is node j, so the target's one forward over [root, node 0..N-1] (tree
    attention: `ancestor_mask`) gives p [B, N + 1, V], p[:, j + 1] conditioned on node j's path.
  - the children c_1..c_m of a position are its *candidates* for the next token; q[:, j] is the
    distribution node j was sampled from, *as recorded by the drafter* (for draws without
    replacement: q with the earlier siblings removed, renormalised), or q = None: deterministic
    candidates (top-m of q, n-gram lookups, greedy drafts), verified as one-hot q.
  - verification walks from the root. At a position with target p, r = p; for each candidate c_i
    in order: accept with probability min(1, r(c_i) / q_i(c_i)) (deterministic: r(c_i)) and move
    into c_i; else r = normalise([r - q_i]+) (deterministic: r with c_i zeroed, renormalised).
    Then *accepted* nodes form a path, and one more token is emitted: *recovered*, sampled from
    the final r when every candidate at the last position was rejected, or *bonus*, sampled from
    p at a leaf. Greedy (temperature 0): the child equal to the argmax of p, else the argmax.
    Why this is exact: docs/lossless.md, "Draft trees".

Static shapes come from widths per depth: `tree_from_widths((3, 2, 1))` is 3 children of the
root, 2 children of each of those, 1 child of each of those (N = 3 + 6 + 6), in breadth-first
order; `(1,) * k` is a chain of k. A node a drafter could not fill (q's support exhausted by the
earlier siblings) is marked invalid in `valid` [B, N] (and so are its descendants): verification
skips it.

The fast paths are batched over B rows sharing one `parents`; each has a slow reference beside it
that follows the math literally (`tree_verify_reference`, `tree_verify_greedy_reference`). The
fast path takes an rng with `bernoulli(probs) -> bool` and `categorical(probs [M, V]) -> [M]`
(rejection.TorchRng) and draws one coin per node (`bernoulli` on [B, N]) and one final sample per
row; the reference walks one row at a time and asks a *dice* object for exactly the decisions the
walk makes: `coin(node, prob) -> bool` for each candidate it tries, `sample(probs) -> int` for
the recovered or bonus token. `UniformDice` serves both from the same uniforms, so the two agree
draw for draw; an enumerator can answer the dice with every branch and its probability
(tests/test_tree.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.rejection import PLACEHOLDER, acceptance_probs, inverse_cdf, residual_distribution


def tree_ok(params) -> bool:
    """Rows the engine's tree verifier serves (specdec.engine.trees): nothing per position beyond
    the target's own logits (no penalties, grammar or log-probabilities); the rest take chains."""
    return not params.has_penalties and not params.constrained and params.logprobs is None


# --- tree shape --------------------------------------------------------------------------------

def check_parents(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] int64, each in [-1, j) for node j; raises ValueError otherwise."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    if parents.dim() != 1:
        raise ValueError(f"parents must be one index per node, got shape {tuple(parents.shape)}")
    for j, u in enumerate(parents.tolist()):
        if not -1 <= u < j:
            raise ValueError(f"parents[{j}] = {u}: must be -1 (the root) or an earlier node, 0..{j - 1}")
    return parents


def tree_from_widths(widths) -> torch.Tensor:
    """parents [N] of the full tree with widths[d] children under every position at depth d
    (the root is depth 0), breadth-first: (3, 2, 1) -> N = 3 + 6 + 6; (1,) * k -> a chain of k."""
    if any(int(w) < 1 for w in widths):
        raise ValueError(f"tree widths must be >= 1 per depth, got {tuple(widths)}")
    parents, level = [], [-1]
    for w in widths:
        nxt = []
        for u in level:
            for _ in range(int(w)):
                nxt.append(len(parents))
                parents.append(u)
        level = nxt
    return torch.tensor(parents, dtype=torch.long)


def chain(k: int) -> torch.Tensor:
    """parents [k] of a chain: node j's parent is j - 1 (the form rejection.py verifies)."""
    return torch.arange(k, dtype=torch.long) - 1


def children(parents: torch.Tensor) -> list[list[int]]:
    """[N + 1] lists: the child node indices of each position (0 = root, j + 1 = node j), in order."""
    kids = [[] for _ in range(len(parents) + 1)]
    for j, u in enumerate(parents.tolist()):
        kids[u + 1].append(j)
    return kids


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[N + 1] depth of each position: 0 for the root, 1 for its children, ... (the RoPE offset of
    a position from the root's position)."""
    d = [0]
    for u in parents.tolist():
        d.append(d[u + 1] + 1)
    return torch.tensor(d, dtype=torch.long)


def sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """[N] how many earlier siblings each node has: the order candidates are tried in."""
    seen = [0] * (len(parents) + 1)
    rank = []
    for u in parents.tolist():
        rank.append(seen[u + 1])
        seen[u + 1] += 1
    return torch.tensor(rank, dtype=torch.long)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[N + 1, N + 1] bool over positions: mask[a, b] iff b is a or an ancestor of a (the root is
    everyone's ancestor). Tree attention: position a attends to the committed tokens and to b."""
    N = len(parents)
    mask = torch.eye(N + 1, dtype=torch.bool)
    for j, u in enumerate(parents.tolist()):
        mask[j + 1] |= mask[u + 1]
    return mask


def pack_shapes(shapes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's trees as a proposer returns them: parents [B, N] (-1 past a row's own nodes)
    and nodes per row [B], from each row's parents [N_b] (empty: no drafts)."""
    N = max(len(s) for s in shapes)
    parents = torch.full((len(shapes), N), -1, dtype=torch.long)
    for b, s in enumerate(shapes):
        parents[b, : len(s)] = s
    return parents, torch.tensor([len(s) for s in shapes], dtype=torch.long)


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for node = -1, the root)."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


# --- drafting candidates from q ----------------------------------------------------------------

def next_without_replacement(rest: torch.Tensor, rng):
    """One draw without replacement. rest [M, V]: q with the tokens drawn so far zeroed (not
    renormalised). Returns (token [M], q_i [M, V] float64: the distribution it was drawn from,
    valid [M]: False where rest has no mass left (the token is then a dummy 0), rest' [M, V])."""
    rest = rest.double()
    mass = rest.sum(-1, keepdim=True)  # [M, 1]
    valid = mass.squeeze(-1) > 0
    dummy = torch.zeros_like(rest)
    dummy[:, 0] = 1.0
    q_i = torch.where(valid.unsqueeze(-1), rest / mass.clamp_min(torch.finfo(rest.dtype).tiny), dummy)
    token = rng.categorical(q_i)  # [M]
    return token, q_i, valid, rest.scatter(-1, token.unsqueeze(-1), 0.0)


def draft_children(q: torch.Tensor, m: int, rng=None):
    """m candidates under each of M positions from their draft distributions q [M, V].

    rng None: deterministic, the top-m of q (tokens q gives no mass included: any fixed
    candidate is verified exactly); returns (tokens [M, m], None, valid [M, m]: True but past
    the V-th). Otherwise m samples without replacement: c_1 ~ q, c_{i+1} ~ q with
    c_1..c_i removed, renormalised; returns (tokens [M, m], q_child [M, m, V]: the distribution
    each child was drawn from, which verification needs, valid [M, m]: False once q's support is
    used up)."""
    M, V = q.shape
    if rng is None:  # more candidates than tokens: the extra ones do not exist
        tokens = torch.zeros(M, m, dtype=torch.long, device=q.device)
        tokens[:, :min(m, V)] = torch.topk(q.double(), min(m, V), dim=-1).indices
        return tokens, None, (torch.arange(m, device=q.device) < V).expand(M, m)
    tokens, q_child, valid, rest = [], [], [], q
    for _ in range(m):
        c, q_i, ok, rest = next_without_replacement(rest, rng)
        tokens.append(c)
        q_child.append(q_i)
        valid.append(ok)
    return torch.stack(tokens, 1), torch.stack(q_child, 1), torch.stack(valid, 1)


def draft_tree(parents: torch.Tensor, q_fn, rng=None):
    """Draft a whole tree for B rows, position by position in depth order.

    q_fn(u: int, tokens [B, N] or None) -> q [B, V]: the draft distribution at position u, whose
    prefix is the committed tokens plus the tokens on u's path (drafted by then; None at the
    root, the first call). rng None: top-m candidates; otherwise sampled without replacement.
    Returns (tokens [B, N] int64, q [B, N, V] float64 or None, valid [B, N] bool)."""
    parents = check_parents(parents)
    N = len(parents)
    if N == 0:
        raise ValueError("draft_tree needs at least one node")
    kids, depth = children(parents), depths(parents).tolist()
    tokens = valid = q_out = None
    for u in sorted(range(N + 1), key=lambda u: depth[u]):
        if not kids[u]:
            continue
        q_u = q_fn(u, tokens)  # [B, V]
        if tokens is None:
            B, V = q_u.shape
            tokens = torch.zeros(B, N, dtype=torch.long, device=q_u.device)
            valid = torch.zeros(B, N, dtype=torch.bool, device=q_u.device)
            q_out = None if rng is None else torch.zeros(B, N, V, dtype=torch.float64, device=q_u.device)
        tok, q_child, ok = draft_children(q_u, len(kids[u]), rng)
        idx = torch.tensor(kids[u], device=q_u.device)
        tokens[:, idx] = tok
        valid[:, idx] = ok & (valid[:, u - 1 : u] if u > 0 else True)
        if q_out is not None:
            q_out[:, idx] = q_child
    return tokens, q_out, valid


# --- verification ------------------------------------------------------------------------------

@dataclass
class TreeResult:
    """One round of B rows verified against a tree."""

    path: torch.Tensor  # [B, D] accepted node indices, root's child first, padded with -1
    tokens: torch.Tensor  # [B, D + 1] accepted tokens, then the recovered/bonus one, PLACEHOLDER-padded
    num_emitted: torch.Tensor  # [B] accepted + 1


def _check(tokens: torch.Tensor, parents, valid: torch.Tensor | None):
    """(parents [N] int64, valid [B, N]: all True when None); asserts that a node is valid only
    under a valid parent."""
    parents = check_parents(parents)
    assert tokens.dim() == 2 and tokens.shape[1] == len(parents), (tokens.shape, parents.shape)
    if valid is None:
        return parents, torch.ones_like(tokens, dtype=torch.bool)
    has_parent = parents >= 0
    assert not (valid[:, has_parent] & ~valid[:, parents[has_parent]]).any(), "valid node under an invalid parent"
    return parents, valid


def _walk(ok: torch.Tensor, parents: torch.Tensor, D: int):
    """From the root, move into the first child (by index) whose ok [B, N] is True, D times at
    most. Returns (path [B, D] node indices padded with -1, last position [B])."""
    B, N = ok.shape
    src = torch.where(ok, torch.arange(N, device=ok.device), N)  # [B, N]
    first = torch.full((B, N + 1), N, dtype=torch.long, device=ok.device)
    first.scatter_reduce_(1, (parents + 1).to(ok.device).expand(B, N), src, "amin")  # [B, N + 1]
    rows = torch.arange(B, device=ok.device)
    cur = torch.zeros(B, dtype=torch.long, device=ok.device)
    path = torch.full((B, D), -1, dtype=torch.long, device=ok.device)
    for d in range(D):
        nxt = first[rows, cur]
        moved = nxt < N
        path[:, d] = torch.where(moved, nxt, -1)
        cur = torch.where(moved, nxt + 1, cur)
    return path, cur


def _result(tokens: torch.Tensor, path: torch.Tensor, last: torch.Tensor) -> TreeResult:
    n_acc = (path >= 0).sum(1)  # [B]
    out = torch.full((path.shape[0], path.shape[1] + 1), PLACEHOLDER, dtype=torch.long, device=path.device)
    out[:, :-1] = torch.where(path >= 0, tokens.gather(1, path.clamp_min(0)), PLACEHOLDER)
    out.scatter_(1, n_acc.unsqueeze(1), last.unsqueeze(1))
    return TreeResult(path, out, n_acc + 1)


def tree_verify_greedy(target_argmax: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       valid: torch.Tensor | None = None) -> TreeResult:
    """target_argmax [B, N + 1] (argmax of p at each position), tokens [B, N], parents [N]:
    move into the child equal to the argmax while there is one; emit the argmax where there is not."""
    parents, valid = _check(tokens, parents, valid)
    ok = valid & (tokens == target_argmax[:, parents + 1])  # [B, N]
    path, cur = _walk(ok, parents, int(depths(parents).max()))
    return _result(tokens, path, target_argmax.gather(1, cur.unsqueeze(1)).squeeze(1))


def tree_acceptance(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, parents: torch.Tensor,
                    valid: torch.Tensor):
    """Each node's acceptance probability, and each position's final residual.

    p [B, N + 1, V], q [B, N, V] or None, tokens [B, N], valid [B, N]. A candidate's acceptance
    depends only on its parent's p and its earlier siblings, so all are computed before any coin:
    sibling rank by rank, r [B, N + 1, V] (starting at p) is the residual at each position after
    the candidates tried so far. Returns (acc [B, N] float64, r [B, N + 1, V] float64: after all
    candidates, what a position's recovered token is drawn from; p itself at a leaf)."""
    B, N = tokens.shape
    r = p.double().clone()  # [B, N + 1, V]
    acc = torch.zeros(B, N, dtype=torch.float64, device=p.device)
    rank = sibling_rank(parents)
    for i in range(int(rank.max()) + 1 if N else 0):
        nodes = (rank == i).nonzero().squeeze(1)  # at most one per parent
        pos = parents[nodes] + 1
        d, ok = tokens[:, nodes], valid[:, nodes]  # [B, n]
        q_i = None if q is None else q[:, nodes].double()  # [B, n, V]
        acc[:, nodes] = torch.where(ok, acceptance_probs(r[:, pos], q_i, d), 0.0)
        r[:, pos] = torch.where(ok.unsqueeze(-1), residual_distribution(r[:, pos], q_i, d), r[:, pos])
    return acc, r


def tree_verify_stochastic(p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor,
                           parents: torch.Tensor, rng, valid: torch.Tensor | None = None) -> TreeResult:
    """p [B, N + 1, V] target at each position, q [B, N, V] per node (as drawn: without
    replacement, the renormalised q) or None (deterministic candidates), tokens [B, N],
    parents [N], valid [B, N] or None. One coin per node, one recovered/bonus sample per row."""
    parents, valid = _check(tokens, parents, valid)
    acc, r = tree_acceptance(p, q, tokens, parents, valid)
    coins = rng.bernoulli(acc)  # [B, N]
    path, cur = _walk(coins & valid, parents, int(depths(parents).max()))
    final = r[torch.arange(len(cur), device=cur.device), cur]  # [B, V]
    return _result(tokens, path, rng.categorical(final))


# --- slow references ---------------------------------------------------------------------------

def _residual_ref(r: list[float], q: list[float] | None, c: int) -> list[float]:
    """normalise([r - q]+), q one-hot on c when None; r itself when nothing is left."""
    left = [max(r[x] - (float(x == c) if q is None else q[x]), 0.0) for x in range(len(r))]
    mass = sum(left)
    return [v / mass for v in left] if mass > 0 else r


class TensorRow:
    """Row b of a tree in tensors, as `walk_reference` reads it."""

    def __init__(self, p, q, tokens, parents, valid, b: int):
        self.p_, self.q_, self.tok, self.b = p[b], None if q is None else q[b], tokens[b], b
        ok = valid[b].tolist()
        self.kids = [[j for j in js if ok[j]] for js in children(parents)]

    def children(self, u: int) -> list[int]:
        return self.kids[u]

    def token(self, j: int) -> int:
        return int(self.tok[j])

    def q(self, j: int) -> list[float] | None:
        return None if self.q_ is None else self.q_[j].double().tolist()

    def p(self, u: int) -> list[float]:
        return self.p_[u].double().tolist()


def walk_reference(row, dice) -> tuple[list[int], list[int]]:
    """The rule, literally, for one row: at each position r = p; try the candidates in order,
    accepting c with probability min(1, r(c) / q(c)) (q one-hot when None) and moving into it,
    else r = normalise([r - q]+); when none is accepted (or at a leaf), sample from r.
    row: children(u), token(j), q(j), p(u); dice: coin(j, prob), sample(probs).
    Returns (accepted node path, emitted tokens)."""
    path, u = [], 0
    while True:
        r = row.p(u)
        for j in row.children(u):
            c, q = row.token(j), row.q(j)
            q_c = 1.0 if q is None else q[c]
            if dice.coin(j, min(1.0, r[c] / q_c) if q_c > 0 else 0.0):
                path.append(j)
                u = j + 1
                break
            r = _residual_ref(r, q, c)
        else:
            return path, [row.token(j) for j in path] + [dice.sample(r)]


def _pack(paths: list[list[int]], emitted: list[list[int]], D: int) -> TreeResult:
    B = len(paths)
    path = torch.full((B, D), -1, dtype=torch.long)
    out = torch.full((B, D + 1), PLACEHOLDER, dtype=torch.long)
    for b in range(B):
        path[b, :len(paths[b])] = torch.tensor(paths[b], dtype=torch.long)
        out[b, :len(emitted[b])] = torch.tensor(emitted[b], dtype=torch.long)
    return TreeResult(path, out, torch.tensor([len(e) for e in emitted], dtype=torch.long))


def tree_verify_reference(p, q, tokens, parents, dice, valid=None) -> TreeResult:
    """Loop reference of `tree_verify_stochastic`: `walk_reference` on each row, with
    dice.row(b) (`UniformDice` gives the fast path's draws)."""
    parents, valid = _check(tokens, parents, valid)
    walks = [walk_reference(TensorRow(p, q, tokens, parents, valid, b), dice.row(b)) for b in range(len(tokens))]
    return _pack([w[0] for w in walks], [w[1] for w in walks], int(depths(parents).max()))


def tree_verify_greedy_reference(target_argmax, tokens, parents, valid=None) -> TreeResult:
    """Loop reference of `tree_verify_greedy`."""
    parents, valid = _check(tokens, parents, valid)
    kids = children(parents)
    paths, emitted = [], []
    for b in range(len(tokens)):
        path, u = [], 0
        while True:
            best = int(target_argmax[b, u])
            hit = [j for j in kids[u] if valid[b, j] and int(tokens[b, j]) == best]
            if not hit:
                break
            path.append(hit[0])
            u = hit[0] + 1
        paths.append(path)
        emitted.append([int(tokens[b, j]) for j in path] + [int(target_argmax[b, u])])
    return _pack(paths, emitted, int(depths(parents).max()))


class UniformDice:
    """Pre-drawn uniforms for both paths: coin_u [B, N] (node j of row b is accepted iff
    coin_u[b, j] < its acceptance probability) and sample_u [B] (the final token of row b is the
    inverse-CDF sample of its distribution at sample_u[b]). `bernoulli` / `categorical` serve
    the fast path, `row(b)` the reference."""

    def __init__(self, coin_u: torch.Tensor, sample_u: torch.Tensor):
        self.coin_u, self.sample_u = coin_u.double(), sample_u.double()  # [B, N], [B]

    @classmethod
    def draw(cls, B: int, N: int, seed: int) -> UniformDice:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.rand(B, N, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64))

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        return self.coin_u < probs

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        return inverse_cdf(probs, self.sample_u)

    def row(self, b: int) -> _RowDice:
        return _RowDice(self, b)


class _RowDice:
    def __init__(self, dice: UniformDice, b: int):
        self.dice, self.b = dice, b

    def coin(self, j: int, prob: float) -> bool:
        return bool(self.dice.coin_u[self.b, j] < prob)

    def sample(self, probs: list[float]) -> int:
        cdf = torch.tensor(probs, dtype=torch.float64).cumsum(0)
        x = float(self.dice.sample_u[self.b]) * float(cdf[-1])
        return min(int((cdf <= x).sum()), len(probs) - 1)
