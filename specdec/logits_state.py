"""Per-request logits state: what the sampling chain needs besides the logits, at every candidate
position of a round, and how committed tokens update it.

A history-dependent transform (repetition, presence and frequency penalties; a grammar's mask,
specdec.grammar) must see each position's own prefix during verification: position i of a round sees
the committed tokens plus drafts d_1..d_i-1, on p and on q alike (docs/pitfalls.md 7). A `LogitsState`
answers `inputs(drafts)` for the k + 1 positions without changing itself, and `commit(token)` for
each token the engine commits; rejected drafts never touch it, so there is nothing to roll back.

`sampling_groups` and `stacked_inputs` are the one place where rows are grouped by (sampling
params, rng) and their per-position inputs stacked: the engine (p) and the draft model (q) both use
them, so p and q go through the same chain by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec import sampling
from specdec.config import SamplingParams


@dataclass
class LogitsInputs:
    """Inputs of the sampling chain for T positions (None: the chain needs none)."""

    counts: torch.Tensor | None = None  # [T, V] float: occurrences in the output before each position
    seen: torch.Tensor | None = None  # [T, V] bool: occurs in prompt or output before each position
    mask: torch.Tensor | None = None  # [T, V] bool: tokens a grammar allows at each position


NO_INPUTS = LogitsInputs()


class LogitsState(Protocol):
    def inputs(self, drafts: torch.Tensor, last_only: bool = False) -> LogitsInputs:
        """Inputs at the len(drafts) + 1 positions of a round: position i sees drafts[:i] on top
        of the committed tokens (last_only: only the last position, the one a draft model samples
        next). Pure: the state is unchanged."""
        ...

    def commit(self, token: int) -> None:
        """A token was committed to the request's history."""
        ...


class NoState:
    """Sampling without history-dependent transforms."""

    def inputs(self, drafts: torch.Tensor, last_only: bool = False) -> LogitsInputs:
        return NO_INPUTS

    def commit(self, token: int) -> None:
        pass


class PenaltyState:
    """Repetition penalty (prompt + output, Hugging Face semantics) and presence / frequency
    penalties (output only, OpenAI semantics)."""

    def __init__(self, vocab_size: int, prompt: list[int], device):
        self.counts = torch.zeros(vocab_size, device=device)  # [V] float: in the output
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V] prompt + output
        ids = torch.tensor([t for t in prompt if t < vocab_size], dtype=torch.long, device=device)
        self.seen[ids] = True

    def inputs(self, drafts: torch.Tensor, last_only: bool = False) -> LogitsInputs:
        if last_only:  # one position, not len(drafts) + 1: the draft loop asks once per draft
            counts = self.counts.index_add(0, drafts, torch.ones_like(drafts, dtype=self.counts.dtype))
            return LogitsInputs(counts[None], (self.seen | (counts > self.counts))[None])
        counts, seen = sampling.prefix_counts(self.counts, self.seen, drafts)
        return LogitsInputs(counts, seen)

    def commit(self, token: int) -> None:
        self.counts[token] += 1
        self.seen[token] = True


class CombinedState:
    """Several states of one request (penalties and a grammar): each answers its own fields."""

    def __init__(self, parts: list):
        self.parts = parts

    def inputs(self, drafts: torch.Tensor, last_only: bool = False) -> LogitsInputs:
        out = LogitsInputs()
        for part in self.parts:
            got = part.inputs(drafts, last_only)
            for f in FIELDS:
                if getattr(got, f) is not None:
                    setattr(out, f, getattr(got, f))
        return out

    def commit(self, token: int) -> None:
        for part in self.parts:
            part.commit(token)


FIELDS = ("counts", "seen", "mask")


def new_state(params: SamplingParams, vocab_size: int, prompt: list[int], device,
              grammar=None) -> LogitsState:
    """The request's state: penalties if it has any, and `grammar` (a specdec.grammar.GrammarState
    built by the engine, which knows the tokenizer) if it is constrained."""
    parts = []
    if params.has_penalties:
        parts.append(PenaltyState(vocab_size, prompt, device))
    if grammar is not None:
        parts.append(grammar)
    if not parts:
        return NoState()
    return parts[0] if len(parts) == 1 else CombinedState(parts)


def sampling_groups(reqs) -> list[tuple[SamplingParams, object, list[int]]]:
    """[(params, rng, row indices)]: rows that share sampling params and rng, sampled in one call.
    Greedy rows without penalties or log-probabilities share one group whatever their params
    objects (an argmax uses no dice and no other setting): a server's rows each bring their own.
    Seed-stable rows share a group by params alone: each row's noise is its own stream's
    (specdec.rejection.stable_noise), not the group's rng."""
    groups: dict[tuple, list[int]] = {}
    for b, r in enumerate(reqs):
        p = r.params
        plain_argmax = p.greedy and not p.has_penalties and p.logprobs is None and not p.constrained
        if plain_argmax:
            key = ("argmax",)
        elif p.stable and not p.greedy:  # each row's noise comes from its own stream
            key = ("stable", id(p))
        else:
            key = (id(p), id(r.rng))
        groups.setdefault(key, []).append(b)
    return [(reqs[idx[0]].params, reqs[idx[0]].rng, idx) for idx in groups.values()]


def stacked_inputs(reqs, idx: list[int], drafts: list[torch.Tensor], last_only: bool = False) -> LogitsInputs:
    """Rows idx's inputs stacked as [sum_b T_b, V] (T_b = len(drafts[b]) + 1), in row order;
    last_only: only each row's last position ([len(idx), V])."""
    parts = [reqs[b].logits_state.inputs(drafts[b], last_only) for b in idx]
    # (rows of a group share params: every row has a field, or none has)
    return LogitsInputs(**{f: None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts])
                           for f in FIELDS})
