"""The engine's rows and their KV memory (a base of specdec.engine.core.Engine).

Each running request holds one row of the target cache (and of the proposer's state). A free row
keeps the KV of its last request's committed tokens for prefix reuse; the KV pool bounds what
all rows hold at once (admission, eviction of kept prefixes, preemption by recompute). The
engine's round (core.py) reads and moves these rows; nothing here runs a model forward.
"""

from __future__ import annotations

from specdec.config import MAX_DRAFT_TOKENS
from specdec.errors import check_range
from specdec.request import Request
from specdec.runtime.kv_cache import common_prefix

PREFIX_SCAN = 64  # rows searched for a shared prefix (the most recently freed / running ones)


class Rows:
    """Row bookkeeping over attributes the Engine sets: cache, max_seq_len, max_batch, model,
    proposer, policy, hidden_to, active, preempted, free_rows, row_tokens, kv_pool_tokens."""

    # ---- the KV pool -----------------------------------------------------------------------
    # A row holds physical memory only for the slots it has written (specdec.runtime.kv_cache),
    # so a request's KV is its own length. The pool is what all rows may hold at once, counted
    # in tokens: each running request its tokens plus one verify block (the most a round
    # writes past them), each free row the prefix it keeps for reuse. Admission needs room for
    # the prompt; before every round the engine makes room for every running request's growth:
    # first by evicting kept prefixes (least recently freed first), then by preempting the
    # newest requests. A preempted request gives back its KV and waits; it resumes, before any
    # new admission, when there is room again, and its KV is computed again from its tokens
    # (recompute: the kernels give the bits decoding gave, so its output is unchanged).
    def set_kv_pool(self, tokens: int | None) -> None:
        if tokens is not None:
            check_range("kv_cache_tokens", tokens, self.max_seq_len, None)
        self.kv_pool_tokens = tokens

    def _need(self, r: Request) -> int:
        """Pool tokens a running request may hold after its next round."""
        return min(len(r.tokens) + MAX_DRAFT_TOKENS + 1, self.max_seq_len)

    def _running_need(self) -> int:
        return sum(self._need(r) for r in self.active)

    def kv_tokens_used(self) -> int:
        """Pool tokens held: the running requests' (a verify block each) and the free rows'."""
        return self._running_need() + sum(len(self.row_tokens[i]) for i in self.free_rows)

    def can_admit(self, n_prompt: int) -> bool:
        """A free row, no preempted request waiting to resume, and room in the pool for a
        prompt of n_prompt tokens next to the running requests (kept prefixes can be evicted)."""
        if not self.free_rows or self.preempted:
            return False
        if self.kv_pool_tokens is None:
            return True
        need = min(n_prompt + MAX_DRAFT_TOKENS + 1, self.max_seq_len)
        return self._running_need() + need <= self.kv_pool_tokens

    def _fit_pool(self) -> None:
        """Before a round: resume what fits, then make room for every running request's round."""
        pool = self.kv_pool_tokens
        if pool is None:
            return
        running = self._running_need()
        while self.preempted and self.free_rows and running + self._need(self.preempted[0]) <= pool:
            r = self.preempted.pop(0)
            self._resume(r)
            running += self._need(r)
        kept = sum(len(self.row_tokens[i]) for i in self.free_rows)
        for row in list(self.free_rows):  # least recently freed first
            if running + kept <= pool:
                break
            if self.row_tokens[row]:
                kept -= len(self.row_tokens[row])
                self._evict(row)
        while running > pool and len(self.active) > 1:
            victim = max(self.active, key=lambda r: r.id)  # the newest (FCFS: the last in)
            running -= self._need(victim)
            self._preempt(victim)

    def _evict(self, row: int) -> None:
        """A free row forgets the prefix it kept, and its memory (target and draft) is given back."""
        self.row_tokens[row] = []
        self.cache.release(row)
        if self.proposer is not None:
            self.proposer.evict(row)

    def _preempt(self, req: Request) -> None:
        self.active.remove(req)
        if self.proposer is not None:
            self.proposer.release(req)
        self.policy.release(req)
        self.cache.set_length(req.row, 0)
        self.free_rows.insert(0, req.row)
        self._evict(req.row)
        self.preempted.append(req)
        self.preempted.sort(key=lambda r: r.id)
        self.preemptions += 1

    def _resume(self, req: Request) -> None:
        """A preempted request back on a row: its KV is prefilled again from its tokens."""
        self._take_row(req, req.tokens)
        self.active.append(req)

    # ---- rows ------------------------------------------------------------------------------
    def reserve(self, n_rows: int) -> None:
        """Make room for n_rows concurrent requests (buffers grow only while idle)."""
        n_rows = min(n_rows, self.max_batch)
        if n_rows <= self.cache.batch_size or self.active or self.preempted:
            return
        self.cache = self.model.new_cache(n_rows, self.max_seq_len, headroom=MAX_DRAFT_TOKENS + 1)
        self.free_rows = list(range(n_rows))
        self.row_tokens = [[] for _ in range(n_rows)]
        if self.proposer is not None:
            self.proposer.reserve(n_rows)

    def _take_row(self, req: Request, tokens: list[int]) -> int:
        """Give req the free row sharing the longest prefix with tokens; the prefix it reuses."""
        row, reuse = self._pick_row(tokens)
        self.free_rows.remove(row)
        req.row = row
        self.cache.set_length(row, reuse)
        self.row_tokens[row] = []
        if self.proposer is not None:
            self.proposer.begin(req)
        self.policy.begin(req)
        return reuse

    def abort(self, req: Request) -> None:
        """End a request now (finish_reason "abort" unless it had finished) and free its rows in
        the target cache and the proposer. A request no longer active is left as it is."""
        if req in self.preempted:  # it holds no row
            self.preempted.remove(req)
            req.finish_reason = req.finish_reason or "abort"
            return
        if req not in self.active:
            return
        if not req.finished:
            req.finish_reason = "abort"
        self.active.remove(req)
        if self.proposer is not None:
            self.proposer.release(req)
        self.policy.release(req)
        self.row_tokens[req.row] = req.tokens[: self.cache.lengths[req.row]]
        self.cache.set_length(req.row, 0)
        self.free_rows.append(req.row)

    # ---- prefix reuse ----------------------------------------------------------------------
    def _pick_row(self, tokens: list[int]) -> tuple[int, int]:
        """(free row, prompt tokens whose KV it already holds): the longest shared prefix among
        the PREFIX_SCAN most recently freed rows, at most all tokens but the last (the first
        round feeds that one); else the least recently freed row."""
        best, best_n, want = self.free_rows[0], 0, len(tokens) - 1
        for row in reversed(self.free_rows[-PREFIX_SCAN:]):
            held = self.row_tokens[row]
            if held and held[0] == tokens[0]:
                n = common_prefix(held, tokens, want)
                if n > best_n:
                    best, best_n = row, n
                    if n == want:
                        break
        return best, best_n

    def _copy_in(self, req: Request, donors: list[Request]) -> None:
        """Copy KV for a longer shared prefix from one of `donors` (running rows: a sibling of
        an n > 1 request, another user of the same system prompt) into req's row."""
        have, donor = self.cache.lengths[req.row], None
        for d in donors:
            n_d = self.cache.lengths[d.row]
            if d is not req and n_d > have and d.tokens[0] == req.tokens[0]:
                n = common_prefix(d.tokens[:n_d], req.tokens, len(req.tokens) - 1)
                if n > have:
                    have, donor = n, d
        if donor is not None:
            self.cache.copy_prefix(donor.row, req.row, have)
            req.cached_tokens = max(req.cached_tokens, min(have, len(req.prompt)))
            if self.hidden_to is not None:
                self.hidden_to.share_prefix(req, donor, have)

    def abort_all(self) -> None:
        for r in list(self.active) + list(self.preempted):
            self.abort(r)
