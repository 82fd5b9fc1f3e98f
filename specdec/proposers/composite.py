"""Composite proposer: ask each proposer in order, per row, and take the first that drafts.

Default order: n-gram lookup (free) first, then the draft model, or for a target without one its
draft head. A proposer that was not used for a row in a round is told only what was committed
(`skip`, with the round's result: a head keeps the target's hidden states from it); proposers that
keep their own cache (the draft model, the head) catch up on every committed token the next time
they are asked.

With `draft_tree="dynamic[:N]"` every part drafts ("both", `propose_dynamic`): a row's tree is
the union of the n-gram trie and the draft model's own dynamic tree.
"""

from __future__ import annotations

import torch

from specdec.proposers import dynamic_tree
from specdec.proposers.base import Candidate, Proposal, ProposerBase
from specdec.round import RowResult
from specdec.tree import tree_ok


class CompositeProposer(ProposerBase):
    name = "composite"

    def __init__(self, proposers: list):
        assert proposers
        self.proposers = proposers
        self._used: dict[int, object] = {}  # request id -> proposer that drafted its last round
        # the target's hidden states go to the parts that read them (a head), in every round
        self._hidden = [p for p in proposers if p.wants_hidden_states]
        self.wants_hidden_states = bool(self._hidden)
        self.hidden_taps = self._hidden[0].hidden_taps if self._hidden else ()
        assert len(self._hidden) <= 1, "one part reads the target's hidden states"

    def begin(self, req) -> None:
        for p in self.proposers:
            p.begin(req)

    def release(self, req) -> None:
        self._used.pop(req.id, None)
        for p in self.proposers:
            p.release(req)

    def evict(self, row: int) -> None:
        for p in self.proposers:
            p.evict(row)

    def parts(self) -> list:
        return [q for p in self.proposers for q in p.parts()]

    def reserve(self, n_rows: int) -> None:
        for p in self.proposers:
            p.reserve(n_rows)

    def observe_hidden(self, req, start: int, hidden) -> None:
        for p in self._hidden:
            p.observe_hidden(req, start, hidden)

    def share_prefix(self, req, donor, n: int) -> None:
        for p in self._hidden:
            p.share_prefix(req, donor, n)

    # prefill: none. At a fixed k the composite's draft model may never run (the n-gram drafts
    # whenever it matches); it catches up when first asked.

    def peek(self, req, k: int) -> list[Candidate]:
        """Every part that has tokens, in order (the first is what `propose` would use)."""
        return [c for p in self.proposers for c in p.peek(req, k)]

    def propose(self, reqs, ks: list[int], only: list[str | None] | None = None) -> Proposal:
        """only: per row, the name of the one part to ask (None: each in order, first that
        drafts wins)."""
        B = len(reqs)
        chosen: list[tuple] = [None] * B  # (tokens list, q rows or None)
        pending = [b for b in range(B) if ks[b] > 0]
        catch_up = 0
        for p in self.proposers:
            if not pending:
                break
            asked = [b for b in pending if only is None or only[b] in (None, p.name)]
            if not asked:
                continue
            prop = p.propose([reqs[b] for b in asked], [ks[b] for b in asked])
            catch_up = max(catch_up, prop.catch_up)
            still = [b for b in pending if b not in asked]
            for j, b in enumerate(asked):
                n = int(prop.num_draft[j])
                if n > 0:
                    chosen[b] = (prop.tokens[j, :n], None if prop.q is None else prop.q[j, :n])
                    self._used[reqs[b].id] = p
                else:
                    still.append(b)
            pending = still
        width = max([len(c[0]) for c in chosen if c is not None] + [0])
        tokens = torch.zeros(B, width, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        need_q = any(c is not None and c[1] is not None for c in chosen)
        q = None
        if need_q:
            V = next(c[1].shape[-1] for c in chosen if c is not None and c[1] is not None)
            q = torch.zeros(B, width, V)
        for b, c in enumerate(chosen):
            if c is None:
                self._used.pop(reqs[b].id, None)
                continue
            n = len(c[0])
            tokens[b, :n], num[b] = c[0], n
            if q is not None:  # token-only rows get their one-hot q written out
                q[b, :n] = c[1] if c[1] is not None else torch.nn.functional.one_hot(c[0], q.shape[-1]).float()
        source = [self._used[r.id].name if r.id in self._used else self.name for r in reqs]
        return Proposal(tokens=tokens, num_draft=num, q=q, source=source, catch_up=catch_up)

    def propose_dynamic(self, reqs, ks: list[int], n_nodes: int) -> Proposal:
        """Every part's tree at once: a row's tree is the union (dynamic_tree.union) of its parts'
        trees in order, the n-gram trie first with at most half the N nodes (a free guess; its
        first path is the chain the lookup drafts), then the draft model's tree, grown by its
        confidence as alone, filling the rest; a prefix both guessed is one node. Every node is
        a deterministic candidate (a function of the committed tokens), so the verifier takes
        the union with the deterministic-candidate rule. Rows the tree verifier does not serve
        draft a chain as `propose` does (the first part that drafts)."""
        grown = [b for b, k in enumerate(ks) if k and tree_ok(reqs[b].params)]
        sub, sub_ks = [reqs[b] for b in grown], [ks[b] for b in grown]
        budgets = [(n_nodes + 1) // 2] * (len(self.proposers) - 1) + [n_nodes]
        by_part = [p.grow_dynamic(sub, sub_ks, n) for p, n in zip(self.proposers, budgets)]
        trees = [dynamic_tree.union(list(ts), n_nodes) for ts in zip(*by_part)]
        model = next((p.model for p in self.proposers if getattr(p, "model", None) is not None), None)
        V = max((getattr(p, "V", 0) for p in self.proposers), default=0)
        prop = self.dynamic_round(reqs, ks, grown, trees, V, None if model is None else model.device)
        for r in sub:  # the last part (the draft model) keeps the KV it fed for the committed tokens
            self._used[r.id] = self.proposers[-1]
        return prop

    def accept(self, req, result: RowResult) -> None:
        p = self._used.get(req.id)
        for other in self.proposers:
            if other is p:
                other.accept(req, result)
            else:
                other.skip(req, result)
