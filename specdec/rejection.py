"""Verification of draft tokens: greedy and stochastic (modified rejection sampling).

Vocabulary, used everywhere in specdec:
  - draft tokens d_1..d_k: what the proposer proposed; q_i is the draft distribution d_i was
    sampled from (None = one-hot: token-only proposers or a greedily sampled draft).
  - target distributions p_1..p_{k+1}: p_i is conditioned on the history plus d_1..d_{i-1};
    all k + 1 come from one target forward.
  - accepted: d_i passed verification and every d_j before it did too.
  - recovered: the token emitted at the first rejected position i, sampled from
    normalise([p_i - q_i]+) (greedy: the argmax of p_i).
  - bonus: the token sampled from p_{k+1} when all k drafts were accepted.
A round emits its accepted tokens plus exactly one recovered or bonus token.

Outputs are [B, k + 1] token ids padded with PLACEHOLDER, plus the count emitted per row. Rows
may have ragged draft lengths (`num_draft` [B]); row b's bonus comes from p[b, num_draft[b]].

Randomness comes from an `Rng` with two methods, `bernoulli(probs) -> bool` and
`categorical(probs [N, V]) -> [N]`, so tests can replace it (a seeded generator, or one that
enumerates every branch with its probability for exact distribution tests).

Seed-stable sampling (SamplingParams.stable) draws no dice in verification at all: each output
position t of a request has its own Gumbel noise g_t [V] from a `GumbelStream` (a generator seeded
by (seed, t) alone), the token at t is argmax(z_t + g_t) for the transformed logits z_t (the
Gumbel-max trick: exactly a sample of softmax(z_t)), and a draft is accepted iff it equals that
argmax. The emitted token at t is therefore the same whether t was drafted or not, by whom, at
which k and in which batch: speculation changes the speed, never the text. A draft model draws its
own token at t from argmax(log q_t + g_t), the same noise, so that it agrees with the target as
often as the coupling allows (docs/lossless.md).
"""

from __future__ import annotations

import secrets

import torch

PLACEHOLDER = -1


class TorchRng:
    """Seeded randomness for verification and sampling."""

    def __init__(self, seed: int | None = None, device="cpu"):
        self.gen = torch.Generator(device=device)
        if seed is None:
            self.gen.seed()
        else:
            self.gen.manual_seed(seed)

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.rand(probs.shape, generator=self.gen, device=probs.device, dtype=torch.float64) < probs

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        u = torch.rand(probs.shape[0], generator=self.gen, device=probs.device, dtype=torch.float64)
        return inverse_cdf(probs, u)


CDF_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF sample [N] of each row of probs [N, V] (non-negative, positive total, not
    necessarily normalised) at u [N] (float64 in [0, 1)): the first token whose cumulative mass
    exceeds u x the row's total. Two levels, so that float64 sums run over 256-token blocks only:
    the block from the blocks' cumulative masses, then the token inside it. A zero-probability
    token is never returned, whatever the rounding. It equals `inverse_cdf_reference` (one float64
    cumsum over V) except where the two summation orders round a boundary differently (a ~1e-16
    event per draw), and costs ~0.15 ms for V = 151,936, where torch.multinomial took ~3 ms."""
    N, V = probs.shape
    x = probs.float()
    if V % CDF_BLOCK:
        x = torch.nn.functional.pad(x, (0, CDF_BLOCK - V % CDF_BLOCK))
    xb = x.view(N, -1, CDF_BLOCK)  # [N, nb, B]
    mass = xb.sum(-1, dtype=torch.float64)  # [N, nb]
    cum = mass.cumsum(-1)
    target = (u.double() * cum[:, -1]).unsqueeze(1)  # [N, 1]
    j = torch.searchsorted(cum, target, right=True)  # cum[j - 1] <= target < cum[j]
    last_block = (mass.shape[1] - 1) - (mass > 0).flip(-1).int().argmax(-1, keepdim=True)
    j = torch.minimum(j, last_block)  # (target rounded up to the total: the last block with mass)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    block = xb[torch.arange(N, device=x.device), j[:, 0]]  # [N, B]
    i = torch.searchsorted(block.double().cumsum(-1), target - before, right=True)
    last = (CDF_BLOCK - 1) - (block > 0).flip(-1).int().argmax(-1, keepdim=True)
    return (j * CDF_BLOCK + torch.minimum(i, last)).squeeze(1)


def inverse_cdf_reference(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` in one float64 cumulative sum over the whole row (slow for large V)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


MASK64 = (1 << 64) - 1


def position_seed(seed: int, t: int) -> int:
    """A 64-bit generator seed for output position t of a stream seeded `seed` (splitmix64 of the
    pair: nearby seeds and positions give unrelated streams)."""
    z = (seed + 0x9E3779B97F4A7C15 * (t + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class GumbelStream:
    """One request's seed-stable randomness: Gumbel noise g_t [V] per output position t, a pure
    function of (seed, t), so what is drawn at t never depends on what was drawn before it, on
    k, on the proposer or on other rows. Positions are cached until `forget_before` (a round's
    draft and verify read the same positions, and positions past a rejection come back next round)."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(63) if seed is None else seed
        self._gen = torch.Generator()
        self._cache: dict[int, torch.Tensor] = {}

    def gumbel(self, t: int, V: int) -> torch.Tensor:
        """g_t [V] float32: -log(-log(u)), u uniform in [0, 1) (u = 0 gives -inf: never chosen,
        a 2^-24 event per token, below the resolution of the fp32 probabilities themselves)."""
        g = self._cache.get(t)
        if g is None or g.shape[0] != V:
            self._gen.manual_seed(position_seed(self.seed, t))
            g = torch.rand(V, generator=self._gen).log_().neg_().log_().neg_()
            self._cache[t] = g
        return g

    def forget_before(self, t: int) -> None:
        for old in [p for p in self._cache if p < t]:
            del self._cache[old]


def stable_noise(reqs, idx: list[int], width: int, V: int, device, start: int = 0) -> torch.Tensor:
    """[len(idx) * width, V] noise of rows idx at output positions len(output) + start + i,
    i < width, in row order (each row's own GumbelStream)."""
    rows = []
    for b in idx:
        r = reqs[b]
        n = len(r.output)
        r.rng.forget_before(n)  # committed positions are never drawn again
        rows += [r.rng.gumbel(n + start + i, V) for i in range(width)]
    return torch.stack(rows).to(device)


def residual_distribution(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """normalise([p - q]+) over the last dim; p [N, V], q [N, V] or None (one-hot on draft [N]).

    If the residual has zero mass (p == q up to rounding, so rejection had probability ~0), fall
    back to p: any distribution is correct there, and p keeps the sampler well defined.
    """
    if q is None:
        r = p.clone()
        r.scatter_(-1, draft.unsqueeze(-1), 0.0)
    else:
        r = (p - q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def acceptance_probs(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)); p [B, k, V], q [B, k, V] or None, draft [B, k] -> [B, k] float64."""
    p_d = p.gather(-1, draft.unsqueeze(-1)).squeeze(-1).double()
    if q is None:
        return p_d.clamp(max=1.0)
    q_d = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1).double()
    # q_d > 0 always: d was sampled from q. Guard anyway so a bad q cannot make NaN.
    return torch.where(q_d > 0, (p_d / q_d.clamp_min(1e-300)).clamp(max=1.0), torch.zeros_like(p_d))


def _emit(draft: torch.Tensor, n_accepted: torch.Tensor, last: torch.Tensor):
    """Build out [B, k + 1]: accepted drafts, then `last` at index n_accepted, then PLACEHOLDER."""
    B, k = draft.shape
    idx = torch.arange(k + 1, device=draft.device).unsqueeze(0)
    out = torch.full((B, k + 1), PLACEHOLDER, dtype=torch.long, device=draft.device)
    out[:, :k] = torch.where(idx[:, :k] < n_accepted.unsqueeze(1), draft, PLACEHOLDER)
    out.scatter_(1, n_accepted.unsqueeze(1), last.unsqueeze(1))
    return out, n_accepted + 1


def _first_false(ok: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """Number of leading True values of ok [B, k], counting only the first num_draft[b]."""
    k = ok.shape[1]
    valid = torch.arange(k, device=ok.device).unsqueeze(0) < num_draft.unsqueeze(1)
    run = (ok & valid).long().cumprod(1)
    return run.sum(1)


def greedy_verify(target_argmax: torch.Tensor, draft: torch.Tensor, num_draft: torch.Tensor):
    """target_argmax [B, k + 1], draft [B, k], num_draft [B] -> (out [B, k + 1], num_emitted [B])."""
    n_acc = _first_false(target_argmax[:, :-1] == draft, num_draft)
    last = target_argmax.gather(1, n_acc.unsqueeze(1)).squeeze(1)  # recovered or bonus
    return _emit(draft, n_acc, last)


def stochastic_verify(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor,
                      num_draft: torch.Tensor, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, k + 1, V], q [B, k, V] or None (one-hot), draft [B, k], num_draft [B].

    Returns (out [B, k + 1], num_emitted [B]).
    """
    B, k = draft.shape
    if k == 0:
        return _emit(draft, torch.zeros(B, dtype=torch.long, device=p.device), rng.categorical(p[:, 0]))
    accepted = rng.bernoulli(acceptance_probs(p[:, :k], q, draft))  # [B, k]
    n_acc = _first_false(accepted, num_draft)  # [B]
    rows = torch.arange(B, device=p.device)
    p_at = p[rows, n_acc]  # [B, V]: p at the first rejected position, or p_{k+1} for the bonus
    rejected = n_acc < num_draft  # [B]
    at = n_acc.clamp(max=k - 1)
    d_at = draft[rows, at]
    q_at = None if q is None else q[rows, at]
    final = torch.where(rejected.unsqueeze(1), residual_distribution(p_at, q_at, d_at), p_at)
    return _emit(draft, n_acc, rng.categorical(final))


def stochastic_verify_reference(p, q, draft, num_draft, rng):
    """Loop-based reference of `stochastic_verify`; draws the same randomness in the same shapes."""
    B, k = draft.shape
    if k == 0:
        return stochastic_verify(p, q, draft, num_draft, rng)
    acc_prob = torch.zeros(B, k, dtype=torch.float64)
    for b in range(B):
        for i in range(k):
            d = int(draft[b, i])
            pd = float(p[b, i, d])
            qd = 1.0 if q is None else float(q[b, i, d])
            acc_prob[b, i] = min(1.0, pd / qd) if qd > 0 else 0.0
    accepted = rng.bernoulli(acc_prob)
    final = torch.zeros(B, p.shape[-1], dtype=p.dtype)
    n_acc_list = []
    for b in range(B):
        n = 0
        while n < int(num_draft[b]) and bool(accepted[b, n]):
            n += 1
        n_acc_list.append(n)
        if n < int(num_draft[b]):  # rejected at n: residual
            d = int(draft[b, n])
            res = [max(float(p[b, n, x]) - (float(x == d) if q is None else float(q[b, n, x])), 0.0)
                   for x in range(p.shape[-1])]
            mass = sum(res)
            final[b] = torch.tensor([r / mass for r in res]) if mass > 0 else p[b, n]
        else:
            final[b] = p[b, n]
    last = rng.categorical(final)
    return _emit(draft, torch.tensor(n_acc_list), last)


def greedy_verify_reference(target_argmax, draft, num_draft):
    B, k = draft.shape
    out = torch.full((B, k + 1), PLACEHOLDER, dtype=torch.long)
    n_out = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        i = 0
        while i < int(num_draft[b]) and int(draft[b, i]) == int(target_argmax[b, i]):
            out[b, i] = draft[b, i]
            i += 1
        out[b, i] = target_argmax[b, i]
        n_out[b] = i + 1
    return out, n_out


def stable_verify_reference(z, noise, draft, num_draft):
    """Loop reference of seed-stable verification: z [B, k + 1, V] transformed logits, noise
    [B, k + 1, V]; the target's token at each position is the first index of max(z + noise), and
    drafts are kept while they equal it. Returns (out [B, k + 1], num_emitted [B])."""
    B, k = draft.shape
    out = torch.full((B, k + 1), PLACEHOLDER, dtype=torch.long)
    n_out = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        for i in range(k + 1):
            scores = [float(z[b, i, x]) + float(noise[b, i, x]) for x in range(z.shape[-1])]
            best = max(range(len(scores)), key=lambda x: (scores[x], -x))
            out[b, i] = best
            n_out[b] = i + 1
            if i == int(num_draft[b]) or int(draft[b, i]) != best:
                break
    return out, n_out
