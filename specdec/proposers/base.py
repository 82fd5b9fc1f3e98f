"""The proposer protocol and its result dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specdec.engine import Request


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] int64 draft tokens, padded past num_draft[b] with 0
    num_draft: torch.Tensor  # [B] int64, number of real drafts per row (<= k)
    q: torch.Tensor | None  # [B, k, V] draft distributions, or None: one-hot on the tokens
    source: list[str] | None = None  # [B] name of the proposer that drafted each row (metrics);
    # None: the proposer's own name for every row
    catch_up: int = 0  # most committed tokens any row fed before drafting (a draft model's
    # prompt, if not prefilled, or its catch-up after n-gram rounds): adaptive k measures such a round
    # as catch-up cost per token, not as the cost of drafting k


class Proposer(Protocol):
    """A source of draft tokens.

    The engine calls `begin` once per request, `propose` once per round with the requests of
    the batch and how many tokens each may draft, `accept` after verification with how many of
    the row's drafts were accepted (the request's committed tokens are already updated), and
    `release` when the request ends. A proposer never reads or moves the target's cache.
    """

    name: str

    def begin(self, req: "Request") -> None: ...

    def propose(self, reqs: list["Request"], ks: list[int]) -> Proposal: ...

    def accept(self, req: "Request", n_accepted: int) -> None: ...

    def release(self, req: "Request") -> None: ...

    # Optional: `peek(req, k) -> [(name, n[, key[, catch_up]]), ...]`: the proposers that could
    # draft for this request now and how many tokens (<= k, > 0) each has, without drafting,
    # from committed tokens only, in the proposer's own order of preference; `key` (default:
    # name) names the acceptance record the round belongs to, `catch_up` (default 0) the
    # committed tokens it must feed before drafting. Adaptive k prices each and picks one
    # (a composite then drafts from the one picked: `propose(..., only=names)`).
    #
    # Optional: `prefill(reqs)`: called with the target's prompt prefill at a fixed k > 0, for
    # requests with room to draft (a draft model's KV for every committed token but the last);
    # its time is prompt processing, not decoding.  Adaptive k does not call it (it prices the
    # catch-up and may never start the draft model); a composite has none.


def peek(proposer, req: "Request", k: int) -> list[tuple]:
    """[(proposer name, tokens it could draft, <= k[, key[, catch_up]])]; one without `peek`
    can always draft k."""
    if hasattr(proposer, "peek"):
        return proposer.peek(req, k)
    return [(proposer.name, k)] if k > 0 else []
