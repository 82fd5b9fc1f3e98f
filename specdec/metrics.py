"""Acceptance statistics and the speculative cost model, defined once.

Definitions (per request, and summed over requests for aggregates):
  - rounds: target verify forwards in which at least one draft token was proposed.
  - draft_tokens: draft tokens proposed (sum of k over those rounds).
  - accepted_tokens: draft tokens accepted (the recovered/bonus token is NOT counted).
  - acceptance_rate = accepted_tokens / draft_tokens, in [0, 1] (vLLM's definition).
  - per_position_acceptance[i] = accepted at draft position i / proposed at position i.
  - mean_acceptance_length = accepted_tokens / rounds + 1: tokens per round, bonus included.
  - draft_cost_ratio c = mean draft forward time / mean target forward time (measured).
  - predicted_speedup: the seeds' cost model (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a the
    per-position acceptance probability estimated as accepted / (accepted + rejections), i.e.
    over the draft positions that were actually checked, and k the mean draft length.
  - chosen_k_histogram: rounds per k asked of the proposer (0: a plain round; adaptive k).
  - proposers: per proposer that drafted (a composite splits rounds by source): proposals
    (rounds it drafted >= 1 token), tokens_proposed, tokens_accepted, acceptance_rate, and
    k_histogram (the k asked in the rounds it drafted).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def predicted_speedup(alpha: float, k: float, c: float) -> float:
    if k <= 0:
        return 1.0
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + 1)


@dataclass
class ProposerStats:
    """One proposer's share of a request's rounds (composite proposers split rounds by source)."""

    proposals: int = 0  # rounds in which it drafted at least one token
    tokens_proposed: int = 0
    tokens_accepted: int = 0
    k_histogram: dict[int, int] = field(default_factory=dict)  # chosen k -> rounds it drafted

    def merge(self, other: "ProposerStats") -> None:
        self.proposals += other.proposals
        self.tokens_proposed += other.tokens_proposed
        self.tokens_accepted += other.tokens_accepted
        for k, n in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + n

    def to_dict(self) -> dict:
        return {"proposals": self.proposals, "tokens_proposed": self.tokens_proposed,
                "tokens_accepted": self.tokens_accepted,
                "acceptance_rate": self.tokens_accepted / self.tokens_proposed if self.tokens_proposed else 0.0,
                "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())}}


@dataclass
class SpecStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # rounds ended by a rejected draft (not by running out of drafts)
    proposed_at: list[int] = field(default_factory=list)  # [i] drafts proposed at position i
    accepted_at: list[int] = field(default_factory=list)  # [i] drafts accepted at position i
    draft_time: float = 0.0
    draft_forwards: int = 0
    target_time: float = 0.0
    target_forwards: int = 0
    chosen_k: dict[int, int] = field(default_factory=dict)  # k asked of the proposer -> rounds
    proposers: dict[str, ProposerStats] = field(default_factory=dict)

    def record_round(self, num_draft: int, n_accepted: int, chosen_k: int | None = None,
                     source: str | None = None) -> None:
        """One verify round: num_draft drafts proposed, n_accepted of them accepted; chosen_k is
        the k asked for (the proposer may draft fewer), source the proposer that drafted."""
        if chosen_k is not None:
            self.chosen_k[chosen_k] = self.chosen_k.get(chosen_k, 0) + 1
        if num_draft == 0:
            return
        self.rounds += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += n_accepted
        self.rejections += int(n_accepted < num_draft)
        while len(self.proposed_at) < num_draft:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_draft):
            self.proposed_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)
        if source is not None:
            ps = self.proposers.setdefault(source, ProposerStats())
            ps.proposals += 1
            ps.tokens_proposed += num_draft
            ps.tokens_accepted += n_accepted
            k = chosen_k if chosen_k is not None else num_draft
            ps.k_histogram[k] = ps.k_histogram.get(k, 0) + 1

    def merge(self, other: "SpecStats") -> None:
        for name in ("rounds", "draft_tokens", "accepted_tokens", "rejections", "draft_time",
                     "draft_forwards", "target_time", "target_forwards"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i in range(len(other.proposed_at)):
            if i >= len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += other.proposed_at[i]
            self.accepted_at[i] += other.accepted_at[i]
        for k, n in other.chosen_k.items():
            self.chosen_k[k] = self.chosen_k.get(k, 0) + n
        for name, ps in other.proposers.items():
            self.proposers.setdefault(name, ProposerStats()).merge(ps)

    def to_dict(self) -> dict:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        checked = self.accepted_tokens + self.rejections
        alpha = self.accepted_tokens / checked if checked else 0.0
        c = 0.0
        if self.draft_forwards and self.target_forwards and self.target_time > 0:
            c = (self.draft_time / self.draft_forwards) / (self.target_time / self.target_forwards)
        k = self.draft_tokens / self.rounds if self.rounds else 0.0
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": rate,
            "mean_acceptance_length": (self.accepted_tokens / self.rounds + 1) if self.rounds else 1.0,
            "per_position_acceptance": [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)],
            "draft_cost_ratio": c,
            "predicted_speedup": predicted_speedup(alpha, k, c) if self.rounds else 1.0,
            "chosen_k_histogram": {str(k): n for k, n in sorted(self.chosen_k.items())},
            "proposers": {name: ps.to_dict() for name, ps in sorted(self.proposers.items())},
        }
