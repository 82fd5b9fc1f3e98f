"""The round as a typed contract: what crosses the seams between the engine, its proposers and its
k policy. Plain data, no behaviour; it imports nothing of the engine's.

One vocabulary for one round of one row: the proposer drafts k tokens d_1..d_k with draft
distributions q_1..q_k (or none: q is then one-hot on each draft); the target's single forward over
[last committed token, d_1..d_k] gives p_1..p_{k+1}; verification accepts a prefix of the drafts and
emits one more token, *recovered* (sampled from the residual after the first rejection) or *bonus*
(sampled from p_{k+1} when every draft was accepted). A stop inside the round cuts what is committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidate:
    """A proposer (or one part of a composite) that could draft for a request now: what `peek`
    reports from committed tokens only, without drafting."""

    source: str  # the proposer's name: whose draft cost prices the round
    available: int  # tokens it can draft this round, 1..k
    key: str | None = None  # the acceptance record the round belongs to (None: `source`'s own)
    catch_up: int = 0  # committed tokens it must feed before drafting (a draft model's lag)

    @property
    def record(self) -> str:
        return self.key or self.source


@dataclass(frozen=True)
class Choice:
    """The k policy's decision for one row and round: k = 0 is a plain round."""

    k: int
    source: str | None = None  # the part that drafts (None: the proposer's own order)
    key: str | None = None  # acceptance record of that part (None: source's)


@dataclass
class Proposal:
    """What a proposer returns for a batch of rows: a chain of drafts per row."""

    tokens: torch.Tensor  # [B, k] int64, padded past num_draft[b] with 0
    num_draft: torch.Tensor  # [B] int64, real drafts per row (<= k)
    q: torch.Tensor | None  # [B, k, V] draft distributions, or None: one-hot on the tokens
    source: list[str] | None = None  # [B] the part that drafted each row (None: the proposer)
    catch_up: int = 0  # most committed tokens any row fed before drafting: adaptive k prices
    # such a round as catch-up per token, not as the cost of drafting k
    parents: torch.Tensor | None = None  # [B, k] per row, each node's parent index (-1: the root,
    # the last committed token; topological order, siblings tried in index order): a draft tree
    # (specdec.engine.trees). None: a chain, node i's parent is i - 1
    valid: torch.Tensor | None = None  # [B, k] bool, trees only: False for a node the proposer
    # could not fill (its q had fewer candidates than the width); never accepted
    deterministic: torch.Tensor | None = None  # [B] bool, trees only: rows whose nodes are
    # deterministic candidates (a dynamic tree: the draft's top tokens), verified without q even
    # where q is given for other rows


@dataclass
class RowResult:
    """One row's round, after commit."""

    request: object  # specdec.request.Request
    k: int  # drafts asked of the proposer (0: a plain round)
    drafted: int  # drafts the proposer made (<= k)
    accepted: int  # drafts accepted and committed (a stop may cut accepted drafts: not counted)
    committed: list[int]  # tokens appended to the request: accepted drafts + recovered/bonus,
    # cut at a stop (never empty: every round commits at least one token)
    source: str | None  # the part that drafted (None: no drafts)
    key: str | None  # its acceptance record
    delta: str  # new text handed to the caller (a possible stop string's prefix held back)
    hidden: torch.Tensor | None = None  # [len(committed), dim] the target's final hidden states
    # at the inputs whose logits produced the committed tokens; only when the proposer asks
    # (Proposer.wants_hidden_states)
    logprobs: list | None = None  # [specdec.request.TokenLogprob] per committed token, when the
    # request asks for log-probabilities (SamplingParams.logprobs)


@dataclass
class RoundResult:
    """One engine step: every active row's round, and what the batch cost."""

    rows: list[RowResult]
    width: int  # T = k + 1 of the verify forward (the batch's widest row)
    draft_s: float  # wall time of the proposer's call (all rows)
    target_s: float  # wall time of the verify forward (all rows)
