"""Draft-head proposer: drafts from the target's own hidden states with a trained head
(specdec.head.model), which borrows the target's embedding and output rows.

Pairs and the cache (per request; pair j = (f_j, x_{j+1}), f_j the target's final hidden state at
position j (with, for a head with taps, the residual streams of those target layers), its slot in
the head's cache j):
  - the target's prompt prefill hands over f_0..f_{L-2} (`observe_hidden`); every round's result
    hands over the features of the inputs whose logits produced its committed tokens
    (RowResult.hidden): so the features of every committed pair arrive, true ones, never the
    head's own guesses;
  - `prefill` feeds all those pairs but the last; `propose` feeds the rest (one forward per row
    batch: the last pair's output is d_1), then its own pairs (g, d_i) for d_2..d_k;
  - after the round the head keeps only the true pairs (rollback is arithmetic: the drafted pairs'
    slots are overwritten by the next round's true ones).
q is the head's distribution after the request's transforms over the full vocabulary, zero outside
the draft vocabulary (or one-hot when it drafts greedily): lossless by construction.
"""

from __future__ import annotations

import time

import torch

from specdec.head.model import DraftHead, HeadCache
from specdec.proposers import dynamic_tree
from specdec.proposers.base import Proposal, ProposerBase
from specdec.proposers.draft_model import draw, fill_children
from specdec.round import Candidate, RowResult
from specdec.runtime.kernels import linear
from specdec.runtime.kv_cache import common_prefix
from specdec.tree import ancestor_mask, children, depths, tree_ok


def held_out_prior(held_out: dict) -> tuple[float, float] | None:
    """(first draft, later drafts) acceptance over a head's held-out sets (head.json: greedy,
    conditional per position), weighted by their rounds; None if it has none."""
    sets = [s for s in held_out.values() if s.get("rounds") and s.get("acceptance_at")]
    if not sets:
        return None
    first = sum(s["rounds"] * s["acceptance_at"][0] for s in sets) / sum(s["rounds"] for s in sets)
    later = [(s["rounds"], a) for s in sets for a in s["acceptance_at"][1:]]
    tail = sum(r * a for r, a in later) / sum(r for r, _ in later) if later else first
    return first, tail


class HeadProposer(ProposerBase):
    name = "head"
    wants_hidden_states = True

    def __init__(self, head: DraftHead, vocab_size: int, max_seq_len: int,
                 draft_sampling: str = "probabilistic", headroom: int = 33):
        self.head = head.prepare()  # (idempotent: a cached head is shared by engines)
        self.hidden_taps = tuple(head.cfg.taps)  # the target's features: these layers' streams, then f_j
        self.acceptance_prior = held_out_prior(head.cfg.held_out)
        self.F = head.cfg.feature_dim
        self.V = vocab_size  # the real (tokenizer) vocabulary
        # the draft ids inside it and the target's output rows for them [Vd', d], Q8_0 on the int8
        # kernels like the head's own weights (q is the head's distribution as computed here,
        # whatever it rounds to)
        self.ids, self.rows_out = head.draft_rows(vocab_size)
        self.capacity = max_seq_len + headroom
        self.draft_sampling = draft_sampling
        self.cache = HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, self.capacity)
        # Per row: the target's true features for positions start.. (kept while the row holds the
        # request, and after it for the next one's shared prefix), the tokens they belong to, and
        # how many pairs have KV in the head's cache (its length after a round).
        self.feats: dict[int, list[torch.Tensor]] = {}
        self._fed: dict[int, int] = {}
        self._kept: dict[int, list[int]] = {}  # a free row's tokens
        self.forward_time = 0.0
        self.forwards = 0

    def reserve(self, n_rows: int) -> None:
        if n_rows > self.cache.rows:
            self.cache = HeadCache(n_rows, self.head.cfg.n_kv_heads, self.head.cfg.head_dim, self.capacity)
            self.feats.clear()  # (the rows' KV is gone with the old cache)
            self._kept.clear()

    def begin(self, req) -> None:
        """The row keeps the target's features of the prefix it shares with its last request
        (f_j depends on tokens <= j), as the target keeps its KV: a prompt served from the
        target's prefix cache still has its features. The head's own pairs are fed again (one
        layer: cheap), so its drafts never depend on what the row held before."""
        row = req.row
        kept = self._kept.pop(row, None)
        n = common_prefix(kept, req.tokens, len(req.tokens)) if kept else 0
        start = self.cache.start[row]
        if n <= start or row not in self.feats:
            self.cache.start[row] = self.cache.length[row] = self._fed[row] = 0
            self.feats[row] = []
            return
        f = self._all(row)[: n - start]
        self.feats[row] = [f] if len(f) else []
        self._fed[row] = self.cache.length[row] = start

    def release(self, req) -> None:
        self._kept[req.row] = list(req.tokens)
        self.cache.length[req.row] = self._fed[req.row]

    def _all(self, row: int) -> torch.Tensor:
        """The row's true features [n, d], positions start..start+n-1."""
        f = self.feats[row]
        if len(f) > 1:
            self.feats[row] = f = [torch.cat(f)]
        return f[0] if f else torch.zeros(0, self.F)

    def _since(self, row: int, i: int) -> torch.Tensor:
        """The row's true features from index i (position start + i) on, without concatenating
        the history before it: a round reads only its last few pairs, and joining a long
        context's features every round cost O(context) each (a 2,000-token Qwen context: 12 MB)."""
        chunks = self.feats[row]
        if len(chunks) > 64:  # (joined now and then: the chunk list stays short)
            chunks = [self._all(row)]
        end, tail = sum(len(c) for c in chunks), []
        for c in reversed(chunks):
            if end <= i:
                break
            tail.append(c[max(0, i - (end - len(c))):])
            end -= len(c)
        if not tail:
            return torch.zeros(0, self.F)
        return tail[0] if len(tail) == 1 else torch.cat(tail[::-1])

    # ---- features in --------------------------------------------------------------------------
    def observe_hidden(self, req, start: int, hidden: torch.Tensor) -> None:
        """The target's features [n, F] (final hidden states, after the taps' streams) at
        committed positions start..start+n-1."""
        row = req.row
        have = self.cache.start[row] + sum(len(h) for h in self.feats[row])
        if start > have:  # features for have..start-1 never came (another row's KV was copied in)
            self.feats[row] = []
            self.cache.start[row] = self.cache.length[row] = self._fed[row] = start
            have = start
        if start + len(hidden) > have:
            self.feats[row].append(hidden[have - start:].float())

    def share_prefix(self, req, donor, n: int) -> None:
        """Take the donor's features for positions < n (its KV was copied into req's row)."""
        if self.cache.start[donor.row] != 0 or donor.row not in self.feats:
            return
        f = self._all(donor.row)[:n]
        if len(f) > sum(len(h) for h in self.feats[req.row]) + self.cache.start[req.row]:
            self.feats[req.row] = [f]
            self.cache.start[req.row] = self.cache.length[req.row] = self._fed[req.row] = 0

    def accept(self, req, result: RowResult) -> None:
        """Roll back to the true pairs and queue the round's features (pairs L-1..L-2+m)."""
        row = req.row
        self.cache.length[row] = self._fed[row]
        if result.hidden is not None:
            self.observe_hidden(req, len(req.tokens) - len(result.committed) - 1, result.hidden)

    def skip(self, req, result: RowResult) -> None:
        """Another part of a composite drafted: keep the true pairs, and the round's features."""
        self.accept(req, result)

    def _pairs(self, req, n_keep: int = 0) -> tuple[int, torch.Tensor, list[int]] | None:
        """(first index, features [n, d], next tokens) of the row's pairs without KV yet, all
        but the last n_keep; None if there are none."""
        row = req.row
        a, start = self._fed[row], self.cache.start[row]
        f = self._since(row, a - start)
        n = min(len(f), len(req.tokens) - 1 - a) - n_keep
        if n <= 0:
            return None
        return a, f[:n], req.tokens[a + 1: a + 1 + n]

    def _feed(self, reqs, chunks) -> torch.Tensor:
        """One head forward over each row's pairs (padded at the end); g [B, T, d]."""
        T = max(len(c[1]) for c in chunks)
        B = len(reqs)
        feats = torch.zeros(B, T, self.F)
        tokens = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        for b, (a, f, toks) in enumerate(chunks):
            feats[b, : len(f)] = f
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            pos[b] = torch.arange(a, a + T).clamp(max=self.capacity - 1)
        t0 = time.perf_counter()
        g = self.head.step(feats, tokens, pos, self.cache, [r.row for r in reqs])
        self.forward_time += time.perf_counter() - t0
        self.forwards += 1
        return g

    def _consume(self, req, n: int) -> None:
        """The next n pairs now have KV."""
        self._fed[req.row] += n
        self.cache.length[req.row] = self._fed[req.row]

    @torch.inference_mode()
    def prefill(self, reqs) -> None:
        """KV for every pending pair but the last (the prompt's)."""
        todo = [(r, c) for r in reqs if (c := self._pairs(r, n_keep=1)) is not None]
        if todo:
            self._feed([r for r, _ in todo], [c for _, c in todo])
            for r, (_, f, _) in todo:
                self._consume(r, len(f))

    # ---- drafting -------------------------------------------------------------------------------
    def _logits(self, g: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V]: the head's on its draft vocabulary, -inf elsewhere."""
        out = torch.full((g.shape[0], self.V), float("-inf"))
        out[:, self.ids] = linear(g, self.rows_out)
        return out

    def peek(self, req, k: int) -> list[Candidate]:
        """It can always draft k, after feeding the pairs it has no KV for (1-2 in steady state;
        one more per round it sat out): adaptive k prices that catch-up apart from drafting."""
        if k <= 0:
            return []
        return [Candidate(self.name, k, self.name, max(0, len(req.tokens) - 1 - self._fed.get(req.row, 0)))]

    @torch.inference_mode()
    def propose(self, reqs, ks: list[int], only=None) -> Proposal:
        B, k = len(reqs), max(ks)
        drafts = torch.zeros(B, k, dtype=torch.long)
        num_draft = torch.zeros(B, dtype=torch.long)
        needs_q = self.draft_sampling == "probabilistic" and any(
            not r.params.greedy and not r.params.stable for r in reqs)
        q_all = torch.zeros(B, k, self.V) if needs_q else None
        chunks = {b: c for b, r in enumerate(reqs) if ks[b] > 0 and (c := self._pairs(r)) is not None}
        live = list(chunks)
        if not live or k == 0:
            return Proposal(tokens=drafts, num_draft=num_draft, q=q_all)
        sub = [reqs[b] for b in live]
        chunks = [chunks[b] for b in live]
        last = torch.tensor([len(c[1]) - 1 for c in chunks])
        g = self._feed(sub, chunks)[torch.arange(len(sub)), last]  # [n, d] at each row's last pair
        for r, c in zip(sub, chunks):
            self._consume(r, len(c[1]))
        ix = torch.tensor(live)
        # greedy rows with nothing that changes the argmax (penalties, a grammar)
        plain = all(r.params.greedy and not r.params.has_penalties and not r.params.constrained for r in reqs)
        alive = {b: ks[b] for b in live}  # rows still drafting -> their k
        for i in range(k):
            rows_i = [b for b in live if b in alive and alive[b] > i]
            if not rows_i:
                break
            if plain:  # argmax on the draft vocabulary itself: no full-vocabulary logits
                d = torch.zeros(B, dtype=torch.long)
                d[ix] = self.ids[linear(g, self.rows_out).argmax(-1)]
                q, dead = None, torch.zeros(B, dtype=torch.bool)
            else:
                logits = torch.full((B, self.V), float("-inf"))
                logits[ix] = self._logits(g)
                d, q, dead = draw(logits, reqs, drafts[:, :i], set(rows_i), self.draft_sampling, needs_q)
            for b in rows_i:
                if dead[b]:
                    del alive[b]
                else:
                    drafts[b, i] = d[b]
                    num_draft[b] = i + 1
                    if q_all is not None:
                        q_all[b, i] = q[b]
            if i + 1 < k and any(b in alive and alive[b] > i + 1 for b in live):
                pos = torch.tensor([[self._fed[reqs[b].row] + i] for b in live]).clamp(max=self.capacity - 1)
                t0 = time.perf_counter()
                g = self.head.step(g.unsqueeze(1), drafts[ix, i: i + 1], pos, self.cache,
                                   [reqs[b].row for b in live])[:, 0]
                self.forward_time += time.perf_counter() - t0
                self.forwards += 1
        # the pairs fed before drafting: after rounds without a draft more than the steady 1-2, and
        # that catch-up is not the cost of drafting k (it was: after runs of plain rounds the next
        # draft looked ~2x dearer, and adaptive k kept the head off in ~80% of the rounds)
        return Proposal(tokens=drafts, num_draft=num_draft, q=q_all, catch_up=max(len(c[1]) for c in chunks))

    # ---- trees ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_tree(self, reqs, shapes: list[torch.Tensor]) -> Proposal:
        """A tree per row: shapes[b] its parents [N_b] (empty: no drafts). Rows the tree verifier
        does not serve (penalties, grammars, log-probabilities) were given a chain and draft it
        as `propose` does; a row with no pairs to draft from drafts nothing."""
        chunks = {b: c for b, s in enumerate(shapes)
                  if len(s) and tree_ok(reqs[b].params) and (c := self._pairs(reqs[b])) is not None}
        return self.tree_round(reqs, shapes, list(chunks),
                               lambda rs, ss, N: self._grow(rs, ss, list(chunks.values()), N), self.V)

    def _grow(self, reqs, shapes: list[torch.Tensor], chunks, N: int):
        """(tokens [n, N], valid [n, N], q [n, N, V] or None) of each row's tree, level by level.
        The row's pending true pairs give g at the root; a node j at depth t is the pair
        (g of its parent, its token) at position fed + t - 1 and slot fed + j, attending the true
        pairs and its ancestors. Each level feeds every node above it (the runtime's tree
        attention sees the slots before the first new one as history), its children drafted
        from the level's new nodes. Afterwards the head keeps only the true pairs."""
        n = len(reqs)
        needs_q = self.draft_sampling == "probabilistic" and any(
            not r.params.greedy and not r.params.stable for r in reqs)
        q = torch.zeros(n, N, self.V) if needs_q else None
        g_root, fed = self._tree_root(reqs, chunks)
        tokens = torch.zeros(n, N, dtype=torch.long)
        valid = torch.zeros(n, N, dtype=torch.bool)
        dep = [depths(s)[1:] for s in shapes]  # [N_b] depth of each node (1: the root's children)
        kids = [children(s) for s in shapes]  # [N_b + 1]: the root's children, then each node's
        g_node = torch.zeros(n, N, self.head.cfg.dim)  # each node's predicted feature
        self._children(reqs, g_root, [(b, kids[b][0], True) for b in range(n)], tokens, valid, 0, q)
        for d in range(2, max(int(x.max()) for x in dep) + 1):
            m = [int((x < d).sum()) for x in dep]  # nodes above depth d (a prefix: breadth-first)
            M = max(m)
            feats = torch.zeros(n, M, self.head.cfg.dim)
            feed = torch.zeros(n, M, dtype=torch.long)
            positions = torch.zeros(n, M, dtype=torch.long)
            slots = torch.zeros(n, M, dtype=torch.long)
            mask = torch.eye(M, dtype=torch.bool).repeat(n, 1, 1)
            for b in range(n):
                s = shapes[b][: m[b]]
                feats[b, : m[b]] = torch.stack([g_root[b] if int(p) < 0 else g_node[b, int(p)] for p in s])
                feed[b, : m[b]] = tokens[b, : m[b]]
                positions[b] = fed[b]  # (padding: its own slot only)
                positions[b, : m[b]] = fed[b] + dep[b][: m[b]] - 1
                slots[b] = fed[b] + torch.arange(M)
                mask[b, : m[b], : m[b]] = ancestor_mask(s)[1:, 1:]
            t0 = time.perf_counter()
            g = self.head.step(feats, feed, positions.clamp(max=self.capacity - 1), self.cache,
                               [r.row for r in reqs], mask=mask, slots=slots.clamp(max=self.capacity - 1))
            self.forward_time += time.perf_counter() - t0
            self.forwards += 1
            new = [[j for j in range(m[b]) if int(dep[b][j]) == d - 1] for b in range(n)]
            for b in range(n):
                g_node[b, new[b]] = g[b, new[b]]
            need = [(b, j) for b in range(n) for j in new[b] if kids[b][j + 1]]
            if need:
                self._children(reqs, torch.stack([g[b, j] for b, j in need]),
                               [(b, kids[b][j + 1], bool(valid[b, j])) for b, j in need], tokens, valid, d - 1, q)
        return tokens, valid, q

    def _tree_root(self, reqs, chunks) -> tuple[torch.Tensor, list[int]]:
        """(g [n, d] at each row's last true pair, the pairs with KV per row) after feeding the
        rows' pending true pairs."""
        last = torch.tensor([len(c[1]) - 1 for c in chunks])
        g_root = self._feed(reqs, chunks)[torch.arange(len(reqs)), last]  # [n, d]
        for r, c in zip(reqs, chunks):
            self._consume(r, len(c[1]))
        return g_root, [self._fed[r.row] for r in reqs]

    @torch.inference_mode()
    def propose_dynamic(self, reqs, ks: list[int], n_nodes: int) -> Proposal:
        """Each row's tree grown by the head's confidence (specdec.proposers.dynamic_tree); rows
        the tree verifier does not serve draft a chain as `propose` does; a row with no pairs to
        draft from drafts nothing."""
        chunks = {b: c for b, k in enumerate(ks)
                  if k and tree_ok(reqs[b].params) and (c := self._pairs(reqs[b])) is not None}
        grown = list(chunks)
        trees = []
        if grown:
            sub = [reqs[b] for b in grown]
            g_root, fed = self._tree_root(sub, list(chunks.values()))
            g_of = [{} for _ in sub]  # per row: candidate (pool index) -> its g, once it was fed
            trees = dynamic_tree.grow(
                sub, [ks[b] for b in grown], n_nodes, self._logits(g_root),
                lambda bs, levels: self._level([sub[b] for b in bs], [fed[b] for b in bs],
                                               [g_root[b] for b in bs], [g_of[b] for b in bs], levels))
        return self.dynamic_round(reqs, ks, grown, trees, self.V)

    def _level(self, reqs, fed: list[int], g_root, g_of: list[dict], levels) -> list[torch.Tensor]:
        """One head step over each row's fed candidates (dynamic_tree.Level): candidate j is the
        pair (g of its parent, its token) at position fed + depth - 1 and slot fed + j, attending
        the true pairs and its ancestors; full-vocabulary logits [len(expand), V] each."""
        feed, positions, slots, mask = dynamic_tree.level_layout(levels, fed)
        feats = torch.zeros(*feed.shape, self.head.cfg.dim)
        for b, lv in enumerate(levels):
            feats[b, : len(lv.tokens)] = torch.stack(
                [g_root[b] if int(p) < 0 else g_of[b][lv.pool_ids[int(p)]] for p in lv.parents])
        t0 = time.perf_counter()
        g = self.head.step(feats, feed, positions.clamp(max=self.capacity - 1), self.cache, [r.row for r in reqs],
                           mask=mask, slots=slots.clamp(max=self.capacity - 1))
        self.forward_time += time.perf_counter() - t0
        self.forwards += 1
        out = []
        for b, lv in enumerate(levels):
            for j, i in enumerate(lv.pool_ids):
                g_of[b][i] = g[b, j]
            out.append(self._logits(g[b, lv.expand]))
        return out

    def _children(self, reqs, g: torch.Tensor, todo, tokens, valid, offset: int, q) -> None:
        """Draft the children of nodes: g [m, d] their features, todo[i] = (row, child nodes,
        parent valid). Greedy rows take their top tokens on the draft vocabulary itself (no
        full-vocabulary logits); others go through the request's transforms (fill_children)."""
        if all(reqs[b].params.greedy for b, _, _ in todo):
            lg = linear(g, self.rows_out)  # [m, Vd']
            for i, (b, nodes, ok) in enumerate(todo):
                top = lg[i].topk(min(len(nodes), lg.shape[1])).indices
                for c, j in enumerate(nodes):
                    if c < len(top):
                        tokens[b, j], valid[b, j] = self.ids[top[c]], ok
            return
        logits = self._logits(g)
        for i, (b, nodes, ok) in enumerate(todo):
            fill_children(reqs[b], logits[i], nodes, tokens[b], valid[b], ok, offset,
                          None if q is None else q[b], self.draft_sampling)
