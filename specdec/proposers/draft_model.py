"""Draft-model proposer: a smaller model with the target's tokenizer and its own KV cache.

Cache bookkeeping per request (L = committed length at the start of a round):
  - before `propose`, the draft has KV for the first `kv_len` committed tokens; it feeds
    committed[kv_len:L] (1 token, or 2 after a fully accepted round: the last draft and the
    bonus; the whole prompt on its first round unless `prefill` ran with the target's prompt
    prefill, as the engine does at a fixed k; after rounds it did not draft, every token
    committed since), then its own drafts d_1..d_{k-1};
  - it never feeds d_k: if d_k is accepted its KV is computed as catch-up next round;
  - `accept(n)` keeps KV for committed[:L] + d_1..d_min(n, k-1): rollback is arithmetic.
q is computed with the same transform chain as the target's p (specdec.sampling), on each
draft position's own prefix for penalties.

Trees (`propose_tree`, specdec.engine.trees): after the same catch-up, the children of each node
are drawn from q without replacement (sampled rows; each child's q recorded for the verifier) or
are the draft's top candidates (greedy, seed-stable, or draft_sampling "greedy": deterministic),
one draft forward per depth over all the row's nodes so far with tree attention (node j at slot
L + j, position L - 1 + depth). Afterwards the draft keeps KV for the committed tokens only: the
accepted path is fed as catch-up next round, with the root.
"""

from __future__ import annotations

import time

import torch

from specdec import rejection, sampling
from specdec.logits_state import sampling_groups, stacked_inputs
from specdec.proposers import dynamic_tree
from specdec.proposers.base import Candidate, Proposal, ProposerBase
from specdec.round import RowResult
from specdec.runtime import kv_cache
from specdec.runtime.kv_cache import common_prefix, ragged_block, rows_arg
from specdec.runtime.kv_cache import prefill as kv_prefill
from specdec.tree import ancestor_mask, children, depths, draft_children, tree_ok


class DraftModelProposer(ProposerBase):
    name = "draft"

    def __init__(self, model, vocab_size: int, max_seq_len: int,
                 draft_sampling: str = "probabilistic", headroom: int = 33):
        self.model = model
        self.V = vocab_size  # the real (tokenizer) vocabulary shared with the target
        self.max_seq_len, self.headroom = max_seq_len, headroom
        self.cache = model.new_cache(1, max_seq_len, headroom=headroom)
        self.draft_sampling = draft_sampling
        self.forward_time = 0.0
        self.forwards = 0
        self._last_k: dict[int, int] = {}
        self._L: dict[int, int] = {}
        self._kept: dict[int, list[int]] = {}  # a free row's committed tokens with KV (prefix reuse)

    def reserve(self, n_rows: int) -> None:
        if n_rows > self.cache.batch_size:
            self.cache = self.model.new_cache(n_rows, self.max_seq_len, headroom=self.headroom)
            self._kept.clear()

    def begin(self, req) -> None:
        """The row keeps the KV of the prefix it shares with its last request (the engine
        gives a prompt the free row with the longest shared prefix)."""
        kept = self._kept.pop(req.row, [])
        self.cache.set_length(req.row, common_prefix(kept, req.tokens, len(req.tokens) - 1))
        self._L.pop(req.row, None)  # rows are reused: forget the previous request's round
        self._last_k.pop(req.row, None)

    def release(self, req) -> None:
        self._kept[req.row] = req.tokens[: self.cache.lengths[req.row]]
        self.cache.set_length(req.row, 0)

    def evict(self, row: int) -> None:
        self._kept.pop(row, None)
        self.cache.release(row)

    def peek(self, req, k: int) -> list[Candidate]:
        """[Candidate(name, k, key, catch-up)]: it can always draft k, after feeding the committed tokens
        it has no KV for (the whole prompt on its first round unless prefilled, 1-2 tokens in
        steady state)."""
        if k <= 0:
            return []
        have = self.cache.lengths[req.row] if req.row < self.cache.batch_size else 0
        return [Candidate(self.name, k, self.name, len(req.tokens) - have)]

    @torch.inference_mode()
    def prefill(self, reqs) -> None:
        """KV for every committed token but the last (what the target's prefill gives the
        target), no logits: the first round then feeds one token, like any other."""
        kv_prefill(self.model, self.cache, reqs)

    def _feeds(self, reqs) -> tuple[list[list[int]], int]:
        """(per row, the committed tokens to feed before drafting; the most any row lagged). A
        backlog longer than a prefill piece (a prompt never prefilled: the composite's draft on
        its first turn; a long run the n-gram drafted) is first fed as prompt processing, in
        pieces and without logits (the same bits), leaving its last token for the forward that
        drafts."""
        feeds = [r.tokens[self.cache.lengths[r.row]:] for r in reqs]
        lag = max(len(f) for f in feeds)
        if lag > kv_cache.PREFILL_PIECE:  # (steady state: 1-2 tokens, nothing more to do per round)
            t0 = time.perf_counter()
            kv_prefill(self.model, self.cache, [r for r, f in zip(reqs, feeds) if len(f) > kv_cache.PREFILL_PIECE])
            self.forward_time += time.perf_counter() - t0
            feeds = [r.tokens[self.cache.lengths[r.row]:] for r in reqs]
        return feeds, lag

    def _forward(self, tokens, positions, rows, logits_at=None, mask=None, slots=None):
        t0 = time.perf_counter()
        tree = {} if slots is None else {"mask": mask, "slots": slots}  # (models without trees: chains only)
        logits = self.model.forward(tokens, positions, self.cache, rows=rows, logits_at=logits_at, **tree)
        self.forward_time += time.perf_counter() - t0
        self.forwards += 1
        return logits[..., : self.V]

    @torch.inference_mode()
    def propose(self, reqs, ks: list[int], only=None) -> Proposal:
        live = [b for b, n in enumerate(ks) if n > 0]
        if 0 < len(live) < len(reqs):  # rows asked for no drafts feed nothing, not even catch-up
            return self._propose_rows(reqs, ks, live)
        B, k = len(reqs), max(ks)
        dev = self.model.device
        rows = rows_arg(reqs, dev)
        drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        q_all = torch.zeros(B, k, self.V, device=dev) if self._needs_q(reqs) else None
        # Catch-up: feed committed tokens this draft has no KV for (ragged: pad at the end).
        feeds, T = self._feeds(reqs)
        tok, pos = ragged_block(feeds, [self.cache.lengths[r.row] for r in reqs], self.cache.capacity)
        last = torch.tensor([[len(f) - 1] for f in feeds], device=dev)
        cur = self._forward(tok.to(dev), pos.to(dev), rows, logits_at=last)[:, 0]  # [B, V]
        L = [len(r.tokens) for r in reqs]
        for b, r in enumerate(reqs):
            self.cache.set_length(r.row, L[b])
            self._L[r.row] = L[b]
            self._last_k[r.row] = ks[b]
        for i in range(k):
            d, q = self._sample(cur, reqs, drafts[:, :i], live={b for b in range(B) if ks[b] > i})
            drafts[:, i] = d
            if q_all is not None:
                q_all[:, i] = q
            if i + 1 < k:
                positions = torch.tensor([[L[b] + i] for b in range(B)], device=dev)
                cur = self._forward(d.view(B, 1), positions, rows)[:, 0]
        for b, r in enumerate(reqs):  # KV now covers committed + d_1..d_{k-1} (where fed)
            self.cache.set_length(r.row, L[b] + max(min(ks[b], k) - 1, 0) if k else L[b])
        num_draft = torch.tensor(ks, dtype=torch.long, device=dev)
        return Proposal(tokens=drafts, num_draft=num_draft, q=q_all, catch_up=T)

    @torch.inference_mode()
    def propose_tree(self, reqs, shapes: list[torch.Tensor]) -> Proposal:
        """A tree per row: shapes[b] its parents [N_b] (empty: no drafts). Rows the tree verifier
        does not serve (penalties, grammars, log-probabilities) were given a chain
        and draft it as `propose` does, with their q."""
        grown = [b for b, s in enumerate(shapes) if len(s) and tree_ok(reqs[b].params)]
        prop = self.tree_round(reqs, shapes, grown, self._grow, self.V, self.model.device)
        for b, s in enumerate(shapes):
            if not len(s):  # (accept then leaves its cache alone)
                self._L.pop(reqs[b].row, None)
                self._last_k.pop(reqs[b].row, None)
        return prop

    @torch.inference_mode()
    def propose_dynamic(self, reqs, ks: list[int], n_nodes: int) -> Proposal:
        """Each row's tree grown by the draft's confidence (specdec.proposers.dynamic_tree); rows
        the tree verifier does not serve draft a chain as `propose` does."""
        grown = [b for b, k in enumerate(ks) if k and tree_ok(reqs[b].params)]
        trees = self.grow_dynamic([reqs[b] for b in grown], [ks[b] for b in grown], n_nodes)
        prop = self.dynamic_round(reqs, ks, grown, trees, self.V, self.model.device)
        for b, k in enumerate(ks):
            if not k:  # (accept then leaves its cache alone)
                self._L.pop(reqs[b].row, None)
                self._last_k.pop(reqs[b].row, None)
        return prop

    @torch.inference_mode()
    def grow_dynamic(self, reqs, ks: list[int], n_nodes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's dynamic tree [(parents, tokens)] (every row drafts: k > 0, tree verifier
        rows); the draft's KV then covers the committed tokens (accept keeps them)."""
        if not reqs:
            return []
        root, L = self._tree_root(reqs)
        return dynamic_tree.grow(reqs, ks, n_nodes, root,
                                 lambda bs, levels: self._level([reqs[b] for b in bs], [L[b] for b in bs], levels))

    def _level(self, reqs, L: list[int], levels) -> list[torch.Tensor]:
        """One draft forward over each row's fed candidates (dynamic_tree.Level) with tree
        attention (node j at slot L + j, position L - 1 + depth); logits [len(expand), V] each."""
        dev = self.model.device
        feed, positions, slots, mask = dynamic_tree.level_layout(levels, L)
        width = max(len(lv.expand) for lv in levels)
        at = torch.tensor([lv.expand + [lv.expand[-1]] * (width - len(lv.expand)) for lv in levels])
        lg = self._forward(feed.to(dev), positions.to(dev), rows_arg(reqs, dev), logits_at=at.to(dev),
                           mask=mask.to(dev), slots=slots.to(dev))
        return [lg[b, : len(lv.expand)] for b, lv in enumerate(levels)]

    def _tree_root(self, reqs) -> tuple[torch.Tensor, list[int]]:
        """(the draft's logits [n, V] at each row's last committed token, committed lengths L)
        after feeding the committed tokens it has no KV for; its KV then covers them, and the
        tree's slots follow."""
        dev = self.model.device
        feeds, _ = self._feeds(reqs)
        tok, pos = ragged_block(feeds, [self.cache.lengths[r.row] for r in reqs], self.cache.capacity)
        last = torch.tensor([[len(f) - 1] for f in feeds], device=dev)
        root = self._forward(tok.to(dev), pos.to(dev), rows_arg(reqs, dev), logits_at=last)[:, 0]  # [n, V]
        L = [len(r.tokens) for r in reqs]
        for b, r in enumerate(reqs):
            self.cache.set_length(r.row, L[b])
            self._L[r.row], self._last_k[r.row] = L[b], 1  # accept keeps L: the path is caught up
        return root, L

    def _grow(self, reqs, shapes: list[torch.Tensor], N: int):
        """(tokens [n, N], valid [n, N], q [n, N, V] or None) of each row's tree, level by level."""
        n, dev = len(reqs), self.model.device
        q = torch.zeros(n, N, self.V) if self._needs_q(reqs) else None
        rows = rows_arg(reqs, dev)
        root, L = self._tree_root(reqs)
        tokens = torch.zeros(n, N, dtype=torch.long)
        valid = torch.zeros(n, N, dtype=torch.bool)
        dep = [depths(s)[1:] for s in shapes]  # [N_b] depth of each node (1: the root's children)
        kids = [children(s) for s in shapes]  # [N_b + 1]: the root's children, then each node's
        for b, r in enumerate(reqs):
            fill_children(r, root[b], kids[b][0], tokens[b], valid[b], True, 0, None if q is None else q[b],
                          self.draft_sampling)
        for d in range(2, max(int(x.max()) for x in dep) + 1):
            # every node above depth d, each row's in one forward (breadth-first: a prefix of nodes)
            m = [int((x < d).sum()) for x in dep]
            M = max(m)
            feed = torch.zeros(n, M, dtype=torch.long)
            positions = torch.zeros(n, M, dtype=torch.long)
            slots = torch.zeros(n, M, dtype=torch.long)
            mask = torch.eye(M, dtype=torch.bool).repeat(n, 1, 1)
            for b in range(n):
                feed[b, : m[b]] = tokens[b, : m[b]]
                positions[b] = L[b]
                positions[b, : m[b]] = L[b] - 1 + dep[b][: m[b]]
                slots[b] = L[b] + torch.arange(M)
                mask[b, : m[b], : m[b]] = ancestor_mask(shapes[b][: m[b]])[1:, 1:]
            # logits only where children are drafted (the output head is the draft's widest matmul)
            need = [[j for j in range(m[b]) if int(dep[b][j]) == d - 1 and kids[b][j + 1]] or [0]
                    for b in range(n)]
            width = max(len(x) for x in need)
            at = torch.tensor([x + [x[-1]] * (width - len(x)) for x in need])
            lg = self._forward(feed.to(dev), positions.to(dev), rows, logits_at=at.to(dev), mask=mask.to(dev),
                               slots=slots.to(dev))
            for b, r in enumerate(reqs):
                for i, j in enumerate(need[b]):
                    if kids[b][j + 1]:
                        fill_children(r, lg[b, i], kids[b][j + 1], tokens[b], valid[b], bool(valid[b, j]), d - 1,
                                      None if q is None else q[b], self.draft_sampling)
        return tokens.to(dev), valid, None if q is None else q.to(dev)

    def _propose_rows(self, reqs, ks: list[int], live: list[int]) -> Proposal:
        """Draft for the `live` rows only; the others get 0 drafts and keep their KV as it is
        (a row that does not draft this round is not caught up: under load, most rows)."""
        for b, r in enumerate(reqs):
            if ks[b] == 0:
                self._L.pop(r.row, None)  # (accept then leaves its cache alone)
                self._last_k.pop(r.row, None)
        sub = self.propose([reqs[b] for b in live], [ks[b] for b in live])
        B, k = len(reqs), sub.tokens.shape[1]
        ix = torch.tensor(live, device=sub.tokens.device)
        tokens = torch.zeros(B, k, dtype=torch.long, device=sub.tokens.device)
        num_draft = torch.zeros(B, dtype=torch.long, device=sub.tokens.device)
        tokens[ix], num_draft[ix] = sub.tokens, sub.num_draft
        q = None
        if sub.q is not None:
            q = torch.zeros(B, k, self.V, device=sub.q.device)
            q[ix] = sub.q
        return Proposal(tokens=tokens, num_draft=num_draft, q=q, catch_up=sub.catch_up)

    def _needs_q(self, reqs) -> bool:
        return self.draft_sampling == "probabilistic" and any(
            not r.params.greedy and not r.params.stable for r in reqs)

    def _sample(self, logits, reqs, drafted, live: set[int]):
        d, q, _ = draw(logits, reqs, drafted, live, self.draft_sampling, self._needs_q(reqs))
        return d, q

    def skip(self, req, result: RowResult) -> None:
        """A round in which another proposer drafted for this row: our drafts (if any were fed
        during a propose whose results were not used) are not history; keep committed KV only."""
        kept = self._L.get(req.row, self.cache.lengths[req.row])  # no round yet: prompt KV only
        self.cache.set_length(req.row, min(self.cache.lengths[req.row], kept))

    def accept(self, req, result: RowResult) -> None:
        """Keep KV for committed[:L] + the accepted drafts that were fed (at most k - 1)."""
        if req.row not in self._L:
            return
        L, k = self._L[req.row], self._last_k[req.row]
        keep = L + min(result.accepted, max(k - 1, 0))
        self.cache.set_length(req.row, min(keep, len(req.tokens)))


def draw(logits: torch.Tensor, reqs, drafted: torch.Tensor, live: set[int], draft_sampling: str,
         needs_q: bool):
    """Draft tokens d [B], their distributions q [B, V] (None, or zeros where q is one-hot) and
    `dead` [B] bool (rows whose transformed logits allow no token: nothing to draft) at the
    position after `drafted` [B, i], from draft logits [B, V]. The logits state sees each row's
    own drafts so far, as the target's p will at the same position. Only `live` rows (still
    drafting) roll dice: a row's draws never depend on how far the others draft."""
    B = logits.shape[0]
    d = torch.zeros(B, dtype=torch.long, device=logits.device)
    q = torch.zeros(B, logits.shape[-1], device=logits.device) if needs_q else None
    dead = torch.zeros(B, dtype=torch.bool, device=logits.device)
    for params, rng, idx in sampling_groups(reqs):
        idx = [b for b in idx if b in live]
        if not idx:
            continue
        ix = torch.tensor(idx, device=logits.device)
        inp = stacked_inputs(reqs, idx, drafted, last_only=True)
        lg = logits[ix]
        if params.greedy:
            d[ix] = sampling.greedy_tokens(lg, params, inp.counts, inp.seen, inp.mask)
        elif draft_sampling == "greedy":
            d[ix] = sampling.filter_logits(
                sampling.apply_penalties(lg.float(), params, inp.counts, inp.seen, inp.mask), params).argmax(-1)
        elif params.stable:  # the target's noise at this position: q coupled to p, no q needed
            noise = rejection.stable_noise(reqs, idx, 1, lg.shape[-1], lg.device, start=drafted.shape[1])
            d[ix] = sampling.stable_tokens(lg, params, noise, inp.counts, inp.seen, inp.mask)
        else:
            probs = sampling.probabilities(lg, params, inp.counts, inp.seen, inp.mask)
            bad = probs[:, 0].isnan()  # every token masked (a reduced draft vocabulary): a NaN softmax row
            if bad.any():
                dead[ix[bad]] = True
                probs[bad] = 0.0
                probs[bad, 0] = 1.0  # a placeholder draw; the row's drafts end before it
            d[ix] = rng.categorical(probs)
            q[ix] = probs
    return d, q, dead


def fill_children(req, logits: torch.Tensor, nodes: list[int], tokens, valid, parent_valid: bool,
                  offset: int, q: torch.Tensor | None, draft_sampling: str) -> None:
    """Draft the children `nodes` of one tree node from its logits [V] (a draft model's or a
    head's). Sampling with draft_sampling "probabilistic": draws without replacement from q (the
    draft's distribution after the request's transforms), each child's q (earlier siblings
    removed, renormalised) recorded in q [N, V] for the verifier. Otherwise deterministic: the top
    len(nodes) tokens under the transforms (the argmax first for greedy; for seed-stable rows with
    the Gumbel noise of the children's output position, `offset` past the committed ones, so the
    first is the coupled draft). A node with no candidate left (q's support used up, -inf logits
    outside a head's draft vocabulary, or under an invalid parent) is invalid."""
    if not nodes:
        return
    p = req.params
    lg = logits.float().unsqueeze(0)
    if not p.greedy and (p.stable or draft_sampling != "greedy"):
        lg = sampling.filter_logits(lg, p)
    if q is not None and not p.greedy and not p.stable:
        tok, q_child, ok = draft_children(lg.softmax(-1), len(nodes), req.rng)
        for i, j in enumerate(nodes):
            tokens[j], valid[j], q[j] = tok[0, i], parent_valid and bool(ok[0, i]), q_child[0, i]
        return
    if not p.greedy and p.stable:
        lg = lg + rejection.stable_noise([req], [0], 1, lg.shape[-1], lg.device, start=offset)
    top = lg[0].topk(len(nodes))
    for j, t, v in zip(nodes, top.indices.tolist(), top.values.tolist()):
        tokens[j] = t
        valid[j] = parent_valid and v != float("-inf")
