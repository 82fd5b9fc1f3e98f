"""Tools for distribution tests: exact enumeration of the engine's randomness, the target's
exact joint, sampling from the real engine loop, and a chi-square test.

`EnumRng` replaces the engine's randomness source. Instead of drawing, it explores: every call
to `bernoulli` or `categorical` is a choice point, and `enumerate_outcomes` replays a run once per
path of choices (depth-first), weighting the path by the product of the chosen probabilities.
The code under test (proposer, verifier, commit) is the engine's own; only the dice change, so
the result is the exact distribution that code produces, with no sampling noise.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from specdec import sampling
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer

PRUNE = 1e-12  # branches this unlikely change probabilities by < 1e-9 in total: skip them


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


def make_engine(target, draft, k, draft_sampling="probabilistic", max_batch=1, max_seq_len=64):
    V = target.args.vocab_size
    proposer = None if draft is None else DraftModelProposer(draft, V, max_seq_len, draft_sampling)
    return Engine(target, None, proposer, num_draft_tokens=k, max_batch=max_batch,
                  max_seq_len=max_seq_len, vocab_size=V)


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
                    if req in engine.active:
                        engine.active.remove(req)
                        engine._release(req)
            for out, pw in enumerate_outcomes(run).items():
                if len(out) >= n:
                    joint[out[:n]] += w * pw
                else:
                    nxt[out] += w * pw
        frontier = nxt
    return dict(joint)


@torch.inference_mode()
def target_joint_exact(target, prompt: list[int], params: SamplingParams, n: int = 3) -> dict:
    """prod_i p(x_i | prompt, x_<i) with the same transforms, by plain full forwards."""
    V = target.args.vocab_size
    joint: dict = {}

    def probs_after(prefix):
        seq = prompt + list(prefix)
        cache = target.new_cache(1, 64)
        logits = target.forward(torch.tensor([seq]), torch.arange(len(seq)).view(1, -1), cache)[0, -1:]
        counts = seen = None
        if params.has_penalties:
            counts = torch.zeros(1, V)
            seen = torch.zeros(1, V, dtype=torch.bool)
            seen[0, torch.tensor(prompt)] = True
            for t in prefix:
                counts[0, t] += 1
                seen[0, t] = True
        return sampling.probabilities(logits, params, counts, seen)[0].double()

    def walk(prefix, w):
        if len(prefix) == n:
            joint[prefix] = w
            return
        for x, px in enumerate(probs_after(prefix).tolist()):
            if px > 0:
                walk(prefix + (x,), w * px)

    walk((), 1.0)
    return joint


def sample_engine(engine: Engine, prompt, params, n_samples: int, batch: int, seed: int, n: int = 3):
    """Counts of the first n tokens from the real engine loop (batched rows, one shared rng)."""
    from specdec.rejection import TorchRng

    counts: dict = defaultdict(int)
    rng = TorchRng(seed)
    engine.reserve(batch)
    done = 0
    while done < n_samples:
        b = min(batch, n_samples - done)
        for _ in range(b):
            engine.add_request(prompt, params, rng=rng)
        reqs = list(engine.active)
        engine.run()
        for r in reqs:
            counts[tuple(r.output[:n])] += 1
        done += b
    return dict(counts)


def chi_square(counts: dict, expected: dict) -> tuple[float, int, float]:
    """Pearson chi-square of observed counts against exact probabilities.

    Cells with expected count < 5 are pooled into one cell (the usual validity rule); a sample
    outside the support of `expected` makes the statistic infinite. Returns (stat, dof, p-value)
    with the p-value from the chi-square survival function (regularised upper gamma)."""
    N = sum(counts.values())
    if any(k not in expected or expected[k] <= 0 for k in counts):
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
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p


def noncentrality(n_samples: int, alt: dict, null: dict) -> float:
    """lambda = N * sum (alt - null)^2 / null: the expected excess of the chi-square statistic
    when samples really come from `alt`; power is P(chi2_dof(lambda) > critical value)."""
    keys = set(alt) | set(null)
    if any(null.get(k, 0.0) <= 0 and alt.get(k, 0.0) > 0 for k in keys):
        return float("inf")
    return n_samples * sum((alt.get(k, 0.0) - null[k]) ** 2 / null[k] for k in null)
