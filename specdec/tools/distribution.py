"""Distribution machinery for whole-engine losslessness checks (`specdec verify` and the tests).

- `EnumRng` / `enumerate_outcomes` / `engine_joint_exact`: replace the engine's dice with an
  explorer. Every `bernoulli` / `categorical` call is a choice point; a run is replayed once per
  path of choices (depth-first), weighted by the product of the chosen probabilities. The code
  under test (proposer, verifier, commit) is the engine's own; only the dice change, so the result
  is the exact distribution that code produces, with no sampling noise (tiny vocabularies only).
- `target_joint`: the target's joint of the first n tokens, prod_i p(x_i | prefix, x_<i), level by
  level from any `logits_fn`; optionally only over prefixes of probability >= min_prob, the rest
  of the mass returned under `REST` (exactly 1 - the listed mass), so big vocabularies work.
- `sample_engine`: counts of the first n tokens from the real engine loop (batched rows).
- `chi_square`, `noncentrality`, `detectable_tv`: Pearson's test, its noncentrality under an
  alternative, and the smallest total-variation distance the test detects at a given power.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from specdec import sampling
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.rejection import GumbelStream, TorchRng

PRUNE = 1e-12  # branches this unlikely change probabilities by < 1e-9 in total: skip them
REST = ("<rest>",)  # the cell holding every sequence not listed in a truncated joint


class EnumRng:
    def __init__(self, script: list[int]):
        self.script = script
        self.path: list[int] = []
        self.arity: list[int] = []
        self.weight = 1.0

    def _choose(self, options):
        i = len(self.path)
        idx = self.script[i] if i < len(self.script) else 0
        self.path.append(idx)
        self.arity.append(len(options))
        value, w = options[idx]
        self.weight *= w
        return value

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        out = []
        for pr in probs.double().flatten().tolist():
            opts = [(v, w) for v, w in ((True, pr), (False, 1.0 - pr)) if w > PRUNE]
            out.append(self._choose(opts))
        return torch.tensor(out, dtype=torch.bool).view(probs.shape)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        rows = probs.double() / probs.double().sum(-1, keepdim=True)
        return torch.tensor([self._choose([(x, w) for x, w in enumerate(row.tolist()) if w > PRUNE])
                             for row in rows], dtype=torch.long)


def enumerate_outcomes(run) -> dict:
    """run(rng) -> hashable outcome; returns {outcome: exact probability}."""
    result: dict = defaultdict(float)
    stack = [[]]
    while stack:
        script = stack.pop()
        rng = EnumRng(script)
        result[run(rng)] += rng.weight
        for depth in range(len(script), len(rng.path)):
            for alt in range(1, rng.arity[depth]):
                stack.append(rng.path[:depth] + [alt])
    return dict(result)


def engine_joint_exact(engine: Engine, prompt: list[int], params: SamplingParams, n: int = 3) -> dict:
    """Exact distribution of the first n output tokens as the engine produces them.

    Dynamic programming over committed prefixes: from each prefix of length < n, enumerate one
    round of the engine (resumed from that prefix); outcomes reaching n tokens are leaves."""
    joint: dict = defaultdict(float)
    frontier = {(): 1.0}
    while frontier:
        nxt: dict = defaultdict(float)
        for prefix, w in frontier.items():
            def run(rng, prefix=prefix):
                req = engine.add_request(prompt, params, rng=rng, output_prefix=list(prefix))
                try:
                    engine.step()
                    return tuple(req.output)
                finally:
                    engine.abort(req)
            for out, pw in enumerate_outcomes(run).items():
                if len(out) >= n:
                    joint[out[:n]] += w * pw
                else:
                    nxt[out] += w * pw
        frontier = nxt
    return dict(joint)


def full_forward_logits(model, max_seq_len: int = 64):
    """logits_fn for `target_joint`: one plain full forward per sequence (small models)."""
    def logits_fn(seqs: list[list[int]]) -> torch.Tensor:
        out = []
        for seq in seqs:
            cache = model.new_cache(1, max(max_seq_len, len(seq) + 1))
            out.append(model.forward(torch.tensor([seq]), torch.arange(len(seq)).view(1, -1), cache)[0, -1])
        return torch.stack(out)
    return torch.inference_mode()(logits_fn)


def next_token_probs(logits_fn, prompt: list[int], prefixes: list[tuple], params: SamplingParams,
                     V: int, chunk: int = 64, mask_fn=None) -> torch.Tensor:
    """p(. | prompt + prefix) [P, V] float64 after the sampling transforms, penalties counted on
    each prefix as the engine counts them (repetition: prompt + output; others: output), and a
    grammar's mask_fn(prefix) -> [V] bool (the tokens it allows there) applied first."""
    rows = []
    for s in range(0, len(prefixes), chunk):
        part = prefixes[s:s + chunk]
        logits = logits_fn([prompt + list(p) for p in part])[:, :V].float()  # [P, V]
        counts = seen = None
        if params.has_penalties:
            counts = torch.zeros(len(part), V)
            seen = torch.zeros(len(part), V, dtype=torch.bool)
            seen[:, torch.tensor([t for t in prompt if t < V], dtype=torch.long)] = True
            for b, prefix in enumerate(part):
                for t in prefix:
                    counts[b, t] += 1
                    seen[b, t] = True
        mask = None if mask_fn is None else torch.stack([mask_fn(tuple(p)) for p in part])
        rows.append(sampling.probabilities(logits, params, counts, seen, mask).double())
    return torch.cat(rows)


@torch.inference_mode()
def target_joint(logits_fn, prompt: list[int], params: SamplingParams, V: int, n: int = 3,
                 min_prob: float = 0.0, mask_fn=None) -> dict:
    """{first n tokens: prod_i p(x_i | prompt, x_<i)}, level by level (one batched logits_fn call
    per level). Prefixes with probability < min_prob are not expanded: their mass goes to REST,
    computed as 1 - the listed mass, so the listed cells are exact and the dict sums to 1."""
    joint: dict = {}
    level = {(): 1.0}
    for depth in range(n):
        prefixes = list(level)
        probs = next_token_probs(logits_fn, prompt, prefixes, params, V, mask_fn=mask_fn)
        nxt: dict = {}
        for prefix, row in zip(prefixes, probs):
            w = level[prefix]
            keep = (row > 0) & (row * w >= min_prob) if min_prob > 0 else row > 0
            for x in keep.nonzero().flatten().tolist():
                nxt[prefix + (x,)] = w * float(row[x])
        level = nxt
    joint.update(level)
    if min_prob > 0:
        joint[REST] = max(0.0, 1.0 - sum(level.values()))
    return joint


def target_joint_exact(target, prompt: list[int], params: SamplingParams, n: int = 3, mask_fn=None) -> dict:
    """The exact joint by plain full forwards (tiny models: every branch); mask_fn: a grammar's
    allowed tokens after each prefix (structured output's constrained joint)."""
    return target_joint(full_forward_logits(target), prompt, params, target.args.vocab_size, n, mask_fn=mask_fn)


def impossible_samples(logits_fn, prompt, params, V, keys) -> list[tuple]:
    """The keys (sampled sequences) with a token of target probability 0 given its prefix."""
    prefixes = sorted({k[:i] for k in keys for i in range(len(k))})
    if not prefixes:
        return []
    probs = dict(zip(prefixes, next_token_probs(logits_fn, prompt, prefixes, params, V)))
    return [k for k in keys if any(probs[k[:i]][k[i]] <= 0 for i in range(len(k)))]


def sample_engine(engine: Engine, prompt, params, n_samples: int, batch: int, seed: int, n: int = 3,
                  stats=None, on_batch=None) -> dict:
    """Counts of the first n tokens from the real engine loop (batched rows, one shared rng; for
    seed-stable params, row i's own GumbelStream seeded seed * n_samples + i: the distribution
    over seeds). `stats` (a SpecStats) accumulates the requests' speculative statistics."""
    counts: dict = defaultdict(int)
    rng = TorchRng(seed)
    engine.reserve(batch)
    done = 0
    while done < n_samples:
        b = min(batch, n_samples - done)
        for i in range(b):
            row_rng = GumbelStream(seed * n_samples + done + i) if params.stable else rng
            engine.add_request(prompt, params, rng=row_rng)
        reqs = list(engine.active)
        engine.run()
        for r in reqs:
            counts[tuple(r.output[:n])] += 1
            if stats is not None:
                stats.merge(r.stats)
        done += b
        if on_batch is not None:
            on_batch(done)
    return dict(counts)


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi2_dof > stat): the regularised upper incomplete gamma function."""
    if dof <= 0:
        return 1.0 if stat <= 0 else 0.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square(counts: dict, expected: dict) -> tuple[float, int, float]:
    """Pearson chi-square of observed counts against exact probabilities.

    Cells with expected count < 5 are pooled into one cell (the usual validity rule). Samples
    not listed in `expected` are counted in its REST cell when it has one; otherwise (or when a
    listed cell has probability 0) the statistic is infinite. Returns (stat, dof, p-value)."""
    N = sum(counts.values())
    counts = dict(counts)
    unknown = [k for k in counts if k not in expected]
    if unknown and REST in expected:
        counts[REST] = counts.get(REST, 0) + sum(counts.pop(k) for k in unknown)
        unknown = []
    if unknown or any(expected[k] <= 0 for k in counts):
        return float("inf"), 0, 0.0
    cells, pool_o, pool_e = [], 0.0, 0.0
    for key, pk in expected.items():
        e = N * pk
        o = counts.get(key, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
        else:
            cells.append((o, e))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return stat, dof, chi2_sf(stat, dof)


def noncentrality(n_samples: int, alt: dict, null: dict) -> float:
    """lambda = N * sum (alt - null)^2 / null: the expected excess of the chi-square statistic
    when samples really come from `alt`; power is P(chi2_dof(lambda) > critical value)."""
    keys = set(alt) | set(null)
    if any(null.get(k, 0.0) <= 0 and alt.get(k, 0.0) > 0 for k in keys):
        return float("inf")
    return n_samples * sum((alt.get(k, 0.0) - null[k]) ** 2 / null[k] for k in null)


def chi2_isf(alpha: float, dof: int) -> float:
    """The critical value c with P(chi2_dof > c) = alpha (bisection)."""
    lo, hi = 0.0, max(1.0, dof)
    while chi2_sf(hi, dof) > alpha:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, dof) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, dof: int, lam: float) -> float:
    """P(noncentral chi2(dof, lam) > x): a Poisson(lam / 2) mixture of central chi-squares."""
    half = lam / 2
    j_hi = int(half + 12 * math.sqrt(half) + 20)
    total = 0.0
    for j in range(j_hi + 1):
        w = math.exp(-half + j * math.log(half) - math.lgamma(j + 1)) if half > 0 else float(j == 0)
        total += w * chi2_sf(x, dof + 2 * j)
    return min(1.0, total)


def detectable_tv(n_samples: int, dof: int, alpha: float, power: float) -> float:
    """Smallest total-variation distance the test rejects at level alpha with probability >= power.

    For any alternative a at TV distance delta from the target p (on the test's cells),
    Cauchy-Schwarz gives sum (a - p)^2 / p >= (sum |a - p|)^2 = 4 delta^2, so the noncentrality is
    lambda >= 4 N delta^2; power grows with lambda. So delta = sqrt(lambda* / 4N), lambda* the
    noncentrality at which P(chi2_dof(lambda) > critical value) = power (asymptotic, as the
    chi-square test itself)."""
    if dof <= 0:
        return 1.0
    crit = chi2_isf(alpha, dof)
    lo, hi = 0.0, 1.0
    while ncx2_sf(crit, dof, hi) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(crit, dof, mid) < power else (lo, mid)
    return min(1.0, math.sqrt(hi / (4 * n_samples)))
