"""The proposer protocol: where draft tokens come from.

A proposer owns its own state (a draft model's KV cache, an n-gram index) and never reads or moves
the target's cache. The engine calls, per request: `begin` once, then per round `peek` (only when
the k policy prices candidates), `propose` for the rows that draft, `accept` after verification
(or `skip` on a round in which another part of a composite drafted), and `release` when the request
ends or is aborted. `reserve` and `prefill` let a proposer size and fill its state alongside the
target's. Every call is part of the protocol: `ProposerBase` gives the ones most proposers do not
need a no-op body, so the engine never asks what a proposer can do.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.errors import SpecdecError
from specdec.request import Request
from specdec.round import Candidate, Proposal, RowResult
from specdec.tree import chain, pack_shapes, tree_ok

__all__ = ["Candidate", "Proposal", "Proposer", "ProposerBase"]


class Proposer(Protocol):
    name: str
    runs_a_model: bool  # False: drafting is nearly free (adaptive k's cost prior)
    wants_hidden_states: bool  # True: `accept` gets the target's hidden states (RowResult.hidden)
    hidden_taps: tuple[int, ...]  # with them, the residual streams after these target layers
    # (first draft, later drafts) acceptance the proposer measured itself (a head's held-out
    # acceptance): adaptive k's starting point for it; None: the policy's own prior
    acceptance_prior: tuple[float, float] | None

    def parts(self) -> list["Proposer"]:
        """The proposers it is made of (itself, unless it is a composite)."""
        ...

    def reserve(self, n_rows: int) -> None:
        """Make room for n_rows concurrent requests (called while the engine is idle)."""
        ...

    def begin(self, req: Request) -> None: ...

    def prefill(self, reqs: list[Request]) -> None:
        """Called with the target's prompt prefill when k is fixed, for rows with room to draft:
        state for every committed token but the last. Its time is prompt processing."""
        ...

    def observe_hidden(self, req: Request, start: int, hidden) -> None:
        """Only when wants_hidden_states: the target's final hidden states [n, dim] at the
        committed positions start..start+n-1, from its prompt prefill (a round's come with
        `accept`, in RowResult.hidden)."""
        ...

    def share_prefix(self, req: Request, donor: Request, n: int) -> None:
        """Only when wants_hidden_states: req's target KV for its first n tokens was copied from
        donor's row (a shared prompt), so no hidden states come for them."""
        ...

    def peek(self, req: Request, k: int) -> list[Candidate]:
        """The parts that could draft for this request now and how many tokens (<= k) each has,
        from committed tokens only, in the proposer's order of preference; [] if none."""
        ...

    def propose(self, reqs: list[Request], ks: list[int], only: list[str | None] | None = None) -> Proposal:
        """Up to ks[b] drafts for each row. only[b]: the one part to ask for row b (a k policy's
        pick among `peek`'s candidates); None: the proposer's own order."""
        ...

    def propose_tree(self, reqs: list[Request], shapes: list) -> Proposal:
        """Only with a draft tree (SpeculativeConfig.draft_tree): shapes[b] is row b's parents [N_b]
        (empty: no drafts); returns a Proposal with `parents` (and `valid`) set."""
        ...

    def propose_dynamic(self, reqs: list[Request], ks: list[int], n_nodes: int) -> Proposal:
        """Only with draft_tree "dynamic": each row's tree of up to n_nodes nodes and depth ks[b],
        grown by the draft's confidence (specdec.proposers.dynamic_tree)."""
        ...

    def accept(self, req: Request, result: RowResult) -> None:
        """The row's round is committed (req.tokens already holds it): keep state for the
        committed tokens, drop the rest."""
        ...

    def skip(self, req: Request, result: RowResult) -> None:
        """Another part drafted this row's round: keep only committed state (result: the round
        as committed, with the target's hidden states when wants_hidden_states)."""
        ...

    def release(self, req: Request) -> None: ...

    def evict(self, row: int) -> None:
        """Forget what row kept for prefix reuse and give its memory back (the KV pool)."""
        ...


class ProposerBase:
    """Defaults for the calls a simple proposer does not need."""

    name = "proposer"
    runs_a_model = True
    wants_hidden_states = False
    hidden_taps: tuple[int, ...] = ()  # target layers whose residual streams come with them
    acceptance_prior: tuple[float, float] | None = None

    def parts(self) -> list[Proposer]:
        return [self]

    def reserve(self, n_rows: int) -> None:
        pass

    def begin(self, req: Request) -> None:
        pass

    def prefill(self, reqs: list[Request]) -> None:
        pass

    def observe_hidden(self, req: Request, start: int, hidden) -> None:
        pass

    def share_prefix(self, req: Request, donor: Request, n: int) -> None:
        pass

    def peek(self, req: Request, k: int) -> list[Candidate]:
        return [Candidate(self.name, k)] if k > 0 else []

    def propose_tree(self, reqs: list[Request], shapes: list) -> Proposal:
        raise SpecdecError(f"proposer {self.name!r} does not draft trees; draft_tree needs a draft model or a head",
                           "draft_tree")

    def propose_dynamic(self, reqs: list[Request], ks: list[int], n_nodes: int) -> Proposal:
        raise SpecdecError(f"proposer {self.name!r} does not draft trees; draft_tree needs a draft model or a head",
                           "draft_tree")

    def accept(self, req: Request, result: RowResult) -> None:
        pass

    def skip(self, req: Request, result: RowResult) -> None:
        pass

    def release(self, req: Request) -> None:
        pass

    def evict(self, row: int) -> None:
        pass

    def tree_round(self, reqs, shapes: list, grown: list[int], grow, V: int, device=None) -> Proposal:
        """A draft-tree round's Proposal. Rows the tree verifier does not serve (penalties,
        grammars, log-probabilities) were given a chain and draft it with `propose` (their q
        too); rows in `grown` draft their trees with grow(reqs, shapes, N) -> (tokens [n, N],
        valid [n, N], q [n, N, V] or None); any other row drafts nothing."""
        parents, num = pack_shapes(shapes)
        B, N = parents.shape
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        valid = torch.zeros(B, N, dtype=torch.bool)
        chains = [b for b, s in enumerate(shapes) if len(s) and not tree_ok(reqs[b].params)]
        q = None
        if chains:
            sub = self.propose([reqs[b] for b in chains], [len(shapes[b]) for b in chains])
            w = sub.tokens.shape[1]
            ix = torch.tensor(chains)
            tokens[ix, :w] = sub.tokens
            num[ix] = sub.num_draft.cpu()
            valid[ix, :w] = torch.arange(w).view(1, w) < num[ix].view(-1, 1)
            if sub.q is not None:
                q = torch.zeros(B, N, V, device=device)
                q[ix, :w] = sub.q
        for b in set(range(B)) - set(chains) - set(grown):
            num[b] = 0
        if grown:
            tok, ok, q_tree = grow([reqs[b] for b in grown], [shapes[b] for b in grown], N)
            ix = torch.tensor(grown)
            tokens[ix], valid[ix] = tok, ok
            if q_tree is not None:
                q = torch.zeros(B, N, V, device=device) if q is None else q
                q[ix] = q_tree
        return Proposal(tokens=tokens, num_draft=num, q=q, parents=parents.to(tokens.device),
                        valid=valid.to(tokens.device))

    def dynamic_round(self, reqs, ks: list[int], grown: list[int], grown_trees, V: int, device=None) -> Proposal:
        """A dynamic-tree round's Proposal: rows in `grown` drafted grown_trees[i] = (parents,
        tokens) (specdec.proposers.dynamic_tree: deterministic candidates, marked so); rows the
        tree verifier does not serve draft a chain of k with `propose`; others nothing."""
        trees = dict(zip(grown, grown_trees))
        shapes = [trees[b][0] if b in trees else chain(k) if k and not tree_ok(reqs[b].params)
                  else torch.zeros(0, dtype=torch.long) for b, k in enumerate(ks)]
        drafted = [b for b in grown if len(trees[b][0])]

        def filled(rs, ss, N):
            tokens = torch.zeros(len(drafted), N, dtype=torch.long, device=device)
            valid = torch.zeros(len(drafted), N, dtype=torch.bool)
            for i, b in enumerate(drafted):
                m = len(trees[b][1])
                tokens[i, :m], valid[i, :m] = trees[b][1].to(tokens.device), True
            return tokens, valid, None

        prop = self.tree_round(reqs, shapes, drafted, filled, V, device)
        det = torch.zeros(len(reqs), dtype=torch.bool)
        det[drafted] = True
        prop.deterministic = det
        return prop
