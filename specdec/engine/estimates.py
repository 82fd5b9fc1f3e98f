"""What adaptive k measures and estimates (specdec.engine.adaptive chooses k from them): expected
committed tokens per round, cost curves over a width (EMA per measured width, interpolated), and
decayed per-position acceptance counts."""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_STRENGTH = 2.0  # pseudo-observations behind the prior (and behind the pooled estimate)
DECAY = 0.92  # per-round forgetting: ~12 rounds of memory, so regime changes are followed
EMA = 0.25  # weight of a new cost observation


def expected_tokens(alphas: list[float], k: int) -> float:
    """Committed tokens of a round with k drafts: accepted prefix + 1 recovered/bonus token."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[i]
        total += run
    return total


class CostCurve:
    """Seconds per round as a function of an integer width, from measurements (EMA per width).

    estimate(w) interpolates linearly between measured widths and extrapolates with the slope of
    the two nearest measured ones (or `prior_slope` * the nearest value if only one is known)."""

    def __init__(self, prior_slope: float):
        self.prior_slope = prior_slope
        self.seen: dict[int, float] = {}

    def observe(self, width: int, seconds: float) -> None:
        old = self.seen.get(width)
        if old is not None:
            seconds = min(seconds, 3 * old)  # one stall (GC, another process) is not a trend
        self.seen[width] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def estimate(self, width: int) -> float | None:
        if not self.seen:
            return None
        if width in self.seen:
            return self.seen[width]
        ws = sorted(self.seen)
        lo = [w for w in ws if w < width]
        hi = [w for w in ws if w > width]
        if lo and hi:
            a, b = lo[-1], hi[0]
            t = (width - a) / (b - a)
            return self.seen[a] * (1 - t) + self.seen[b] * t
        near = lo[-2:] if lo else hi[:2]
        if len(near) == 2:
            (a, b) = near
            slope = max((self.seen[b] - self.seen[a]) / (b - a), 0.0)
        else:
            slope = self.prior_slope * self.seen[near[0]]
        base = near[-1] if lo else near[0]
        return max(self.seen[base] + slope * (width - base), 0.0)


@dataclass
class Acceptance:
    """Decayed counts per draft position: reached[i] (drafts 1..i-1 were accepted, i proposed)
    and accepted[i]."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def decay(self) -> None:
        self.reached = [x * DECAY for x in self.reached]
        self.accepted = [x * DECAY for x in self.accepted]

    def observe(self, num_draft: int, n_accepted: int) -> None:
        reached = min(num_draft, n_accepted + 1)  # positions checked: accepted ones + first reject
        while len(self.reached) < reached:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for i in range(reached):
            self.reached[i] += 1
            self.accepted[i] += float(i < n_accepted)

    def rate(self, prior: float, start: int = 0) -> float:
        """Acceptance over positions start.. together, Beta-smoothed toward `prior`."""
        return ((sum(self.accepted[start:]) + PRIOR_STRENGTH * prior)
                / (sum(self.reached[start:]) + PRIOR_STRENGTH))

    def alphas(self, k: int, prior: list[float]) -> list[float]:
        out = []
        for i in range(k):
            r = self.reached[i] if i < len(self.reached) else 0.0
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            out.append((a + PRIOR_STRENGTH * prior[i]) / (r + PRIOR_STRENGTH))
        return out


NOTHING_SEEN = Acceptance()  # read-only stand-in for a record with no rounds yet


def measured_draft(step: CostCurve | None, k: int, rows: int) -> float | None:
    """Measured seconds to draft k tokens for `rows` rows: k draft steps at the per-step cost
    the curve (over rows) estimates; None before any measurement."""
    return k * step.estimate(rows) if step is not None and step.seen else None
