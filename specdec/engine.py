"""The engine: requests, rounds of propose -> verify -> commit -> roll back -> stop.

Bookkeeping per request (the classic off-by-one, PITFALLS 4): `tokens` is the committed history
(prompt + output). The target cache holds KV for all committed tokens but the last: the last
committed token (a recovered or bonus token, or the last prompt token) gets its KV when it is the
first input of the next round. So at the start of every round `kv_len == len(tokens) - 1`.

One round for a batch of requests, each at its own length L:
  1. the proposer drafts up to k tokens per row (fewer near max_tokens / the context limit);
  2. the target runs one forward over [last committed token, d_1..d_k] at positions L-1..L-1+k
     and yields p_1..p_{k+1} (after the same sampling transforms the draft used for q);
  3. verification (specdec.rejection) emits the accepted prefix plus one recovered/bonus token;
  4. commit token by token, stopping at EOS / stop ids / stop strings / max_tokens / context;
  5. roll back: the target keeps KV for the committed tokens but the last (rejected drafts and
     anything past a stop are dropped by moving the length); the proposer is told how many of
     its drafts were accepted and rolls back its own state.
With no proposer, or k = 0, the same round is plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec import rejection, sampling
from specdec.adaptive import STEADY_CATCH_UP, AdaptiveK, k_policy
from specdec.config import DEFAULT_MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SamplingParams
from specdec.errors import SpecdecError
from specdec.kv_cache import prefill as kv_prefill
from specdec.kv_cache import rows_arg
from specdec.metrics import SpecStats
from specdec.proposers.base import peek
from specdec.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    row: int
    rng: object
    tokens: list[int]  # committed: prompt + output
    output: list[int] = field(default_factory=list)
    counts: torch.Tensor | None = None  # [V] float: occurrences in the output (penalties)
    seen: torch.Tensor | None = None  # [V] bool: occurs in prompt or output (repetition penalty)
    detok: IncrementalDetokenizer | None = None
    text: str = ""
    streamed: int = 0  # characters of `text` already handed to the caller
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_time: float = 0.0
    draft_prefill_time: float = 0.0  # the draft model's prompt prefill, part of prefill_time
    decode_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def penalty_state(self):
        return None if self.counts is None else (self.counts, self.seen)


class Engine:
    def __init__(self, model, tokenizer: Tokenizer | None, proposer=None,
                 num_draft_tokens: int | str = 0, max_batch: int = 8, max_seq_len: int | None = None,
                 vocab_size: int | None = None, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 k_cost=None):
        """num_draft_tokens: a fixed k, or "auto" for adaptive k in [0, max_draft_tokens]
        (specdec.adaptive; k_cost optionally fixes its cost model)."""
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.policy = k_policy(num_draft_tokens if proposer is not None else 0, max_draft_tokens, k_cost)
        if isinstance(self.policy, AdaptiveK):
            parts = getattr(proposer, "proposers", [proposer])
            self.policy.free_sources = {p.name for p in parts if not getattr(p, "runs_a_model", True)}
        # The real vocabulary: ids past it are embedding-table padding and never sampled.
        self.V = vocab_size or min(model.args.vocab_size, tokenizer.vocab_size)
        self.max_seq_len = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        self.max_batch = max_batch
        self.cache = model.new_cache(1, self.max_seq_len, headroom=MAX_DRAFT_TOKENS + 1)
        self.eos_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        self.free_rows = [0]
        self.active: list[Request] = []
        self._next_id = 0

    # ---- requests -------------------------------------------------------------------------
    def reserve(self, n_rows: int) -> None:
        """Make room for n_rows concurrent requests (buffers grow only while idle)."""
        n_rows = min(n_rows, self.max_batch)
        if n_rows <= self.cache.batch_size or self.active:
            return
        self.cache = self.model.new_cache(n_rows, self.max_seq_len, headroom=MAX_DRAFT_TOKENS + 1)
        self.free_rows = list(range(n_rows))
        if self.proposer is not None and hasattr(self.proposer, "reserve"):
            self.proposer.reserve(n_rows)

    def add_request(self, prompt: list[int], params: SamplingParams, rng=None,
                    output_prefix: list[int] = ()) -> Request:
        if not prompt:
            raise SpecdecError("prompt is empty; it needs at least 1 token")
        if len(prompt) + len(output_prefix) >= self.max_seq_len:
            raise SpecdecError(
                f"prompt has {len(prompt)} tokens; allowed 1..{self.max_seq_len - 1} "
                f"(the context length is {self.max_seq_len})")
        bad = [t for t in prompt if not 0 <= t < self.model.args.vocab_size]
        if bad:
            raise SpecdecError(f"prompt token id {bad[0]} is out of range [0, {self.model.args.vocab_size})")
        if not self.free_rows:
            self.reserve(self.cache.batch_size + 1)
        if not self.free_rows:
            raise SpecdecError(f"too many concurrent requests; max_batch is {self.max_batch}")
        row = self.free_rows.pop(0)
        req = Request(id=self._next_id, prompt=list(prompt), params=params, row=row,
                      rng=rng or rejection.TorchRng(params.seed, self.model.device),
                      tokens=list(prompt))
        self._next_id += 1
        if params.has_penalties:
            dev = self.model.device
            req.counts = torch.zeros(self.V, device=dev)
            req.seen = torch.zeros(self.V, dtype=torch.bool, device=dev)
            ids = torch.tensor([t for t in prompt if t < self.V], dtype=torch.long, device=dev)
            req.seen[ids] = True
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer)
        for t in output_prefix:  # resume (used by exact-distribution tests)
            req.output.append(t)
            req.tokens.append(t)
            if req.counts is not None:
                req.counts[t] += 1
                req.seen[t] = True
        self.cache.set_length(row, 0)
        if self.proposer is not None:
            self.proposer.begin(req)
        self.policy.begin(req)
        self.active.append(req)
        return req

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason

    def _release(self, req: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(req)
        self.policy.release(req)
        self.cache.set_length(req.row, 0)
        self.free_rows.append(req.row)
        self.free_rows.sort()

    # ---- the round -------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> None:
        """Give the target KV for every committed token but the last (one padded forward), and
        a draft model that will draft its prompt's KV likewise (Proposer.prefill)."""
        t0 = time.perf_counter()
        todo = kv_prefill(self.model, self.cache, reqs)
        if not todo:
            return
        # A draft model's prompt is prompt processing too, where it will surely be needed: at a
        # fixed k > 0, for requests with room to draft (adaptive k prices it as catch-up and may
        # never start the draft model).
        if hasattr(self.proposer, "prefill") and not isinstance(self.policy, AdaptiveK):
            drafting = [r for r in todo if self._budget(r, len(todo))[0] > 0]
            if drafting:
                t1 = time.perf_counter()
                self.proposer.prefill(drafting)
                dt_draft = time.perf_counter() - t1
                for r in drafting:
                    r.draft_prefill_time += dt_draft
        dt = time.perf_counter() - t0
        for r in todo:
            r.prefill_time += dt

    def _budget(self, r: Request, batch_size: int) -> tuple[int, str | None, str | None]:
        """(k, proposer, acceptance key) for this round: the policy's k, cut so that the round's
        k + 1 emitted tokens fit in max_tokens and the context; adaptive k also picks which of
        the proposer's parts drafts (None: the proposer's own order)."""
        if self.proposer is None:
            return 0, None, None
        left = min(r.params.max_tokens - len(r.output), self.max_seq_len - len(r.tokens))
        limit = max(0, min(left - 1, MAX_DRAFT_TOKENS))
        if isinstance(self.policy, AdaptiveK):  # price each part that could draft
            cands = peek(self.proposer, r, min(limit, self.policy.k_max)) if limit > 0 else []
            return self.policy.choose_among(r, batch_size, limit, cands, remaining=left)
        return self.policy.choose(r, batch_size, limit), None, None

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, str]]:
        """Run one round for every active request; return (request, new text) pairs."""
        reqs = [r for r in self.active if not r.finished]
        if not reqs:
            return []
        self._prefill(reqs)
        dev = self.model.device
        B = len(reqs)
        ks, only, keys = map(list, zip(*[self._budget(r, B) for r in reqs]))
        t0 = time.perf_counter()
        proposed = self.proposer is not None and max(ks) > 0
        sources = [None] * B
        if proposed:
            if any(only) and getattr(self.proposer, "proposers", None):  # a composite: route rows
                prop = self.proposer.propose(reqs, ks, only=only)
            else:
                prop = self.proposer.propose(reqs, ks)
            drafts, num_draft, q = prop.tokens, prop.num_draft, prop.q
            sources = prop.source or [self.proposer.name] * B
        else:
            drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
            num_draft = torch.zeros(B, dtype=torch.long, device=dev)
            q = None
        t_draft = time.perf_counter() - t0
        if proposed and len(set(sources)) == 1 and isinstance(self.policy, AdaptiveK):
            # A draft model's prompt prefill or long catch-up is not the cost of drafting k: it
            # is measured apart, per caught-up token (mixed sources cannot be told apart).
            if prop.catch_up <= STEADY_CATCH_UP:
                self.policy.observe_draft(max(ks), t_draft, sources[0])
            else:
                est = self.policy.draft_estimate(max(ks), sources[0])
                extra = t_draft - est if est is not None else t_draft * prop.catch_up / (prop.catch_up + max(ks))
                self.policy.observe_catch_up(prop.catch_up - STEADY_CATCH_UP, extra, sources[0])
        k = drafts.shape[1]
        L = torch.tensor([len(r.tokens) for r in reqs], device=dev)
        last = torch.tensor([[r.tokens[-1]] for r in reqs], device=dev)
        feed = torch.cat([last, drafts], dim=1)  # [B, k + 1]
        positions = (L - 1).unsqueeze(1) + torch.arange(k + 1, device=dev)  # [B, k + 1]
        rows = rows_arg(reqs, dev)
        t1 = time.perf_counter()
        logits = self.model.forward(feed, positions, self.cache, rows=rows)[..., : self.V]
        t_target = time.perf_counter() - t1
        self.policy.observe_target(B, k + 1, t_target)
        out, n_emit = self._verify(reqs, logits, drafts, num_draft, q)
        out_l, n_emit_l, nd_l = out.tolist(), n_emit.tolist(), num_draft.tolist()  # one sync
        events = []
        for b, r in enumerate(reqs):
            n_acc = n_emit_l[b] - 1
            if nd_l[b]:
                r.stats.draft_time += t_draft
                r.stats.draft_forwards += nd_l[b]
            r.stats.target_time += t_target
            r.stats.target_forwards += 1
            L_b = len(r.tokens)
            committed = 0
            for t in out_l[b][: n_emit_l[b]]:
                committed += 1
                self._append(r, t)
                if r.finished:
                    break
            # Accepted drafts cut by a stop are neither emitted nor counted (PITFALLS 6).
            n_acc = min(n_acc, committed)
            r.stats.record_round(nd_l[b], n_acc, ks[b], sources[b])
            self.policy.observe_round(r, nd_l[b], n_acc, sources[b], keys[b])
            # Target KV: committed tokens but the last. Drafts past the commit are rolled back.
            self.cache.set_length(r.row, min(L_b + n_acc, len(r.tokens) - 1))
            if proposed:  # a proposer is only told about rounds it was asked to draft for
                self.proposer.accept(r, n_acc)
            r.decode_time += time.perf_counter() - t0
            events.append((r, self._stream_delta(r)))
        for r in reqs:
            if r.finished:
                self.active.remove(r)
                self._release(r)
        return events

    def _verify(self, reqs, logits, drafts, num_draft, q):
        """Group rows that share sampling params and rng; verify each group in one call."""
        B, k = drafts.shape
        out = torch.empty(B, k + 1, dtype=torch.long, device=logits.device)
        n_emit = torch.empty(B, dtype=torch.long, device=logits.device)
        groups: dict[tuple, list[int]] = {}
        for b, r in enumerate(reqs):
            groups.setdefault((id(r.params), id(r.rng)), []).append(b)
        for idx in groups.values():
            params, rng = reqs[idx[0]].params, reqs[idx[0]].rng
            ix = torch.tensor(idx, device=logits.device)
            lg = logits[ix]  # [G, k + 1, V]
            counts = seen = None
            if params.has_penalties:
                st = [sampling.prefix_counts(reqs[b].counts, reqs[b].seen, drafts[b, :k]) for b in idx]
                counts = torch.stack([s[0] for s in st]).flatten(0, 1)  # [G (k + 1), V]
                seen = torch.stack([s[1] for s in st]).flatten(0, 1)
            flat = lg.flatten(0, 1)  # [G (k + 1), V]
            if params.greedy:
                am = sampling.greedy_tokens(flat, params, counts, seen).view(len(idx), k + 1)
                o, n = rejection.greedy_verify(am, drafts[ix], num_draft[ix])
            else:
                p = sampling.probabilities(flat, params, counts, seen).view(len(idx), k + 1, -1)
                o, n = rejection.stochastic_verify(p, None if q is None else q[ix], drafts[ix],
                                                   num_draft[ix], rng)
            out[ix], n_emit[ix] = o, n
        return out, n_emit

    # ---- commit and stops ------------------------------------------------------------------
    def _append(self, r: Request, t: int) -> None:
        assert 0 <= t < self.V, f"token id {t} outside the vocabulary [0, {self.V})"
        r.output.append(t)
        r.tokens.append(t)
        if r.counts is not None:
            r.counts[t] += 1
            r.seen[t] = True
        p = r.params
        if r.detok is not None:
            before = len(r.text)
            r.detok.push(t)
            r.text = r.detok.text
            if p.stop:
                longest = max(len(s) for s in p.stop)
                window_start = max(0, before - longest + 1)
                hits = [(i, s) for s in p.stop if (i := r.text.find(s, window_start)) >= 0]
                if hits:
                    r.text = r.text[: min(i for i, _ in hits)]
                    return self._finish(r, "stop")
        if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
            return self._finish(r, "stop")
        if len(r.output) >= p.max_tokens:
            return self._finish(r, "length")
        if len(r.tokens) >= self.max_seq_len:
            return self._finish(r, "length")

    def _stream_delta(self, r: Request) -> str:
        """New text for the caller, holding back a tail that may still become a stop string."""
        end = len(r.text)
        if not r.finished and r.params.stop:
            for s in r.params.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if r.text.endswith(s[:n]):
                        end = min(end, len(r.text) - n)
                        break
        end = max(end, r.streamed)
        delta = r.text[r.streamed:end]
        r.streamed = end
        return delta

    # ---- driving ---------------------------------------------------------------------------
    def run(self, on_event=None) -> None:
        """Step until every active request has finished; abandoned runs release their rows."""
        try:
            while any(not r.finished for r in self.active):
                for r, delta in self.step():
                    if on_event is not None and delta:
                        on_event(r, delta)
        finally:
            self._release_all()

    def _release_all(self) -> None:
        for r in list(self.active):
            self.active.remove(r)
            self._release(r)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_event=None) -> list[Request]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise SpecdecError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        done: list[Request] = []
        i = 0
        self.reserve(len(prompts))
        try:
            while i < len(prompts) or self.active:
                while i < len(prompts) and self.free_rows:
                    done.append(self.add_request(prompts[i], plist[i]))
                    i += 1
                for r, delta in self.step():
                    if on_event is not None and delta:
                        on_event(r, delta)
        finally:  # an exception or an abandoned stream leaves no row half-used
            self._release_all()
        return done
