"""The engine: one round for every active request, propose -> verify -> commit (stops, rollback).

  1. plan: the k policy gives each row its k (cut so the round's k + 1 tokens fit max_tokens and
     the context) and, when it prices candidates, which of the proposer's parts drafts;
  2. propose: the proposer drafts up to k tokens per row (specdec.round.Proposal);
  3. verify: the target runs one forward over [last committed token, d_1..d_k] at positions
     L-1..L-1+k, giving p_1..p_{k+1} after the same sampling chain the draft used for q
     (specdec.logits_state), and specdec.rejection keeps the accepted prefix plus one token;
  4. commit: token by token, stopping at EOS / stop ids / stop strings / max_tokens / context;
     then roll back: the target keeps KV for the committed tokens but the last (moving a length),
     and the proposer is told the row's result and rolls back its own state.
With no proposer, or k = 0, the same round is plain decoding. The engine owns the target cache's
lengths (specdec.request says what they hold); it knows proposers and k policies only through
their protocols (specdec.proposers.base.Proposer, specdec.engine.adaptive.KPolicy).
"""

from __future__ import annotations

import time

import torch

from specdec import grammar, rejection, sampling
from specdec.config import DEFAULT_MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SamplingParams, dynamic_nodes
from specdec.engine import trees
from specdec.engine.adaptive import STEADY_CATCH_UP, k_policy
from specdec.engine.rows import PREFIX_SCAN, Rows
from specdec.engine.tree_auto import TreeAuto
from specdec.errors import SpecdecError, check_range
from specdec.logits_state import new_state, sampling_groups, stacked_inputs
from specdec.proposers.base import Proposer
from specdec.request import Request, TokenLogprob
from specdec.round import Choice, Proposal, RoundResult, RowResult
from specdec.runtime.kv_cache import prefill as kv_prefill
from specdec.runtime.kv_cache import common_prefix, rows_arg
from specdec.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


class Engine(Rows):
    def __init__(self, model, tokenizer: Tokenizer | None, proposer: Proposer | None = None,
                 num_draft_tokens: int | str = 0, max_batch: int = 8, max_seq_len: int | None = None,
                 vocab_size: int | None = None, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 k_cost=None, prefill_chunk: int | None = None, grammar_tokenizer=None,
                 draft_tree: tuple[int, ...] | str | None = None, kv_pool_tokens: int | None = None):
        """num_draft_tokens: a fixed k, or "auto" for adaptive k in [0, max_draft_tokens]
        (specdec.engine.adaptive; k_cost optionally fixes its cost model). prefill_chunk: most
        prompt tokens fed per step (chunked prefill: a long prompt stalls the running rows for
        one chunk at a time); None feeds whole prompts. Build engines with
        specdec.loader.build_engine, which also checks the draft and caps the context.
        draft_tree: children per depth (specdec.engine.trees): the proposer drafts trees of the
        round's k levels, verified in one forward (Proposer.propose_tree); "auto": each round's
        shape chosen from measured costs and acceptances (specdec.engine.tree_auto). kv_pool_tokens: the
        KV pool, in tokens, shared by all rows (at least the context; None: every row may hold a
        whole context): admission, eviction and preemption below keep the rows' KV within it."""
        self.draft_tree = draft_tree
        self.tree_auto = TreeAuto() if draft_tree == "auto" else None
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        # a proposer that reads the target's hidden states (a draft head) is told them every round
        self.hidden_to = proposer if proposer is not None and proposer.wants_hidden_states else None
        self.taps = tuple(self.hidden_to.hidden_taps) if self.hidden_to is not None else ()  # its layers
        parts = proposer.parts() if proposer is not None else []
        self.policy = k_policy(num_draft_tokens if proposer is not None else 0,
                               trees.depth_cap(draft_tree, max_draft_tokens), k_cost,
                               free_sources={p.name for p in parts if not p.runs_a_model},
                               width=trees.verify_width(draft_tree),
                               priors={p.name: p.acceptance_prior for p in parts if p.acceptance_prior})
        # The real vocabulary: ids past it are embedding-table padding and never sampled.
        self.V = vocab_size or min(model.args.vocab_size, tokenizer.vocab_size)
        self.max_seq_len = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        self.max_batch = max_batch
        if prefill_chunk is not None:
            check_range("prefill_chunk", prefill_chunk, 1, None)
        self.prefill_chunk = prefill_chunk
        self.grammars = grammar.Grammars(tokenizer, self.V, model.device, grammar_tokenizer)
        self.cache = model.new_cache(1, self.max_seq_len, headroom=MAX_DRAFT_TOKENS + 1)
        self.eos_ids = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        self.free_rows = [0]  # least recently freed first
        # Prefix cache: a free row keeps the KV of its last request's committed tokens, listed
        # here, and a new prompt takes the free row that shares the longest prefix with it.
        self.row_tokens: list[list[int]] = [[]]
        self.active: list[Request] = []
        self._next_id = 0
        self.kv_pool_tokens = None
        self.set_kv_pool(kv_pool_tokens)
        self.preempted: list[Request] = []  # waiting to resume, in admission order
        self.preemptions = 0  # in all (a metric)

    # ---- requests -------------------------------------------------------------------------
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
        if self.kv_pool_tokens is not None and not self.can_admit(len(prompt) + len(output_prefix)):
            raise SpecdecError(f"no room in the KV pool ({self.kv_pool_tokens} tokens) for a prompt of "
                               f"{len(prompt)} tokens now; admit it when Engine.can_admit says so")
        if rng is None:
            rng = (rejection.GumbelStream(params.seed) if params.stable
                   else rejection.TorchRng(params.seed, self.model.device))
        grammar = self.grammars.state(params) if params.constrained else None
        req = Request(id=self._next_id, prompt=list(prompt), params=params, row=-1, rng=rng,
                      tokens=list(prompt), grammar=grammar,
                      logits_state=new_state(params, self.V, prompt, self.model.device, grammar),
                      detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None)
        self._next_id += 1
        for t in output_prefix:  # resume (used by exact-distribution tests)
            req.output.append(t)
            req.tokens.append(t)
            req.logits_state.commit(t)
        req.cached_tokens = self._take_row(req, req.tokens)
        self.active.append(req)
        return req

    # ---- the round -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> RoundResult:
        """One round for every active request."""
        self._fit_pool()
        reqs = [r for r in self.active if not r.finished]
        if not reqs:
            return RoundResult([], 0, 0.0, 0.0)
        reqs = self._prefill(reqs)
        if not reqs:  # every row is still in its prompt (chunked prefill)
            return RoundResult([], 0, 0.0, 0.0)
        t0 = time.perf_counter()
        choices = self.policy.settle(reqs, [self._plan(r, len(reqs)) for r in reqs], len(reqs))
        prop, t_draft = self._propose(reqs, choices)
        logits, hidden, t_target = self._score(reqs, prop)
        out, n_emit, logprobs, paths = self._verify(reqs, logits, prop)
        if self.tree_auto is not None:
            self._observe_tree(reqs, prop, n_emit, paths)
        rows = self._commit(reqs, choices, prop, out, n_emit, logprobs, hidden, t_draft, t_target, t0, paths)
        for r in reqs:
            if r.finished:
                self.abort(r)  # (finished: only frees its rows)
        return RoundResult(rows, prop.tokens.shape[1] + 1, t_draft, t_target)

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        """Give the target KV for every committed token but the last (one padded forward, at
        most prefill_chunk tokens), and a draft model that will draft its prompt's KV likewise
        (Proposer.prefill); returns the requests ready for a round. A prompt that an earlier
        one in the same step shares (n > 1, a common system prompt) waits for that one's KV
        and copies it instead of computing it again."""
        ready = lambda r: self.cache.lengths[r.row] >= len(r.tokens) - 1  # noqa: E731
        pending = [r for r in reqs if not ready(r)]
        if not pending:
            return reqs
        t0 = time.perf_counter()
        # Identical token lists (n > 1, retries, a test's thousands of rows) are one group: its
        # head borrows or computes the KV, the rest copy the head's.
        groups: dict[tuple, list[Request]] = {}
        for r in pending:
            groups.setdefault(tuple(r.tokens), []).append(r)
        donors = [d for d in self.active if self.cache.lengths[d.row] > 0][-PREFIX_SCAN:]
        leaders = []  # computed by this step's forward
        copies = []  # (request, the rows it copies from after the forward), in order
        for rs in groups.values():
            head = max(rs, key=lambda r: self.cache.lengths[r.row])
            self._copy_in(head, donors)
            if not ready(head):
                have = self.cache.lengths[head.row]
                if any(common_prefix(lead.tokens, head.tokens, len(head.tokens) - 1) > have for lead in leaders):
                    copies.append((head, leaders))  # another prompt's forward covers more of it
                else:
                    leaders.append(head)
            copies += [(r, [head]) for r in rs if r is not head]
        todo = kv_prefill(self.model, self.cache, leaders, self.prefill_chunk,
                          on_hidden=self.hidden_to and self.hidden_to.observe_hidden, taps=self.taps)
        for r, sources in copies:
            self._copy_in(r, sources)
        done = [r for r in pending if ready(r)]
        # A draft model's prompt is prompt processing too, where it will be needed: at a fixed
        # k > 0, or while adaptive k speculates at this load, for requests with room to draft
        # (else adaptive k prices it as catch-up and may never start the draft model).
        if self.proposer is not None and self.policy.prefills_draft(len(self.active)):
            drafting = [r for r in done if min(self.policy.k_max, self._room(r)[0]) > 0]
            if drafting:
                t1 = time.perf_counter()
                self.proposer.prefill(drafting)
                dt_draft = time.perf_counter() - t1
                for r in drafting:
                    r.draft_prefill_time += dt_draft
        dt = time.perf_counter() - t0
        for r in set(todo) | set(done):
            r.prefill_time += dt
        return [r for r in reqs if ready(r)]

    def _room(self, r: Request) -> tuple[int, int]:
        """(most drafts this round, tokens left): a round emits up to k + 1 tokens, and they must
        fit in max_tokens and the context."""
        left = min(r.params.max_tokens - len(r.output), self.max_seq_len - len(r.tokens))
        return max(0, min(left - 1, MAX_DRAFT_TOKENS)), left

    def _plan(self, r: Request, batch_size: int) -> Choice:
        if self.proposer is None:
            return Choice(0)
        limit, left = self._room(r)
        return self.policy.plan(r, batch_size, limit, lambda k: self.proposer.peek(r, k), left)

    def _propose(self, reqs: list[Request], choices: list[Choice]) -> tuple[Proposal, float]:
        B, ks = len(reqs), [c.k for c in choices]
        dev = self.model.device
        if self.proposer is None or max(ks) == 0:
            return Proposal(tokens=torch.zeros(B, 0, dtype=torch.long, device=dev),
                            num_draft=torch.zeros(B, dtype=torch.long, device=dev), q=None), 0.0
        n_nodes = dynamic_nodes(self.draft_tree, max(ks))
        widths = self.draft_tree if self.tree_auto is None else self.tree_auto.choose(ks)
        t0 = time.perf_counter()
        if n_nodes is not None:
            prop = self.proposer.propose_dynamic(reqs, ks, n_nodes)
        elif widths is not None and (self.tree_auto is None or max(widths) > 1):
            prop = self.proposer.propose_tree(reqs, [trees.shape_for(widths, k, r.params)
                                                     for k, r in zip(ks, reqs)])
        else:
            prop = self.proposer.propose(reqs, ks, only=[c.source for c in choices])
        t_draft = time.perf_counter() - t0
        if self.tree_auto is not None and prop.catch_up <= STEADY_CATCH_UP:  # (a catch-up is not drafting)
            self.tree_auto.observe_draft(widths, sum(1 for k in ks if k), t_draft)
        if prop.source is None:
            prop.source = [self.proposer.name] * B
        # The first draft a row's grammar rejects ends its drafts (verification would reject it:
        # p = 0 there). Only for one-hot drafts: there the residual after rejecting it is p
        # itself, so sampling p directly is the same. A sampled draft's q is masked like p and
        # never drafts such a token; were it not, cutting would replace the residual by p and
        # bias the output (tests/test_structured.py).
        for b, r in enumerate(reqs):
            if r.grammar is not None and prop.q is None and (n := int(prop.num_draft[b])):
                prop.num_draft[b] = r.grammar.accepted_prefix(prop.tokens[b, :n].tolist())
        self.policy.observe_draft(max(ks), t_draft, prop)
        return prop, t_draft

    def _score(self, reqs: list[Request], prop: Proposal):
        """The verify forward: logits [B, k + 1, V] (and hidden states [B, k + 1, dim] when the
        proposer wants them) at positions L-1..L-1+k of each row."""
        dev = self.model.device
        B, k = prop.tokens.shape
        mask = slots = None
        if prop.parents is not None:  # a tree: each node sees the prefix and its ancestors
            feed, positions, slots, mask = trees.forward_inputs(reqs, prop, dev)
        else:
            L = torch.tensor([len(r.tokens) for r in reqs], device=dev)
            last = torch.tensor([[r.tokens[-1]] for r in reqs], device=dev)
            feed = torch.cat([last, prop.tokens.to(dev)], dim=1)  # [B, k + 1]
            positions = (L - 1).unsqueeze(1) + torch.arange(k + 1, device=dev)  # [B, k + 1]
        want_hidden = self.hidden_to is not None
        t0 = time.perf_counter()
        extra = {} if slots is None else {"mask": mask, "slots": slots}  # (models without trees: chains only)
        if self.taps:  # (and without taps: heads that read the final hidden states only)
            extra["taps"] = self.taps
        out = self.model.forward(feed, positions, self.cache, rows=rows_arg(reqs, dev),
                                 return_hidden=want_hidden, **extra)
        logits, hidden = out if want_hidden else (out, None)
        t_target = time.perf_counter() - t0
        self.policy.observe_target(B, k + 1, t_target)
        if self.tree_auto is not None:
            self.tree_auto.observe_target(B * (k + 1), t_target)
        return logits[..., : self.V], hidden, t_target

    def _verify(self, reqs: list[Request], logits: torch.Tensor, prop: Proposal):
        """(tokens [B, k + 1], emitted [B], {row: log-probabilities}): rows that share sampling
        params and rng are verified in one call. A request that asks for log-probabilities gets,
        at each of its k + 1 positions, the chosen token's and the top ones under the same
        transformed distribution it was verified against (what plain decoding would report:
        the kernels give a position the same logits in any batch and block)."""
        lps = {}
        drafts, num_draft, q = prop.tokens, prop.num_draft, prop.q
        B, k = drafts.shape
        nd = num_draft.tolist()
        out = torch.full((B, k + 1), rejection.PLACEHOLDER, dtype=torch.long, device=logits.device)
        n_emit = torch.empty(B, dtype=torch.long, device=logits.device)
        paths = {}  # tree rows: accepted node indices
        if prop.parents is not None:
            paths = trees.verify_rows(reqs, trees.tree_rows(reqs, prop), logits, prop, self.V, out, n_emit)
        for params, rng, idx in sampling_groups(reqs):
            idx = [b for b in idx if b not in paths]  # the rest are chains (or drafted nothing)
            if not idx:
                continue
            # Only the group's own width: a row's dice never depend on how far other rows of
            # the batch drafted (a seed reproduces whatever else is running), and a k = 0 row
            # in a wide batch pays one position of sampling, not k + 1.
            w = max(nd[b] for b in idx)
            ix = torch.tensor(idx, device=logits.device)
            d = drafts[ix, :w]
            inp = stacked_inputs(reqs, idx, drafts[:, :w])  # [G (w + 1), V] per-position penalties
            flat = logits[ix, : w + 1].flatten(0, 1)  # [G (w + 1), V]
            if params.greedy:
                am = sampling.greedy_tokens(flat, params, inp.counts, inp.seen, inp.mask).view(-1, w + 1)
                o, n = rejection.greedy_verify(am, d, num_draft[ix])
            elif params.stable:  # each position's token is fixed by its noise: accept iff equal
                noise = rejection.stable_noise(reqs, idx, w + 1, flat.shape[-1], flat.device)
                am = sampling.stable_tokens(flat, params, noise, inp.counts, inp.seen, inp.mask).view(-1, w + 1)
                o, n = rejection.greedy_verify(am, d, num_draft[ix])
            else:
                p = sampling.probabilities(flat, params, inp.counts, inp.seen, inp.mask).view(-1, w + 1, self.V)
                o, n = rejection.stochastic_verify(p, None if q is None else q[ix, :w], d, num_draft[ix], rng)
            out[ix, : w + 1], n_emit[ix] = o, n
            if params.logprobs is not None:
                lp = sampling.logprobs(flat, params, inp.counts, inp.seen, inp.mask).view(-1, w + 1, self.V)
                chosen = lp.gather(2, o.clamp(min=0).unsqueeze(2)).squeeze(2)  # [G, w + 1] (-1: not emitted)
                top = lp.topk(params.logprobs, dim=-1) if params.logprobs else None
                for g, b in enumerate(idx):
                    lps[b] = (chosen[g].tolist(), top.values[g].tolist() if top else None,
                              top.indices[g].tolist() if top else None)
        return out, n_emit, lps, paths

    def _observe_tree(self, reqs, prop: Proposal, n_emit: torch.Tensor, paths: dict) -> None:
        nd, ne = prop.num_draft.tolist(), n_emit.tolist()
        self.tree_auto.observe_rows([
            (prop.parents[b, : nd[b]].tolist(), nd[b], paths[b], None) if b in paths
            else (None, nd[b], None, min(ne[b] - 1, nd[b])) for b in range(len(reqs))])

    @staticmethod
    def _token_logprobs(tokens: list[int], lp) -> list[TokenLogprob]:
        chosen, top_v, top_i = lp
        return [TokenLogprob(t, chosen[j], [] if top_v is None else
                             [(i, v) for i, v in zip(top_i[j], top_v[j]) if v != float("-inf")])
                for j, t in enumerate(tokens)]

    def _commit(self, reqs, choices, prop, out, n_emit, logprobs, hidden, t_draft, t_target,
                t0, paths) -> list[RowResult]:
        """Append each row's emitted tokens up to a stop, roll the target back to the committed
        tokens (a tree row's accepted path moved into place first), tell the proposer and the k
        policy, and charge each row its share of the time."""
        out_l, n_emit_l, nd_l = out.tolist(), n_emit.tolist(), prop.num_draft.tolist()  # one sync
        for b in paths:  # a tree row's round counts its levels, as a chain's counts its k: metrics and
            nd_l[b] = trees.depth(prop.parents[b, : nd_l[b]])  # adaptive k see acceptance per depth
        sources = prop.source or [None] * len(reqs)
        drafting = sum(1 for n in nd_l if n)
        # a proposer is told about rounds it was asked to draft for (one that reads hidden states: all)
        proposed = self.hidden_to is not None or (self.proposer is not None and any(c.k for c in choices))
        rows = []
        for b, r in enumerate(reqs):
            L = len(r.tokens)
            committed = []
            for t in out_l[b][: n_emit_l[b]]:
                committed.append(t)
                self._append(r, t)
                if r.finished:
                    break
            # Accepted drafts cut by a stop are neither emitted nor counted (docs/pitfalls.md 6).
            n_acc = min(n_emit_l[b] - 1, len(committed))
            c = choices[b]
            r.stats.record_round(nd_l[b], n_acc, c.k, sources[b])
            if nd_l[b]:
                r.stats.draft_time += t_draft / drafting
                r.stats.draft_forwards += nd_l[b]
            r.stats.target_time += t_target / len(reqs)
            r.stats.target_forwards += 1
            self.policy.observe_round(r, nd_l[b], n_acc, sources[b], c.key)
            # Target KV: committed tokens but the last. Drafts past the commit are rolled back.
            if b in paths and n_acc:  # node j's KV is at slot L + j: the path moves to L, L + 1, ...
                self.cache.compact(r.row, [L + j for j in paths[b][:n_acc]], L)
            self.cache.set_length(r.row, min(L + n_acc, len(r.tokens) - 1))
            lp = self._token_logprobs(committed, logprobs[b]) if b in logprobs else None
            if lp is not None:
                r.logprobs.extend(lp)
            res = RowResult(request=r, k=c.k, drafted=nd_l[b], accepted=n_acc, committed=committed,
                            source=sources[b] if nd_l[b] else None, key=c.key if nd_l[b] else None,
                            delta=self._stream_delta(r),
                            hidden=None if hidden is None else trees.row_hidden(hidden[b], paths.get(b), len(committed)),
                            logprobs=lp)
            if proposed:
                self.proposer.accept(r, res)
            r.decode_time += time.perf_counter() - t0
            rows.append(res)
        return rows

    # ---- commit and stops ------------------------------------------------------------------
    def _append(self, r: Request, t: int) -> None:
        assert 0 <= t < self.V, f"token id {t} outside the vocabulary [0, {self.V})"
        r.output.append(t)
        r.tokens.append(t)
        r.logits_state.commit(t)
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
                    r.finish_reason = "stop"
                    return
        if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
            r.finish_reason = "stop"
        elif r.grammar is not None and r.grammar.stopped:  # the grammar is complete
            r.finish_reason = "stop"
        elif len(r.output) >= p.max_tokens or len(r.tokens) >= self.max_seq_len:
            r.finish_reason = "length"

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
            while self.preempted or any(not r.finished for r in self.active):
                self._emit(self.step(), on_event)
        finally:
            self.abort_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_event=None) -> list[Request]:
        """Every prompt to its end, at most max_batch at a time; on_event(request, new text)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise SpecdecError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        done: list[Request] = []
        i = 0
        self.reserve(len(prompts))
        try:
            while i < len(prompts) or self.active or self.preempted:
                while i < len(prompts) and self.can_admit(len(prompts[i])):
                    done.append(self.add_request(prompts[i], plist[i]))
                    i += 1
                self._emit(self.step(), on_event)
        finally:  # an exception or an abandoned stream leaves no row half-used
            self.abort_all()
        return done

    @staticmethod
    def _emit(result: RoundResult, on_event) -> None:
        if on_event is not None:
            for row in result.rows:
                if row.delta:
                    on_event(row.request, row.delta)

