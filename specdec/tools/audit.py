"""`specdec verify`: is the output still exactly the target's, with your models and settings?

The whole-engine statistical test on the user's own target, proposer and sampling settings: from
a fixed prefix, sample the first n emitted tokens N times through the engine's real loop (propose
-> verify -> commit -> roll back, batched rows, the engine's own randomness), and compare the
counts with the target's joint prod_i p(x_i | prefix, x_<i) by Pearson chi-square
(specdec.tools.distribution). It passes when p > alpha (default 1e-3), no sample has target
probability 0, and the proposer really drafted.

Speed: `MemoModel` stands in for the target and the draft. The real model's logits at a query
are a function of the tokens in its cache row at slots 0..position (specdec.runtime.model: a query
attends to every slot <= its position, whatever the lengths say). MemoModel keeps exactly that
state, one token per slot written at the positions the caller gives, and answers from a memo
keyed by those tokens; misses are computed by the real model, batched, on top of the prefix's
KV. So repeated prefixes cost nothing, while what is fed where, what is accepted, committed and
rolled back is still decided by the engine's own code: a bookkeeping bug changes the keys just
as it would change the real model's attention. The target's joint is computed from the same
memo, so the test compares the engine against the very function it sampled from.

Power: `detectable_tv` gives the smallest total-variation distance (on the test's cells) that the
test rejects with the stated power at this N; the printed verdict quotes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from specdec import rejection
from specdec.config import MAX_SEED, SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError, check_choice, check_float, check_int, check_text
from specdec.loader import Models, build_engine, drafts_with_head, head_for, with_models
from specdec.metrics import SpecStats
from specdec.runtime.kv_cache import KVCache
from specdec.tools import distribution as dist

# Default prefixes: each gives its proposer something to draft from (a run in which the
# proposer never drafts tests nothing). Repetitive text for n-gram lookup; code for a draft model.
DEFAULT_PREFIX = {
    "ngram": "one two three four, one two three four, one two three four, one two three",
    "draft": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}
CONTROLS = ("redraw-from-p",)
EXTRA_SLOTS = 64  # longest suffix past the prefix a memo miss may have


class SlotCache(KVCache):
    """A MemoModel's cache: lengths as usual; instead of keys/values, the token written at each
    slot (`slots` [B, S]), which is what a prefix copy copies."""

    def __init__(self, batch_size: int, max_seq_len: int, headroom: int):
        super().__init__(0, batch_size, 1, 1, max_seq_len, headroom=headroom)
        self.slots = torch.full((batch_size, self.capacity), -1, dtype=torch.long)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.slots[dst, :n] = self.slots[src, :n]
        self.lengths[dst] = n


class MemoModel:
    """Answers `forward` like `model` would, from a memo keyed by the tokens each query attends to."""

    def __init__(self, model, prefix: list[int], max_bytes: float = 4e9, batch: int = 32,
                 taps: tuple[int, ...] = ()):
        self.model, self.args, self.device = model, model.args, model.device
        self.taps = tuple(taps)  # a draft head's target layers: hidden is (len(taps) + 1) dim wide
        self.H = (len(self.taps) + 1) * model.args.dim
        # a draft head borrows the target's embedding and output rows (specdec.head.attach)
        self.embed, self.lm_head = getattr(model, "embed", None), getattr(model, "lm_head", None)
        self.prefix = tuple(prefix)
        L = len(prefix)
        self.batch = batch
        self.V = model.args.vocab_size
        self.scratch = model.new_cache(batch, L + EXTRA_SLOTS, headroom=1)
        with torch.inference_mode():  # memo entries: [V + H] logits and hidden states
            logits = self._run(torch.tensor([prefix], device=self.device),
                               torch.arange(L, device=self.device).view(1, -1), self.scratch)[0]
        self.scratch.k[:, 1:, :, :L] = self.scratch.k[:, :1, :, :L]  # every row starts from the prefix
        self.scratch.v[:, 1:, :, :L] = self.scratch.v[:, :1, :, :L]
        self.fixed = {self.prefix[:i + 1]: logits[i].clone() for i in range(L)}  # never evicted
        self.memo: dict[tuple, torch.Tensor] = {}
        self.max_entries = max(256, int(max_bytes // (4 * logits.shape[-1])))
        self.hits = self.misses = 0

    def _run(self, tokens, positions, cache) -> torch.Tensor:
        """The real model's logits and hidden states, concatenated: [B, T, V + H]."""
        extra = {"taps": self.taps} if self.taps else {}
        logits, hidden = self.model.forward(tokens, positions, cache, return_hidden=True, **extra)
        return torch.cat([logits, hidden], -1)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, headroom: int = 33) -> KVCache:
        return SlotCache(batch_size, max_seq_len or self.args.max_seq_len, headroom)

    def forward(self, tokens, positions, cache, mask=None, return_hidden=False, rows=None,
                logits_at=None, taps: tuple[int, ...] = ()):
        """tokens, positions [B, T] -> logits [B, T or n, V] (and hidden states, when asked), as
        model.forward (causal, no mask; logits_at [B, n]: those positions only, none for n = 0)."""
        assert mask is None and tuple(taps) in ((), self.taps)
        if not return_hidden:
            return self._forward(tokens, positions, cache, rows, logits_at)[..., : self.V]
        out = self._forward(tokens, positions, cache, rows, None)  # [B, T, V + dim]: every position
        logits = out[..., : self.V]
        if logits_at is not None:
            logits = logits.gather(1, logits_at.unsqueeze(2).expand(-1, -1, self.V))
        return logits, out[..., self.V:]

    def _forward(self, tokens, positions, cache, rows, logits_at):
        B, T = tokens.shape
        rows = torch.arange(B) if rows is None else rows.cpu()
        pos = positions.cpu()
        cache.slots[rows.view(B, 1).expand(B, T), pos] = tokens.cpu()
        if logits_at is not None:
            pos = pos.gather(1, logits_at.cpu())
            if pos.shape[1] == 0:  # a prefill: the slots are written, nothing to look up
                return torch.empty(B, 0, self.V + self.H, device=self.device)
        n = pos.shape[1]
        hist = cache.slots[rows].tolist()
        keys = [tuple(hist[b][:p + 1]) for b, prow in enumerate(pos.tolist()) for p in prow]
        if all(keys[b * n:(b + 1) * n] == keys[:n] for b in range(1, B)):  # e.g. the prompt's prefill
            return self.logits(keys[:n]).unsqueeze(0).expand(B, n, -1).to(self.device)
        return self.logits(keys).view(B, n, -1).to(self.device)

    __call__ = forward

    def next_logits(self, seqs: list[list[int]]) -> torch.Tensor:
        """logits_fn for specdec.tools.distribution: [len(seqs), V] next-token logits."""
        return self.logits([tuple(s) for s in seqs])[:, : self.V]

    def logits(self, keys: list[tuple]) -> torch.Tensor:
        out: list = [None] * len(keys)
        missing: dict[tuple, list[int]] = {}
        for i, k in enumerate(keys):  # take hits first: computing misses may evict entries
            t = self.fixed.get(k)
            if t is None:
                t = self.memo.get(k)
            if t is None:
                missing.setdefault(k, []).append(i)
            else:
                out[i] = t
        self.misses += len(missing)
        self.hits += len(keys) - sum(len(v) for v in missing.values())
        for k, t in self._compute(list(missing)).items():
            for i in missing[k]:
                out[i] = t
        return torch.stack(out)

    @torch.inference_mode()
    def _compute(self, keys: list[tuple]) -> dict:
        L, V = len(self.prefix), self.V + self.H
        got = {}
        ext = []
        for k in keys:
            if -1 in k:  # a slot never written: the engine never reads such logits; zeros if it did
                got[k] = torch.zeros(V)
            elif k[:L] == self.prefix and L < len(k) <= L + EXTRA_SLOTS:
                ext.append(k)
            else:  # not an extension of the prefix (never happens in verify): a plain forward
                cache = self.model.new_cache(1, len(k) + 1, headroom=1)
                got[k] = self._run(torch.tensor([k], device=self.device),
                                   torch.arange(len(k), device=self.device).view(1, -1), cache)[0, -1].cpu()
        for s in range(0, len(ext), self.batch):
            part = ext[s:s + self.batch]
            T = max(len(k) for k in part) - L
            tok = torch.zeros(len(part), T, dtype=torch.long)
            for b, k in enumerate(part):
                tok[b, :len(k) - L] = torch.tensor(k[L:])
            pos = (L + torch.arange(T)).view(1, -1).expand(len(part), T)
            out = self._run(tok.to(self.device), pos.to(self.device), self.scratch).cpu()
            for b, k in enumerate(part):
                for t in range(len(k) - L):
                    self._store(k[:L + t + 1], out[b, t])
                got[k] = out[b, len(k) - L - 1].clone()
        return got

    def _store(self, key: tuple, logits: torch.Tensor) -> None:
        if key in self.memo:
            return
        if len(self.memo) >= self.max_entries:  # evict the oldest; a recomputation agrees to fp32 rounding
            del self.memo[next(iter(self.memo))]
        self.memo[key] = logits.clone()


@contextlib.contextmanager
def control(name: str | None):
    """A deliberately wrong verifier the test must reject. redraw-from-p: after a rejection,
    redraw from p instead of the residual normalise([p - q]+)."""
    if name is None:
        yield
        return
    if name not in CONTROLS:
        raise SpecdecError(f"control={name!r}; allowed: {', '.join(CONTROLS)}")
    original = rejection.residual_distribution
    rejection.residual_distribution = lambda p, q, draft: p
    try:
        yield
    finally:
        rejection.residual_distribution = original


@dataclass
class VerifySettings:
    params: SamplingParams  # max_tokens is replaced by n
    proposer: str  # draft | ngram | composite | head
    head: str | None = None  # a trained head's directory (proposer head; None: the shipped one)
    k: int | str = 4  # draft tokens per round, or "auto"
    max_draft_tokens: int = 8
    draft_sampling: str = "probabilistic"
    ngram_min: int = 1
    ngram_max: int = 4
    prefix: str | None = None  # text (raw, no chat template); default by proposer
    n: int = 3  # emitted tokens compared
    samples: int = 20_000  # N (at most)
    max_seconds: float = 300.0  # stop sampling at a batch boundary after this long
    batch: int | None = None  # rows per engine batch (default: by vocabulary size)
    seed: int = 0
    alpha: float = 1e-3  # pass when p > alpha
    power: float = 0.9  # for the detectable total-variation distance
    control: str | None = None

    def __post_init__(self):
        self.n = check_int("n", self.n, 1, 8)
        self.samples = check_int("samples", self.samples, 100, None)
        self.max_seconds = check_float("max_seconds", self.max_seconds, 0.0, None, lo_open=True)
        if self.batch is not None:
            self.batch = check_int("batch", self.batch, 1, None)
        self.seed = check_int("seed", self.seed, 0, MAX_SEED)
        self.alpha = check_float("alpha", self.alpha, 0.0, 1.0, lo_open=True, hi_open=True)
        self.power = check_float("power", self.power, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.prefix is not None:
            check_text("prefix", self.prefix)
        if self.control is not None:
            check_choice("control", self.control, CONTROLS)
            if self.params.greedy:
                raise SpecdecError("--control redraw-from-p needs temperature > 0 (greedy never redraws)",
                                   "control")


def run_verify(models: Models, s: VerifySettings, progress=None) -> dict:
    """The test; returns a result dict (printed by the CLI). progress(done, total) per batch."""
    t_start = time.perf_counter()
    text = s.prefix if s.prefix is not None else DEFAULT_PREFIX["ngram" if s.proposer == "ngram" else "draft"]
    prompt = models.tokenizer.encode_prompt(text, raw=True)
    if not prompt:
        raise SpecdecError("prefix is empty; it needs at least 1 token")
    params = dataclasses.replace(s.params, max_tokens=s.n, ignore_eos=True, stop=[], stop_token_ids=[])
    V = models.vocab
    batch = s.batch or max(16, min(1000, int(3e8 / (4 * V * (s.n + 1)))))  # ~300 MB of logits a forward
    max_len = len(prompt) + s.n + 1
    spec = SpeculativeConfig(draft=models.draft_name, num_draft_tokens=s.k, max_draft_tokens=s.max_draft_tokens,
                             draft_sampling=s.draft_sampling, proposer=s.proposer, head=s.head, ngram_min=s.ngram_min,
                             ngram_max=s.ngram_max)
    taps = tuple(head_for(spec, models).cfg.taps) if drafts_with_head(spec, models) else ()
    target = MemoModel(models.target, prompt, taps=taps)
    draft = MemoModel(models.draft, prompt) if models.draft is not None else None
    engine = build_engine(with_models(models, target, draft), spec, max_model_len=max_len, max_batch=batch)
    stats = SpecStats()
    counts: dict = {}
    deadline = t_start + s.max_seconds
    with control(s.control):
        done, seed = 0, s.seed
        while done < s.samples and (done == 0 or time.perf_counter() < deadline):
            b = min(batch, s.samples - done)
            for key, c in dist.sample_engine(engine, prompt, params, b, b, seed, s.n, stats).items():
                counts[key] = counts.get(key, 0) + c
            done, seed = done + b, seed + 1
            if progress is not None:
                progress(done, s.samples)
    t_sample = time.perf_counter() - t_start
    N = done
    joint = dist.target_joint(target.next_logits, prompt, params, V, s.n, min_prob=5.0 / N)
    listed = [k for k in counts if k not in joint]
    bad = dist.impossible_samples(target.next_logits, prompt, params, V, listed)
    stat, dof, p = dist.chi_square(counts, joint)
    if bad:
        stat, p = float("inf"), 0.0
    tv = dist.detectable_tv(N, max(dof, 1), s.alpha, s.power)
    st = stats.to_dict()
    drafted = stats.rounds
    if drafted == 0:
        verdict, reason = "fail", "the proposer never drafted, so nothing was tested; use a prefix it can draft from"
    elif bad:
        verdict, reason = "fail", f"{len(bad)} sampled sequences have target probability 0, e.g. {list(bad[0])}"
    elif p <= s.alpha:
        verdict, reason = "fail", f"the output distribution differs from the target's (p = {p:.3g} <= {s.alpha:g})"
    else:
        verdict, reason = "pass", (f"no difference from the target detected; a difference of total variation "
                                   f">= {tv:.3f} would be caught with probability >= {s.power:.0%}")
    return {
        "verdict": verdict, "reason": reason, "control": s.control,
        "prefix": text, "prefix_tokens": len(prompt), "n": s.n, "samples": N,
        "proposer": s.proposer, "num_draft_tokens": s.k,
        "rounds": stats.target_forwards, "rounds_with_drafts": drafted,
        "proposed_fraction": drafted / stats.target_forwards if stats.target_forwards else 0.0,
        "draft_tokens": stats.draft_tokens, "acceptance_rate": st["acceptance_rate"],
        "per_position_acceptance": st["per_position_acceptance"],
        "proposers": st.get("proposers", {}),  # a composite's rounds, per part that drafted them
        "distinct_sequences": len(counts), "listed_mass": 1.0 - joint.get(dist.REST, 0.0),
        "chi_square": stat, "dof": dof, "p_value": p, "alpha": s.alpha,
        "detectable_tv": tv, "power": s.power, "impossible_samples": len(bad),
        "memo": {"target_hits": target.hits, "target_misses": target.misses,
                 "draft_hits": draft.hits if draft else 0, "draft_misses": draft.misses if draft else 0},
        "seconds": {"sampling": t_sample, "total": time.perf_counter() - t_start},
    }


def format_report(r: dict) -> str:
    lines = [
        f"prefix: {r['prefix']!r} ({r['prefix_tokens']} tokens); first n = {r['n']} emitted tokens; "
        f"N = {r['samples']} samples" + (f"; CONTROL: {r['control']}" if r["control"] else ""),
        f"proposer {r['proposer']} (k = {r['num_draft_tokens']}) drafted in {r['rounds_with_drafts']} of "
        f"{r['rounds']} rounds ({r['proposed_fraction']:.1%}): {r['draft_tokens']} draft tokens, "
        f"acceptance rate {r['acceptance_rate']:.3f}",
        f"{r['distinct_sequences']} distinct sequences sampled; target joint listed to "
        f"{r['listed_mass']:.4f} of its mass (the rest pooled)",
        f"chi-square = {r['chi_square']:.2f} on {r['dof']} degrees of freedom, p-value = {r['p_value']:.4g} "
        f"(pass at p > {r['alpha']:g})",
        f"smallest total-variation distance detectable at this N: {r['detectable_tv']:.4f} "
        f"(power {r['power']:.0%} at level {r['alpha']:g})",
        f"verdict: {r['verdict'].upper()}: {r['reason']}",
        f"[{r['seconds']['total']:.0f} s; memo hits/misses target {r['memo']['target_hits']}/"
        f"{r['memo']['target_misses']}, draft {r['memo']['draft_hits']}/{r['memo']['draft_misses']}]",
    ]
    return "\n".join(lines)
