"""Logits -> sampling distributions: grammar mask, penalties, temperature, top-k, top-p, min-p.

Pure functions on tensors. The same chain turns target logits into p and draft logits into q, at
every position, so that speculative verification compares the distributions that sampling
actually uses (docs/pitfalls.md 1). Order: grammar mask -> penalties -> temperature -> top-k ->
top-p -> min-p.

Penalties see each position's own prefix: `counts` [N, V] holds, for the row being scored, how
often each token occurs in the generated output before that position (drafts included), and
`seen` [N, V] whether it occurs anywhere in prompt + output before it.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None,
                    seen: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The history-dependent transforms: a grammar's mask (disallowed tokens -> -inf), then the
    penalties. logits [N, V]; counts [N, V] float (output tokens); seen [N, V] bool (prompt +
    output); mask [N, V] bool (allowed tokens) or None."""
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and seen is not None:
        r = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    if counts is not None:
        if params.frequency_penalty:
            logits -= params.frequency_penalty * counts
        if params.presence_penalty:
            logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on logits [N, V] (temperature > 0); removed -> -inf."""
    assert params.temperature > 0
    logits = logits / params.temperature
    V = logits.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(~top_p_keep(logits, params.top_p), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


TOP_P_CANDIDATES = 256


def top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] bool: the tokens top-p keeps from logits [N, V]: token i is kept iff the probability
    mass of the tokens with strictly higher logits is below top_p (the smallest set of best tokens
    reaching top_p; tied tokens are kept or removed together, so the set never depends on an
    order among equals). Found among the 256 best tokens (torch.topk, ~0.5 ms for V = 151,936
    where a full sort took ~14 ms), then 4,096, then all while a row's candidates stay below top_p; the
    threshold is the lowest kept logit. `top_p_keep_reference` is the per-token definition."""
    N, V = logits.shape
    probs = logits.softmax(-1)
    for K in (min(TOP_P_CANDIDATES, V), min(16 * TOP_P_CANDIDATES, V), V):
        vals, idx = logits.topk(K, dim=-1)  # [N, K], descending
        pk = probs.gather(-1, idx).double()
        before = pk.cumsum(-1) - pk  # mass ahead of each candidate in topk's order
        first = torch.searchsorted(-vals, -vals)  # the first candidate of each one's value
        kept = before.gather(-1, first) < top_p  # mass strictly above the value < top_p
        if K == V or not kept[:, -1].any():
            break
    # (the best token is always kept; a row of -inf logits, all masked, keeps them all as it was)
    lowest = vals.gather(-1, kept.sum(-1, keepdim=True).clamp(min=1) - 1)
    return logits >= lowest


def top_p_keep_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_keep` token by token, from its definition (a loop: for tests)."""
    probs = logits.softmax(-1).double()
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    for n in range(logits.shape[0]):
        for i in range(logits.shape[1]):
            keep[n, i] = float(probs[n][logits[n] > logits[n, i]].sum()) < top_p
    return keep


def probabilities(logits: torch.Tensor, params: SamplingParams, counts=None, seen=None,
                  mask=None) -> torch.Tensor:
    """The sampling distribution [N, V] (float64-normalised fp32 softmax) for temperature > 0."""
    logits = filter_logits(apply_penalties(logits.float(), params, counts, seen, mask), params)
    return logits.softmax(-1)


def stable_tokens(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor, counts=None,
                  seen=None, mask=None) -> torch.Tensor:
    """Seed-stable sampling: argmax [N] of the transformed logits [N, V] plus Gumbel noise [N, V]
    (Gumbel-max: a sample of `probabilities(logits, ...)`, decided by the noise alone)."""
    return (filter_logits(apply_penalties(logits.float(), params, counts, seen, mask), params) + noise).argmax(-1)


def greedy_tokens(logits: torch.Tensor, params: SamplingParams, counts=None, seen=None,
                  mask=None) -> torch.Tensor:
    """argmax [N] of the masked, penalised logits [N, V] (temperature == 0)."""
    return apply_penalties(logits.float(), params, counts, seen, mask).argmax(-1)


def logprobs(logits: torch.Tensor, params: SamplingParams, counts=None, seen=None, mask=None) -> torch.Tensor:
    """log-probabilities [N, V] after the request's transforms: log_softmax of the penalised
    logits for greedy requests, of the filtered (temperature, top-k/p, min-p) logits otherwise,
    so removed tokens get -inf. What the API reports for each emitted token."""
    lg = apply_penalties(logits.float(), params, counts, seen, mask)
    if not params.greedy:
        lg = filter_logits(lg, params)
    return lg.log_softmax(-1)


def prefix_counts(base_counts: torch.Tensor, base_seen: torch.Tensor, tokens: torch.Tensor):
    """Penalty state at each of T+1 positions when `tokens` [T] are appended one by one.

    base_counts [V] float, base_seen [V] bool -> counts [T + 1, V], seen [T + 1, V]: position i
    sees tokens[:i] on top of the base state (docs/pitfalls.md 7: per accepted token, drafts included).
    """
    T = tokens.shape[0]
    V = base_counts.shape[0]
    onehot = torch.zeros(T + 1, V, dtype=base_counts.dtype, device=base_counts.device)
    if T:
        onehot[1:].scatter_(1, tokens.view(T, 1), 1.0)
    counts = base_counts.unsqueeze(0) + onehot.cumsum(0)
    seen = base_seen.unsqueeze(0) | (counts > base_counts.unsqueeze(0))
    return counts, seen
