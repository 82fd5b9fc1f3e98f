"""Prometheus metrics of the server (prometheus-client), one registry per server.

Fed by the scheduler on the engine thread: the load (running and waiting requests, KV rows and
tokens held, the KV pool, its preemptions and the cache's resident memory), latencies (time to first token, inter-token latency, end to end), token counters
(prompt, generated, prompt tokens served from the prefix cache) and speculation (rounds that
drafted, draft tokens, accepted tokens, accepted per draft position, chosen k).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"labelnames": ["model_name"]}
        self._label = {"model_name": model_name}
        self._preemptions = 0  # the engine's count already added to the counter
        self._resident_set = False
        self.running = Gauge("specdec_num_requests_running", "Requests in the running batch", registry=r, **lab)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests waiting for a row", registry=r, **lab)
        self.kv_rows_used = Gauge("specdec_kv_cache_rows_used", "KV cache rows held by requests", registry=r, **lab)
        self.kv_rows = Gauge("specdec_kv_cache_rows", "KV cache rows in all", registry=r, **lab)
        self.kv_tokens = Gauge("specdec_kv_cache_tokens_used", "Tokens of KV held by running requests",
                               registry=r, **lab)
        self.kv_usage = Gauge("specdec_kv_cache_usage_ratio", "Fraction of KV cache rows in use", registry=r, **lab)
        self.kv_pool = Gauge("specdec_kv_pool_tokens", "The KV pool in tokens (0: no pool)", registry=r, **lab)
        self.kv_pool_used = Gauge("specdec_kv_pool_tokens_used", "Pool tokens held: running requests (with a "
                                  "verify block each) and the prefixes free rows keep", registry=r, **lab)
        self.kv_resident = Gauge("specdec_kv_cache_resident_bytes", "Memory the target's KV cache really holds "
                                 "(read at scrape time)", registry=r, **lab)
        self.preempted = Gauge("specdec_num_requests_preempted", "Requests preempted, waiting to resume",
                               registry=r, **lab)
        self.preemptions = Counter("specdec_num_preemptions", "Requests preempted by the KV pool (recomputed "
                                   "when they resume)", registry=r, **lab)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r, **lab)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r, **lab)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Request latency, submit to last token",
                             buckets=LATENCY_BUCKETS, registry=r, **lab)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens admitted", registry=r, **lab)
        self.cached_tokens = Counter("specdec_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV was reused, not prefilled", registry=r, **lab)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens generated", registry=r, **lab)
        self.finished = Counter("specdec_request_finished", "Requests finished, by reason",
                                labelnames=["model_name", "finish_reason"], registry=r)
        self.rounds = Counter("specdec_rounds", "Engine rounds (verify forwards)", registry=r, **lab)
        self.drafts = Counter("specdec_spec_decode_num_drafts", "Row-rounds that drafted", registry=r, **lab)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                    registry=r, **lab)
        self.accepted = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                registry=r, **lab)
        self.accepted_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each draft position",
                                    labelnames=["model_name", "position"], registry=r)
        self.chosen_k = Counter("specdec_spec_decode_chosen_k", "Row-rounds by the k chosen for them",
                                labelnames=["model_name", "k"], registry=r)

    def observe_state(self, sched) -> None:
        eng = sched.engine
        if not self._resident_set:  # read at scrape time (the engine's cache may be replaced)
            self.kv_resident.labels(**self._label).set_function(lambda: eng.cache.resident_bytes())
            self._resident_set = True
        used = eng.active
        lab = self._label
        self.running.labels(**lab).set(len(used))
        self.waiting.labels(**lab).set(sched.waiting)
        self.kv_rows_used.labels(**lab).set(len(used))
        self.kv_rows.labels(**lab).set(eng.cache.batch_size)
        self.kv_tokens.labels(**lab).set(sum(eng.cache.lengths[r.row] for r in used))
        self.kv_usage.labels(**lab).set(len(used) / max(eng.cache.batch_size, 1))
        self.kv_pool.labels(**lab).set(eng.kv_pool_tokens or 0)
        self.kv_pool_used.labels(**lab).set(eng.kv_tokens_used())
        self.preempted.labels(**lab).set(len(eng.preempted))
        new = eng.preemptions - self._preemptions
        if new > 0:
            self.preemptions.labels(**lab).inc(new)
            self._preemptions = eng.preemptions

    def observe_admit(self, job) -> None:
        self.prompt_tokens.labels(**self._label).inc(len(job.prompt))
        self.cached_tokens.labels(**self._label).inc(job.cached_tokens)

    def observe_round(self, result) -> None:
        lab = self._label
        if result.rows:
            self.rounds.labels(**lab).inc()
        for row in result.rows:
            self.chosen_k.labels(k=str(row.k), **lab).inc()
            if row.drafted:
                self.drafts.labels(**lab).inc()
                self.draft_tokens.labels(**lab).inc(row.drafted)
                self.accepted.labels(**lab).inc(row.accepted)
                for i in range(row.accepted):
                    self.accepted_pos.labels(position=str(i), **lab).inc()

    def observe_tokens(self, job, n: int, now: float) -> None:
        lab = self._label
        self.generation_tokens.labels(**lab).inc(n)
        if job.t_first is None:  # the first tokens out have a TTFT, not an inter-token gap
            self.ttft.labels(**lab).observe(now - job.t_submit)
            return
        gap = (now - job.t_last) / n  # a round's n tokens arrive together: each waited 1/n of it
        for _ in range(n):
            self.itl.labels(**lab).observe(gap)

    def observe_finish(self, job, reason: str) -> None:
        self.finished.labels(finish_reason=reason, **self._label).inc()
        self.e2e.labels(**self._label).observe(time.monotonic() - job.t_submit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
