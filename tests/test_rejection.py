"""Rejection sampler: literal cases with constructed distributions, and fast == reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.rejection import (PLACEHOLDER, TorchRng, greedy_verify, greedy_verify_reference,
                               residual_distribution, stochastic_verify, stochastic_verify_reference)

P = PLACEHOLDER


def onehot_rows(ids, V=6):
    """p rows that put all mass on one token each: verification outcomes become certain."""
    t = torch.zeros(len(ids), V)
    t[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    return t


def test_greedy_all_accepted_gives_bonus():
    # target argmax at positions 1..4 = 3, 1, 4, then bonus 5; draft [3, 1, 4] all match
    out, n = greedy_verify(torch.tensor([[3, 1, 4, 5]]), torch.tensor([[3, 1, 4]]), torch.tensor([3]))
    assert out.tolist() == [[3, 1, 4, 5]] and n.tolist() == [4]


def test_greedy_first_rejected():
    # draft 2 != argmax 3 at position 1: emit the recovered argmax 3 and nothing after
    out, n = greedy_verify(torch.tensor([[3, 1, 4, 5]]), torch.tensor([[2, 1, 4]]), torch.tensor([3]))
    assert out.tolist() == [[3, P, P, P]] and n.tolist() == [1]


def test_greedy_middle_rejected():
    # d1 accepted, d2 = 0 != 1 rejected; the later match d3 == 4 must NOT be accepted
    out, n = greedy_verify(torch.tensor([[3, 1, 4, 5]]), torch.tensor([[3, 0, 4]]), torch.tensor([3]))
    assert out.tolist() == [[3, 1, P, P]] and n.tolist() == [2]


def test_greedy_empty_draft_is_plain_decoding():
    out, n = greedy_verify(torch.tensor([[3]]), torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert out.tolist() == [[3]] and n.tolist() == [1]


def test_greedy_ragged_batch():
    # row 0: 3 drafts, all accepted -> bonus 5; row 1: 1 real draft (then padding) accepted -> bonus
    # from position 2 (= 7); row 2: 0 drafts -> plain token 2
    am = torch.tensor([[3, 1, 4, 5], [6, 7, 8, 9], [2, 2, 2, 2]])
    drafts = torch.tensor([[3, 1, 4], [6, 7, 8], [2, 2, 2]])
    out, n = greedy_verify(am, drafts, torch.tensor([3, 1, 0]))
    assert out.tolist() == [[3, 1, 4, 5], [6, 7, P, P], [2, P, P, P]]
    assert n.tolist() == [4, 2, 1]


def test_stochastic_certain_cases():
    """With one-hot p, acceptance is certain (p(d) = 1) or impossible (p(d) = 0)."""
    rng = TorchRng(0)
    p = onehot_rows([3, 1, 4, 5]).unsqueeze(0)  # [1, 4, V]
    out, n = stochastic_verify(p, None, torch.tensor([[3, 1, 4]]), torch.tensor([3]), rng)
    assert out.tolist() == [[3, 1, 4, 5]] and n.tolist() == [4]  # all accepted + bonus 5
    out, n = stochastic_verify(p, None, torch.tensor([[3, 0, 4]]), torch.tensor([3]), rng)
    assert out.tolist() == [[3, 1, P, P]] and n.tolist() == [2]  # rejected at 2, recovered 1
    out, n = stochastic_verify(p, None, torch.tensor([[2, 1, 4]]), torch.tensor([3]), rng)
    assert out.tolist() == [[3, P, P, P]] and n.tolist() == [1]  # first rejected
    out, n = stochastic_verify(p[:, :1], None, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), rng)
    assert out.tolist() == [[3]] and n.tolist() == [1]  # empty draft: a sample from p_1


def test_residual_distribution():
    p = torch.tensor([[0.6, 0.3, 0.1]])
    q = torch.tensor([[0.2, 0.5, 0.3]])
    # the seeds' worked example: all the rejected mass goes to token 0
    assert torch.allclose(residual_distribution(p, q, torch.tensor([1])), torch.tensor([[1.0, 0.0, 0.0]]))
    # one-hot q on token 1: p without token 1, renormalised
    assert torch.allclose(residual_distribution(p, None, torch.tensor([1])), torch.tensor([[0.6, 0.0, 0.1]]) / 0.7)
    # zero residual mass (p == q): falls back to p rather than dividing by zero
    assert torch.allclose(residual_distribution(p, p, torch.tensor([0])), p)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 4), k=st.integers(1, 5), V=st.integers(2, 7), seed=st.integers(0, 10**6),
       onehot=st.booleans(), peaked=st.booleans())
def test_fast_equals_reference(B, k, V, seed, onehot, peaked):
    """The vectorised verifier equals the loop-based reference draw for draw (same seed, same
    randomness requested in the same shapes), over random p/q, ragged draft lengths, one-hot q."""
    g = torch.Generator().manual_seed(seed)
    scale = 4.0 if peaked else 1.0
    p = (torch.randn(B, k + 1, V, generator=g) * scale).softmax(-1)
    q = None if onehot else (torch.randn(B, k, V, generator=g) * scale).softmax(-1)
    drafts = torch.randint(0, V, (B, k), generator=g)
    num_draft = torch.randint(0, k + 1, (B,), generator=g)
    a = stochastic_verify(p, q, drafts, num_draft, TorchRng(seed))
    b = stochastic_verify_reference(p, q, drafts, num_draft, TorchRng(seed))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    am = p.argmax(-1)
    drafts_g = torch.where(torch.rand(B, k, generator=g) < 0.7, am[:, :k], drafts)
    ga = greedy_verify(am, drafts_g, num_draft)
    gb = greedy_verify_reference(am, drafts_g, num_draft)
    assert torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1])


def _zero_runs(V: int, seed: int) -> torch.Tensor:
    """A peaked distribution over V tokens with zero runs: the first and last blocks empty where
    V allows (the first 300 tokens and everything from 2/3 of V on), scattered zeros elsewhere."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(V, generator=g).mul(2.5).exp()
    p[torch.rand(V, generator=g) < 0.2] = 0.0
    if V > 600:
        p[:300] = 0.0
        p[2 * V // 3:] = 0.0
    p[V // 2] += 1.0  # (some mass)
    return p / p.sum()


def test_inverse_cdf_equals_the_one_cumsum_reference():
    """The two-level sampler picks the reference's token for the same uniform: block sizes around
    the 256-token block (V = 1, 255, 256, 257, 513), a Qwen-sized row, zero runs and unnormalised
    rows; and it never picks a zero-probability token, at u = 0 and at the largest u < 1 too."""
    from specdec.rejection import inverse_cdf, inverse_cdf_reference
    g = torch.Generator().manual_seed(3)
    for V in (1, 2, 255, 256, 257, 513, 1000, 151_936):
        p = torch.stack([_zero_runs(V, s) * (1 + s) for s in range(8)])
        u = torch.rand(8, 400, generator=g, dtype=torch.float64)
        u[:, 0], u[:, 1] = 0.0, 1.0 - 2.0 ** -53
        for j in range(u.shape[1]):
            got = inverse_cdf(p, u[:, j])
            assert (p.gather(1, got[:, None]) > 0).all(), (V, j)
            if j > 1:
                assert torch.equal(got, inverse_cdf_reference(p, u[:, j])), (V, j)


def test_torch_rng_categorical_has_the_distribution_and_a_wrong_sampler_is_caught():
    """TorchRng.categorical over V = 700 (three blocks, the last partial), 200,000 draws: Pearson
    chi-square against the exact p passes at p > 1e-3. Control: the right block but a uniform
    token inside it (among its nonzero ones). Power: p has 87 cells with mass (each >= 40 expected
    draws), so 86 degrees of freedom and a 1e-6 critical value of 163; the control's exact
    distribution gives its noncentrality (~2e6), asserted >= 400 first (a noncentral chi2(86, 400)
    has mean 486 and sd ~ 43: rejected with probability > 1 - 1e-9); then the same test must reject
    its samples at p < 1e-6."""
    from specdec.rejection import CDF_BLOCK, inverse_cdf
    from specdec.tools.distribution import chi_square, noncentrality
    V, N, batch = 700, 200_000, 20_000
    p = _zero_runs(V, 5)
    p[p < 2e-4] = 0.0  # (cells the test can count)
    p = p / p.sum()
    exact = {i: float(p[i]) for i in range(V) if p[i] > 0}
    blocks = p.split(CDF_BLOCK)
    wrong = torch.cat([(b > 0).float() * b.sum() / max(int((b > 0).sum()), 1) for b in blocks])
    alt = {i: float(wrong[i]) for i in range(V) if wrong[i] > 0}
    assert noncentrality(N, alt, exact) >= 400

    def uniform_in_block(probs, rng):
        tok = inverse_cdf(probs, torch.rand(probs.shape[0], generator=rng.gen, dtype=torch.float64))
        start = tok // CDF_BLOCK * CDF_BLOCK
        out = torch.empty_like(tok)
        for s in start.unique().tolist():
            nz = (probs[0, s: s + CDF_BLOCK] > 0).nonzero()[:, 0] + s
            sel = start == s
            out[sel] = nz[torch.randint(len(nz), (int(sel.sum()),), generator=rng.gen)]
        return out

    for name, draw, passes in (("categorical", lambda probs, rng: rng.categorical(probs), True),
                               ("uniform in block", uniform_in_block, False)):
        rng, counts = TorchRng(11), torch.zeros(V, dtype=torch.long)
        for _ in range(N // batch):
            counts += torch.bincount(draw(p.expand(batch, V), rng), minlength=V)
        _, _, pval = chi_square({i: int(c) for i, c in enumerate(counts.tolist()) if c}, exact)
        assert (pval > 1e-3) if passes else (pval < 1e-6), (name, pval)
