"""The serving loop: one engine thread admits, steps and streams; the web side only submits and
aborts. `specdec serve` runs it on the main thread (`run`) and the web server beside it: torch's
CPU kernels run ~15% slower called from a second thread than from the main one here.

Continuous batching: requests join and leave between rounds. A submitted job waits in a FCFS
queue (bounded: a full queue refuses at once, the server answers 429) until the engine has a free
row and room in its KV pool for it (a request the pool preempts waits inside the engine, its
stream paused, and resumes before anything new is admitted); every round serves every admitted request, and a long prompt is prefilled a chunk per
round (Engine.prefill_chunk) so the running rows never wait a whole prompt. An abort (client gone,
timeout) frees the request's target and draft rows before the next round. A failure inside a
round ends the requests of that round with an error and the loop goes on serving.

Events reach a job through its `sink`, called on the engine thread: the web side hands them to
its event loop (asyncio.loop.call_soon_threadsafe). Nothing here knows HTTP.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from specdec.config import SamplingParams
from specdec.errors import SpecdecError

log = logging.getLogger("specdec.serve")


class QueueFull(Exception):
    """The waiting queue is at its limit: try again later (HTTP 429)."""


@dataclass
class Event:
    kind: str  # "delta" | "done" | "error"
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # [specdec.request.TokenLogprob] for token_ids
    finish_reason: str | None = None  # on "done"
    error: str | None = None  # on "error"
    status: int = 500  # on "error": 400 for the request's own fault


@dataclass(eq=False)
class Job:
    """One sequence to generate (one choice of an API request)."""

    prompt: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    t_submit: float = field(default_factory=time.monotonic)
    t_first: float | None = None  # first token out (TTFT = t_first - t_submit)
    t_last: float | None = None
    request: object | None = None  # the engine's Request once admitted
    cancelled: bool = False

    @property
    def output_tokens(self) -> int:
        return 0 if self.request is None else len(self.request.output)

    @property
    def cached_tokens(self) -> int:
        return 0 if self.request is None else self.request.cached_tokens


class Scheduler:
    def __init__(self, engine, max_waiting: int = 256, metrics=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics  # specdec.serve.metrics.ServerMetrics, or None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # engine request id -> job
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet admitted or aborted
        self._stop = threading.Event()
        self._live = threading.Event()
        self._thread: threading.Thread | None = None
        engine.reserve(engine.max_batch)
        if metrics is not None:
            metrics.observe_state(self)  # the gauges hold the engine's state from the start

    def run(self) -> None:
        """The loop, on the calling thread, until `request_stop`."""
        self._live.set()
        try:
            self._loop()
        finally:
            self._live.clear()

    def start(self) -> None:
        """The loop on a thread of its own (tests, embedding)."""
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Safe from a signal handler: the loop ends after its current round."""
        self._stop.set()
        self._inbox.put(("wake", None))

    def stop(self, timeout: float = 10.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the web side (any thread) -------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._lock:
            if self._queued >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            self._queued += 1
        self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        job.cancelled = True
        self._inbox.put(("abort", job))

    @property
    def waiting(self) -> int:
        return self._queued

    @property
    def alive(self) -> bool:
        return self._live.is_set()

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.active and not self.engine.preempted and not self._waiting
            self._drain(block=idle)
            self._admit()
            if self.engine.active or self.engine.preempted:
                self._round()
            if self.metrics is not None:
                self.metrics.observe_state(self)
        for job in list(self._running.values()) + list(self._waiting):
            job.sink(Event("error", error="the server is shutting down", status=503))
        self.engine.abort_all()

    def _drain(self, block: bool) -> None:
        try:
            cmd, job = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                if job.cancelled:
                    self._unqueue()
                else:
                    self._waiting.append(job)
            elif cmd == "abort":
                self._abort(job)
            try:
                cmd, job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _unqueue(self) -> None:
        with self._lock:
            self._queued -= 1

    def _abort(self, job: Job) -> None:
        if job in self._waiting:
            self._waiting.remove(job)
            self._unqueue()
        elif job.request is not None and self._running.pop(job.request.id, None) is not None:
            self.engine.abort(job.request)
            if self.metrics is not None:
                self.metrics.observe_finish(job, "abort")

    def _admit(self) -> None:
        while self._waiting and self.engine.can_admit(len(self._waiting[0].prompt)):
            job = self._waiting.popleft()
            self._unqueue()
            try:
                job.request = self.engine.add_request(job.prompt, job.params)
            except SpecdecError as e:  # checked by the web side already: a last guard
                job.sink(Event("error", error=str(e), status=400))
                continue
            self._running[job.request.id] = job
            if self.metrics is not None:
                self.metrics.observe_admit(job)

    def _round(self) -> None:
        try:
            result = self.engine.step()
        except Exception:  # noqa: BLE001 - one bad round must not take the server down
            log.error("a round failed; its requests end with an error:\n%s", traceback.format_exc())
            for job in list(self._running.values()):
                job.sink(Event("error", error="internal error while generating", status=500))
            self._running.clear()
            self.engine.abort_all()
            return
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.observe_round(result)
        for row in result.rows:
            job = self._running.get(row.request.id)
            if job is None:
                continue
            if self.metrics is not None:
                self.metrics.observe_tokens(job, len(row.committed), now)
            job.t_first = job.t_first or now
            job.t_last = now
            job.sink(Event("delta", text=row.delta, token_ids=row.committed, logprobs=row.logprobs))
            if row.request.finished:
                del self._running[row.request.id]
                if self.metrics is not None:
                    self.metrics.observe_finish(job, row.request.finish_reason)
                job.sink(Event("done", finish_reason=row.request.finish_reason))
