"""Choosing k, the number of draft tokens per round: fixed, or adaptive per request.

Adaptive k (`num_draft_tokens="auto"`) picks, each round and for each request, the k in
[0, k_max] that maximises expected committed tokens per second:

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i=1..j} alpha_i
    cost(k)       = t_target(B, k + 1) + t_draft(k)      (a draft tree: t_target(B, nodes(k) + 1))
    k*            = argmax_k E[tokens | k] / cost(k)          (k = 0 is plain decoding)

alpha_i is the request's running estimate of P(draft i accepted | drafts 1..i-1 accepted): a
Beta-smoothed ratio of decayed counts (accepted at i / reached i), started from the engine-wide
pool so a new request inherits what earlier requests taught; each position's estimate is shrunk
toward the request's rate (the first position toward the rate over all positions, the others
toward the continuation rate over positions 2.. of all the proposer's rounds, whatever n-gram
length matched: a missed first draft says little about how a started copy continues, and a
short match that starts one continues like a long one), so a few rounds suffice near alpha = 1.

Estimates and draft costs are kept per proposer: before choosing, the engine asks the proposer
which of its parts could draft this round and how many tokens each has (`Proposer.peek`: a
composite's n-gram lookup has a 5-token continuation of a 3-token match, and its draft model
could draft k). Each candidate is priced with its own acceptance record (the n-gram's per
matched suffix length, "ngram@3": long matches go on being copied far more often than 1-token
ones) and its own draft cost, and the best (proposer, k) wins; a composite then drafts from
that part. A free n-gram match and a costly, uncertain draft-model round are priced as what
they are, and a usually-wrong 1-token match no longer keeps the draft model from running.

A draft model that has not run for a while must first feed every token committed since (on
its first round: the whole prompt; the engine prefills it with the target's only at a fixed k) -- a prefill that can cost more than the round itself. A
candidate's catch-up (`Candidate.catch_up`) is priced at the proposer's measured seconds per
caught-up token, spread over the request's next min(remaining, 32) tokens (the prefill is paid
once and serves later rounds, but a composite's n-gram may take over again, so it is not
assumed to pay back over the whole answer): rate = 1 / (round cost / E[tokens] + catch-up /
horizon). So a composite on a 180-token copy-heavy prompt does not pay a draft prefill (~1.8 s
in fp32 here) for the one round its n-gram has no match, and on a short open-ended prompt it
still starts its draft model.

The costs are measured, not assumed: `CostCurve` keeps an exponential moving average of the
observed seconds for each width and interpolates between measured widths. The target's curve is
over the verify forward's real shape, B rows x (k + 1) tokens, one curve for every batch size (a
plain round of 16 rows and a k = 3 round of 4 rows both verify 16 tokens, and under load the
forward is compute-bound in that number); a draft's is seconds per draft step over the rows
drafting, per proposer, so a composite's free n-gram rounds and costly draft-model rounds are
kept apart, and k steps cost k times one. On this CPU t_target(T) is far from flat
for some backends, so it matters that the curve is the machine's own.

Losslessness: k (and which proposer drafts) is chosen from the past only (committed tokens,
earlier acceptances, clocks), never from the current round's draws, so every round is an
ordinary speculative round with some k and the output distribution is the target's whatever k is (tests/test_statistical.py checks
it through the engine with adaptive k and its negative control).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

from specdec.engine.estimates import (DECAY, EMA, NOTHING_SEEN, Acceptance, CostCurve, expected_tokens,
                                      measured_draft)
from specdec.round import Candidate, Choice, Proposal

PRIOR_ALPHA = 0.6  # prior acceptance per position before anything is observed
DRAFT_PRIOR_C = 0.3  # draft cost per token, as a fraction of one target forward, until measured
CATCH_UP_PRIOR_C = 0.05  # a draft model's cost per caught-up (prefilled) token, same units
STEADY_CATCH_UP = 2  # tokens a draft model feeds every round anyway (last accepted + bonus)
CATCH_UP_HORIZON = 32  # a catch-up is spread over at most this many of the next tokens
VERIFY_PRIOR_SLOPE = 0.05  # target cost per extra verified token, same units, until measured
EXPLORE_EVERY = 32  # plain rounds in a row (per row of the batch) before a priced-out proposer drafts 1 token again
EXPLORE_CATCH_UP = 64  # most catch-up tokens (all rows together) an exploring round may feed
DRAFT_ROW_PRIOR_SLOPE = 0.3  # a draft step's cost per extra row, as a fraction, until measured


class KPolicy(Protocol):
    """How many drafts each row gets each round. The engine calls every method of it; a policy
    that does not learn implements the observations as no-ops."""

    k_max: int
    def prefills_draft(self, batch_size: int) -> bool:
        """Whether a draft model's prompt is prefilled with the target's (prompt processing),
        rather than caught up when the draft model first runs."""
        ...

    def begin(self, req) -> None: ...

    def release(self, req) -> None: ...

    def plan(self, req, batch_size: int, limit: int, peek: Callable[[int], list[Candidate]],
             remaining: int) -> Choice:
        """k in [0, limit] for this row's round, and which part drafts. peek(k): the proposer's
        candidates (called only by a policy that prices them)."""
        ...

    def settle(self, reqs: list, choices: list[Choice], batch_size: int) -> list[Choice]:
        """The batch's choices together: one verify forward runs at the widest row's k + 1
        for every row, so a policy may cut the rows' k to a common width."""
        ...

    def observe_draft(self, k: int, seconds: float, proposal: Proposal) -> None:
        """One proposing call at width k took `seconds` (all rows)."""
        ...

    def observe_target(self, batch_size: int, width: int, seconds: float) -> None: ...

    def observe_round(self, req, num_draft: int, n_accepted: int, source: str | None = None,
                      key: str | None = None) -> None: ...


class FixedK:
    """The same k every round (the budget near max_tokens / the context limit still cuts it)."""

    def __init__(self, k: int):
        self.k = k
        self.k_max = k

    def prefills_draft(self, batch_size: int) -> bool:
        return True  # the draft model will surely run: its prompt is prompt processing

    def choose(self, req, batch_size: int, limit: int) -> int:
        return min(self.k, limit)  # a fixed k is asked for even where the proposer has fewer

    def plan(self, req, batch_size: int, limit: int, peek, remaining: int) -> Choice:
        return Choice(self.choose(req, batch_size, limit))

    def settle(self, reqs: list, choices: list[Choice], batch_size: int) -> list[Choice]:
        return choices

    def begin(self, req) -> None:
        pass

    def release(self, req) -> None:
        pass

    def observe_round(self, req, num_draft: int, n_accepted: int, source: str | None = None,
                      key: str | None = None) -> None:
        pass

    def observe_target(self, batch_size: int, width: int, seconds: float) -> None:
        pass

    def observe_draft(self, k: int, seconds: float, proposal: Proposal) -> None:
        pass


class AdaptiveK:
    """Per-request k in [0, k_max] maximising expected committed tokens per second (see above).

    cost: optional fixed cost model `cost(batch_size, k) -> seconds` (tests use one to make the
    choice depend only on acceptance); by default costs are measured online."""

    SPECULATING = 0.25  # below this decayed share of rounds that drafted, at a batch size, a
    # draft model's prompt is left to catch-up (priced, maybe never paid) instead of prefilled

    def __init__(self, k_max: int, cost=None, free_sources: set[str] = frozenset(),
                 width: Callable[[int], int] | None = None, priors: dict[str, tuple[float, float]] | None = None):
        self.k_max = k_max
        # per proposer, (first draft, later drafts) acceptance to start from instead of PRIOR_ALPHA:
        # what the proposer measured itself (a head's held-out acceptance, head.json); without it
        # positions never tried stay at 0.6 and a head that pays at k = 1 keeps trying k = 2
        self.priors = dict(priors or {})
        self.cost = cost
        # tokens a row verifies in a round of depth k: k + 1 for a chain; a draft tree's nodes
        # + 1 (its verify forward is that wide, whatever the depth)
        self.width = width or (lambda k: k + 1)
        # Target: seconds per verify forward over its real shape, rows x (k + 1) tokens, one curve
        # for every batch size (a plain round of 16 rows and a k = 3 round of 4 rows both verify
        # 16 tokens). Draft: seconds per draft step over the rows drafting, per proposer.
        self.target = CostCurve(VERIFY_PRIOR_SLOPE)
        self.draft: dict[str, CostCurve] = {}  # proposer (source) name -> step seconds over rows
        self.catch_up: dict[str, float] = {}  # proposer name -> EMA seconds per caught-up token
        self.sources: dict[int, dict[str, float]] = {}  # request id -> decayed rounds per proposer
        # Acceptance counts per proposer (key: its name; None: all proposers together, what a
        # choice without a known proposer uses): engine-wide pools seed each request's own.
        self.pool: dict[str | None, Acceptance] = {}
        self.state: dict[int, dict[str | None, Acceptance]] = {}  # request id -> its counts
        self.chosen = Counter()
        # proposers that run no model (n-gram lookup): drafting costs ~nothing until measured
        self.free_sources: set[str] = set(free_sources)
        self.drafting: dict[int, float] = {}  # batch size -> decayed share of rounds with drafts
        self._declined: dict[int, tuple[Choice, int]] = {}  # request id -> (the k = 1 round it was
        # priced out of, the catch-up tokens that round would feed first)
        self._quiet = 0  # rounds in a row that drafted nothing while some row could have
        # round costs by (batch size, kmax, proposer), for the rows of one round: the same for
        # every row that a named proposer would draft; forgotten whenever a cost is observed
        self._costs: dict[tuple, list[float]] = {}

    def prefills_draft(self, batch_size: int) -> bool:
        """While speculation runs at this load (or before anything is known), a draft model's
        prompt is prompt processing, prefilled with the target's: priced as catch-up instead,
        a prompt of a few hundred tokens would keep an untried draft model from ever starting.
        Where the batch has settled on plain rounds, it is left to catch-up. A batch size not
        seen yet is judged by the nearest lighter one seen: speculation pays less as the batch
        grows, so a load above one that settled on plain rounds does not prefill (a server
        whose clients ramp up would otherwise prefill every new size's first prompts for
        nothing)."""
        return self._drafting_share(batch_size) >= self.SPECULATING

    def _drafting_share(self, batch_size: int) -> float:
        """The decayed share of rounds that drafted at this batch size; for one not seen yet,
        the nearest lighter size's (1.0 where none is known: speculation is tried)."""
        share = self.drafting.get(batch_size)
        if share is None:
            lighter = [b for b in self.drafting if b < batch_size]
            share = self.drafting[max(lighter)] if lighter else 1.0
        return share

    def begin(self, req) -> None:
        self.state[req.id] = {}

    def release(self, req) -> None:
        self.state.pop(req.id, None)
        self.sources.pop(req.id, None)
        self._declined.pop(req.id, None)

    def _alphas(self, req, source: str | None, k: int, key: str | None = None) -> list[float]:
        """Per-position estimates for drafts by `source` under acceptance record `key` (default:
        the source's own): position 1 shrunk toward the key's rate over all positions, itself
        shrunk toward the pool's (and that toward PRIOR_ALPHA).  Pooling positions matters near
        alpha = 1: each position alone sees few rounds, and a prior pulling all k of them down
        compounds in the product (8 positions at 0.9 instead of 0.97: 0.43 instead of 0.78)."""
        key = key or source
        # a proposer not seen yet starts from PRIOR_ALPHA, not from the others' record (a
        # composite's useless 1-token n-gram matches must not condemn its draft model unseen)
        pool = self.pool.get(key) or NOTHING_SEEN
        own = self.state[req.id].get(key) or NOTHING_SEEN
        first, later = self.priors.get(source, (PRIOR_ALPHA, PRIOR_ALPHA))
        pool_all = pool.rate(first)
        # The first draft is the gamble; once it is accepted the next ones are a continuation
        # (an n-gram copy that has started goes on far more often than it starts), so
        # positions 2.. are shrunk toward a continuation rate, not toward one dragged down by
        # first-position misses: (8 drafted, 0 accepted) says little about position 5.  How a
        # started copy goes on is the proposer's and the text's, not the matched length's: a
        # key's continuation is shrunk toward its source's (all its keys together), so a
        # 1-token match, rarely accepted and so rarely continued, still drafts long where the
        # request's other copies showed that continuations are accepted whole.
        src_pool = self.pool.get(source) or NOTHING_SEEN
        src_own = self.state[req.id].get(source) or NOTHING_SEEN
        tail = src_own.rate(src_pool.rate(later, start=1), start=1)
        if key != source:
            tail = own.rate(tail, start=1)
        return own.alphas(k, [own.rate(pool_all)] + [tail] * (k - 1))

    def _round_costs(self, batch_size: int, kmax: int, shares: dict[str, float] | None,
                     source: str | None = None) -> list[float]:
        """cost(k) for k = 0..kmax (the base t_target(B, 1) is looked up once)."""
        if self.cost is not None:
            return [self.cost(batch_size, k) for k in range(kmax + 1)]
        if source:
            memo = self._costs.get((batch_size, kmax, source))
            if memo is None:
                memo = self._costs[batch_size, kmax, source] = self._compute_costs(batch_size, kmax, None, source)
            return list(memo)
        return self._compute_costs(batch_size, kmax, shares, source)

    def _compute_costs(self, batch_size: int, kmax: int, shares: dict[str, float] | None,
                       source: str | None) -> list[float]:
        B = batch_size
        t1 = self.target.estimate(B)  # a plain round
        t1 = 1.0 if t1 is None else t1  # (nothing measured yet)
        mix = {source: 1.0} if source else shares  # whose draft cost: the named proposer's, or a mix
        costs = []
        for k in range(kmax + 1):
            w = self.width(k) if k else 1
            tt = self.target.estimate(B * w)
            if tt is None:
                tt = t1 * (1 + VERIFY_PRIOR_SLOPE * (w - 1))
            costs.append(tt + self._draft_cost(mix, k, t1, B))
        return costs

    def _draft_cost(self, shares: dict[str, float] | None, k: int, t1: float, rows: int = 1) -> float:
        """Measured draft cost at k for `rows` rows, mixed by how often each proposer drafted
        for this request lately (a composite's n-gram rounds are nearly free, its draft-model
        rounds are not); before any round, the costliest curve measured."""
        def cost(curve, src=None):
            est = measured_draft(curve, k, rows)
            if est is not None:
                return est
            return 0.0 if src in self.free_sources else DRAFT_PRIOR_C * t1 * k

        total = sum(shares.values()) if shares else 0.0
        if total > 0:
            return sum(w * cost(self.draft.get(src), src) for src, w in shares.items()) / total
        if self.draft:
            return max(cost(c) for c in self.draft.values())
        return DRAFT_PRIOR_C * t1 * k

    def choose(self, req, batch_size: int, limit: int, source: str | None = None,
               available: int | None = None) -> int:
        """k for this round.  source / available: the proposer that would draft and how many
        tokens it has (None: unknown; costs are then mixed by the request's recent proposers)."""
        n = self.k_max if available is None else available
        return self.choose_among(req, batch_size, limit, [Candidate(source, n)]).k

    def plan(self, req, batch_size: int, limit: int, peek, remaining: int) -> Choice:
        """Price each part that could draft (the proposer's `peek`) and take the best."""
        cands = peek(min(limit, self.k_max)) if limit > 0 else []
        return self.choose_among(req, batch_size, limit, cands, remaining=remaining)

    def choose_among(self, req, batch_size: int, limit: int, candidates: list[Candidate],
                     remaining: int | None = None) -> Choice:
        """Each candidate is priced with its own acceptance (by record), cost (by source) and
        catch-up spread over the next min(`remaining`, CATCH_UP_HORIZON) tokens (None: charged
        to this round), and the best rate wins (k = 0: a plain round, source and key None)."""
        best, best_rate, lag = Choice(0), -1.0, 0
        for cand in candidates:
            kmax = min(self.k_max, limit, cand.available)
            if kmax > 0:
                k, rate = self._best(req, batch_size, kmax, cand.source, cand.record,
                                     cand.catch_up, remaining)
                if rate > best_rate * (1 + 1e-9):
                    best, best_rate, lag = Choice(k, cand.source, cand.record), rate, cand.catch_up
        self.chosen[best.k] += 1
        if best.k == 0 and best.source is not None:  # priced out: settle may still explore it
            self._declined[req.id] = (Choice(1, best.source, best.key), lag)
        else:
            self._declined.pop(req.id, None)
        return best if best.k else Choice(0)

    def settle(self, reqs: list, choices: list[Choice], batch_size: int) -> list[Choice]:
        """Each row chose its k as if the forward were its own; but the batch verifies at one
        width W = the largest k, and every row pays W + 1 positions of it (under load the
        forward is compute-bound: B (W + 1) tokens). Keep the W in [0, max k] that maximises
        the batch's expected committed tokens per second, sum_rows E_r[tokens | min(k_r, W)]
        / (t_target(B, W + 1) + t_draft(W)), and cut every row's k to it: as concurrency rises
        and a wide verify costs more, speculation shortens and at last switches itself off."""
        kmax = max(c.k for c in choices)
        settled = self._settle(reqs, choices, batch_size, kmax) if kmax and len(choices) > 1 else choices
        settled = self._explore(reqs, settled)
        share = self._drafting_share(batch_size)  # (a new size starts from the lighter one's)
        self.drafting[batch_size] = DECAY * share + (1 - DECAY) * float(any(c.k for c in settled))
        return settled

    def _explore(self, reqs: list, choices: list[Choice]) -> list[Choice]:
        """Every (EXPLORE_EVERY x batch size)-th round in a row that drafted nothing while some
        row could have, those rows draft one token, fewest catch-up tokens first, as long as their
        catch-ups add up to at most EXPLORE_CATCH_UP tokens (a batch of rows each behind by a
        few dozen plain rounds, or a draft model that must first feed a prompt, is not explored
        under load: there that catch-up costs more than exploring could win; a single row
        gets EXPLORE_CATCH_UP per period of quiet rounds, so it is explored in the end). A cost is measured only at widths that are chosen,
        so one slow measurement (a cold first round, another process on the core) would
        otherwise price a width out for good; a k = 1 round costs little and measures the
        narrowest drafting width again, from which the choice climbs if it pays. It costs
        little alone, not in a batch: one row at k = 1 makes every row of the verify forward 2
        tokens wide (a compute-bound forward over twice the tokens at 16 rows on AVX2), so
        under load it is tried proportionally less often (a plain round of B rows measures
        the width that a B / 2-row round at k = 1 verifies anyway)."""
        if any(c.k for c in choices):
            self._quiet = 0
            return choices
        declined = [(self._declined[r.id][1], b) for b, r in enumerate(reqs) if r.id in self._declined]
        if not declined:
            return choices
        self._quiet += 1
        periods = self._quiet // (EXPLORE_EVERY * len(reqs))
        if not periods:
            return choices
        # Alone (one row), the catch-up budget grows with the quiet rounds (EXPLORE_CATCH_UP per
        # period), so the rate of catch-up paid for exploring stays what it was, and a request
        # whose draft model is a whole prompt behind (not prefilled: speculation had settled off
        # at this load, e.g. after a first draft was rejected) is still explored once enough
        # quiet rounds have passed; with a fixed budget it never was, and a server's speculation
        # at concurrency 1 stayed off for its lifetime. Under load the budget stays fixed: there
        # an exploring row widens every row's verify, and letting larger catch-ups through cost
        # throughput at 8 rows in the one run that tried it (docs/bench/README.md, Zen 4).
        out, budget = list(choices), EXPLORE_CATCH_UP * (periods if len(reqs) == 1 else 1)
        for lag, b in sorted(declined):
            if lag > budget:
                break
            budget -= lag
            out[b] = self._declined[reqs[b].id][0]
        if out != choices or len(reqs) > 1:  # (alone, nothing fitted: the quiet rounds add up)
            self._quiet = 0
        return out

    def _settle(self, reqs: list, choices: list[Choice], batch_size: int, kmax: int) -> list[Choice]:
        alphas = [self._alphas(r, c.source, c.k, c.key) if c.k else [] for r, c in zip(reqs, choices)]
        drafting = {c.source for c in choices if c.k}
        # the batch pays the costliest drafting part among its rows (a model, not a lookup)
        source = max(drafting, key=lambda s: (self._draft_cost({s: 1.0} if s else None, kmax, 1.0, batch_size), str(s)))
        costs = self._round_costs(batch_size, kmax, None, source)
        best_w, best = 0, -1.0
        for w, cost in enumerate(costs):
            e = sum(expected_tokens(a, min(c.k, w)) for a, c in zip(alphas, choices))
            rate = e / max(cost, 1e-12)
            if rate > best * (1 + 1e-9):  # ties go to the narrower batch
                best_w, best = w, rate
        if best_w == kmax:
            return choices
        return [c if c.k <= best_w else (Choice(best_w, c.source, c.key) if best_w else Choice(0))
                for c in choices]

    def _best(self, req, batch_size: int, kmax: int, source: str | None,
              key: str | None = None, lag: int = 0, remaining: int | None = None) -> tuple[int, float]:
        """argmax over k in [0, kmax] of E[tokens] / cost, and that rate (a catch-up of `lag`
        tokens, beyond the steady per-round feed, spread over the next min(remaining,
        CATCH_UP_HORIZON) tokens)."""
        alphas = self._alphas(req, source, kmax, key)
        costs = self._round_costs(batch_size, kmax, self.sources.get(req.id), source)
        extra = 0.0  # (a fixed cost model prices rounds only)
        if lag > STEADY_CATCH_UP and self.cost is None:  # costs[0]: a plain round, t_target(B, 1)
            extra = (lag - STEADY_CATCH_UP) * self.catch_up.get(source, CATCH_UP_PRIOR_C * costs[0])
        horizon = min(remaining, CATCH_UP_HORIZON) if remaining else 0
        best_k, best = 0, -1.0
        for k, cost in enumerate(costs):
            e = expected_tokens(alphas, k)
            if k and extra:  # (k = 0 drafts nothing, so catches nothing up)
                cost += extra * e / max(horizon, e)
            rate = e / max(cost, 1e-12)
            if rate > best * (1 + 1e-9):  # ties go to the smaller k
                best_k, best = k, rate
        return best_k, best

    def observe_round(self, req, num_draft: int, n_accepted: int, source: str | None = None,
                      key: str | None = None) -> None:
        """key: the acceptance record the round belongs to (default: source)."""
        st = self.state.get(req.id)
        if st is None:
            return
        for counts in st.values():
            counts.decay()
        shares = self.sources.setdefault(req.id, {})
        for src in shares:
            shares[src] *= DECAY
        if num_draft:  # the round counts for its key, its source (all its keys) and overall
            records = [None] if source is None else list(dict.fromkeys([None, source, key or source]))
            if source is not None:
                shares[source] = shares.get(source, 0.0) + 1.0
            for rec in records:
                st.setdefault(rec, Acceptance()).observe(num_draft, n_accepted)
                self.pool.setdefault(rec, Acceptance()).observe(num_draft, n_accepted)

    def observe_target(self, batch_size: int, width: int, seconds: float) -> None:
        """Once per round (so also where the pool forgets: per round, not per request)."""
        for counts in self.pool.values():
            counts.decay()
        self.target.observe(batch_size * width, seconds)
        self._costs.clear()

    def observe_catch_up(self, tokens: int, seconds: float, source: str | None = None) -> None:
        """A proposing round that first fed `tokens` committed tokens (beyond the steady feed)
        took `seconds` more than drafting alone is estimated to: seconds per caught-up token."""
        if tokens > 0 and source is not None:
            per = max(seconds, 0.0) / tokens
            self._costs.clear()
            old = self.catch_up.get(source)
            self.catch_up[source] = per if old is None else (1 - EMA) * old + EMA * min(per, 3 * old)

    def draft_estimate(self, k: int, source: str | None, rows: int = 1) -> float | None:
        """Measured seconds to draft k tokens for `rows` rows (no catch-up) by `source`, or None."""
        return measured_draft(self.draft.get(source), k, rows)

    def observe_draft(self, k: int, seconds: float, proposal: Proposal) -> None:
        """One proposing call at width k, all rows. A call in which one part drafted every row
        measures that part (mixed sources cannot be told apart); a draft model's prompt prefill
        or long catch-up is not the cost of drafting k, so it is measured apart, per caught-up
        token."""
        sources = set(proposal.source or [])
        if len(sources) != 1:
            return
        source = sources.pop()
        rows = proposal.tokens.shape[0]
        if proposal.catch_up <= STEADY_CATCH_UP:
            self.observe_draft_cost(k, seconds, source, rows)
        else:
            est = self.draft_estimate(k, source, rows)
            extra = seconds - est if est is not None else seconds * proposal.catch_up / (proposal.catch_up + k)
            self.observe_catch_up(proposal.catch_up - STEADY_CATCH_UP, extra, source)

    def observe_draft_cost(self, k: int, seconds: float, source: str | None = None, rows: int = 1) -> None:
        """Seconds to draft k tokens for `rows` rows by `source` (no catch-up): k draft steps."""
        if k > 0:
            self.draft.setdefault(source, CostCurve(DRAFT_ROW_PRIOR_SLOPE)).observe(rows, seconds / k)
            self._costs.clear()


def k_policy(num_draft_tokens: int | str, max_draft_tokens: int, cost=None,
             free_sources: set[str] = frozenset(), width: Callable[[int], int] | None = None,
             priors: dict[str, tuple[float, float]] | None = None) -> KPolicy:
    """FixedK for an int, AdaptiveK(max_draft_tokens) for "auto" (width: tokens verified per row
    at depth k, for draft trees; priors: AdaptiveK's)."""
    if num_draft_tokens == "auto":
        return AdaptiveK(max_draft_tokens, cost, free_sources, width, priors)
    return FixedK(int(num_draft_tokens))
