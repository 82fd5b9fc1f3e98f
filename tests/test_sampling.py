"""Top-p: the candidate path (torch.topk over the best tokens) against its per-token definition,
against the full sort it replaced on tie-free rows, and tied tokens kept or removed together."""

from __future__ import annotations

import pytest
import torch

from specdec import sampling
from specdec.config import SamplingParams


def _rows(seed: int, N: int, V: int) -> torch.Tensor:
    """Logits with ties (rounded to a coarse grid), some -inf (a top-k or grammar mask)."""
    g = torch.Generator().manual_seed(seed)
    lg = (torch.randn(N, V, generator=g) * 2.5 * 4).round() / 4
    lg[torch.rand(N, V, generator=g) < 0.1] = float("-inf")
    lg[:, 0] = 3.0  # (every row has a finite logit)
    return lg


def _sorted_prefix(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The full-sort top-p this replaced (the smallest prefix of the sorted tokens reaching top_p),
    its cumulative mass summed in float64 as top_p_keep's is (the old float32 sum over thousands
    of tokens could move the boundary by one token)."""
    order = torch.sort(logits, dim=-1, descending=True).indices
    sp = logits.softmax(-1).gather(-1, order).double()
    remove = (sp.cumsum(-1) - sp) >= top_p
    remove[..., 0] = False
    return ~torch.zeros_like(remove).scatter(-1, order, remove)


@pytest.mark.parametrize("candidates", [256, 3])  # 3: rows fall through to 48 candidates, then all
def test_top_p_keep_equals_its_definition(monkeypatch, candidates):
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    for seed, (N, V) in enumerate([(4, 1), (4, 7), (6, 60), (3, 300), (2, 1000)]):
        lg = _rows(seed, N, V)
        for top_p in (0.01, 0.3, 0.9, 0.999):
            got = sampling.top_p_keep(lg, top_p)
            assert torch.equal(got, sampling.top_p_keep_reference(lg, top_p)), (N, V, top_p)


def test_top_p_keep_equals_the_full_sort_without_ties():
    g = torch.Generator().manual_seed(7)
    for V in (10, 20_000):
        u = (torch.stack([torch.randperm(V, generator=g) for _ in range(3)]).double() + 0.5) / V
        lg = (torch.special.ndtri(u) * torch.tensor([[1.0], [4.0], [12.0]], dtype=torch.float64)).float()  # flat to peaked
        assert all(row.unique().numel() == V for row in lg)
        for top_p in (0.1, 0.5, 0.95):
            assert torch.equal(sampling.top_p_keep(lg, top_p), _sorted_prefix(lg, top_p)), (V, top_p)


def test_top_p_keeps_tied_tokens_together():
    lg = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    p0 = float(lg.softmax(-1)[0, 0])
    assert sampling.top_p_keep(lg, p0 * 0.99).tolist() == [[True, False, False, False, False]]
    assert sampling.top_p_keep(lg, p0 * 1.01).tolist() == [[True, True, True, True, False]]  # not one of the 1s
    probs = sampling.probabilities(lg, SamplingParams(temperature=1.0, top_p=p0 * 1.01))
    assert probs[0, 1] == probs[0, 2] == probs[0, 3] > 0 and probs[0, 4] == 0


def test_top_p_on_a_row_with_every_token_masked_leaves_it_as_it_was():
    """A reduced draft vocabulary or a grammar can mask every token of a row: top-p must not fail
    there (the caller sees a NaN softmax and drafts nothing)."""
    lg = torch.full((2, 300), float("-inf"))
    lg[1, 7] = 1.0
    keep = sampling.top_p_keep(lg, 0.9)
    assert keep[0].all() and keep[1].tolist() == [i == 7 for i in range(300)]


def test_probabilities_of_stacked_rows_are_each_rows_own_bits(monkeypatch):
    """Rows sampled in one call (a group's rows, a verify's positions) get the bits a call on
    their own gives, also where another row of the call sends top-p to its wider candidate
    stages (a batch-wide decision): a row's p never depends on what it is batched with."""
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 4)
    g = torch.Generator().manual_seed(2)
    lg = torch.randn(6, 3000, generator=g) * torch.tensor([[8.0], [0.3], [3.0], [1.0], [12.0], [0.1]])
    for params in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=50, min_p=0.02),
                   SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1)):
        stacked = sampling.probabilities(lg, params)
        for i in range(6):
            assert torch.equal(stacked[i], sampling.probabilities(lg[i: i + 1], params)[0]), (params, i)

