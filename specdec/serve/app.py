"""The OpenAI-compatible HTTP face (FastAPI): /v1/models, /v1/completions, /v1/chat/completions
(with SSE streaming), /health and /metrics.

A request is checked in full before anything is queued (every bad field is a 400 naming it and
what is allowed), split into one scheduler job per prompt and choice, and answered from the
jobs' events; a client that goes away aborts its jobs at once. Errors have OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import SpecdecError
from specdec.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest
from specdec.serve.scheduler import Event, Job, QueueFull

MAX_BODY_BYTES = 4 << 20
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|.*\[.*\]|function-.*)$")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code if code is not None else status), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem as one line naming the field, the value and what is allowed."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})", None
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    if err.get("type") == "missing":
        return f"{param} is required", param
    if err.get("type") == "extra_forbidden":
        return f"{param} is not a recognised field", param
    value = err.get("input")
    shown = json.dumps(value)[:80] if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return f"{param}={shown}: {err.get('msg', 'invalid value')}", param


def refusal(request: Request, api_key: str | None, max_body_bytes: int) -> JSONResponse | None:
    """The answer to a /v1 request refused before its body is read (401 wrong key, 413 too big),
    or None. Also the Ray Serve ingress's check (specdec.serve.replicas)."""
    if not request.url.path.startswith("/v1"):
        return None
    if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
        return _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                      "authentication_error", code="invalid_api_key")
    size = request.headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
        return _error(413, f"request body of {size} bytes; allowed at most {max_body_bytes}")
    return None


def create_app(scheduler, tokenizer, model_name: str, context_length: int, vocab: int,
               api_key: str | None = None, max_tokens_cap: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, metrics=None) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request, exc):
        msg, param = _validation_message(exc)
        return _error(400, msg, param=param)

    @app.exception_handler(BadRequest)
    async def _on_bad(request, exc: BadRequest):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request, exc):
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def _on_crash(request, exc):
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        return refusal(request, api_key, max_body_bytes) or await call_next(request)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return _error(503, "the engine loop has stopped", "internal_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return _error(404, "metrics are off", "not_found_error")
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specdec", "max_model_len": context_length}]}

    # ---- shared by both completion endpoints ---------------------------------------------------
    def check_model(body) -> None:
        if body.model is not None and body.model != model_name:
            raise BadRequest(f"model {body.model!r} is not served here; allowed: {model_name!r}",
                             "model", status=404, kind="not_found_error")

    def plan_jobs(body, prompts: list[list[int]], logprobs: int | None, prompt_field: str):
        """[(prompt index, SamplingParams)] per choice, every limit checked first."""
        out = []
        for p_i, ids in enumerate(prompts):
            if not ids:
                raise BadRequest(f"{prompt_field} is empty; it needs at least 1 token", prompt_field)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"{prompt_field} has token id {bad}; allowed [0, {vocab})", prompt_field)
            room = context_length - len(ids)
            if room < 1:
                raise BadRequest(f"{prompt_field} has {len(ids)} tokens; this model's context is "
                                 f"{context_length}, so allowed at most {context_length - 1}", prompt_field)
            wanted = body.wanted_max_tokens()
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            if wanted is not None and wanted > room:
                raise BadRequest(f"{field}={wanted} but the prompt has {len(ids)} tokens and the context "
                                 f"is {context_length}: allowed at most {room}", field)
            if wanted is not None and max_tokens_cap is not None and wanted > max_tokens_cap:
                raise BadRequest(f"{field}={wanted}; this server allows at most {max_tokens_cap}", field)
            mt = wanted if wanted is not None else min(room, max_tokens_cap or room)
            for j in range(body.n):  # with a seed, choice j samples with seed + j
                out.append((p_i, ids, body.sampling_params(mt, logprobs, vocab, choice=j)))
        return out

    async def run(request: Request, body, prompts, logprobs, chat: bool, prompt_field: str):
        check_model(body)
        body.check_unsupported()
        planned = plan_jobs(body, prompts, logprobs, prompt_field)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink_for(i):
            def sink(ev: Event):
                try:
                    loop.call_soon_threadsafe(q.put_nowait, (i, ev))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return sink

        jobs = [Job(ids, params, sink_for(i)) for i, (_, ids, params) in enumerate(planned)]
        try:
            for job in jobs:
                scheduler.submit(job)
        except QueueFull as e:
            for job in jobs:
                scheduler.abort(job)
            return _error(429, str(e), "rate_limit_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        out = Output(rid, model_name, chat, tokenizer, jobs, [p for p, _, _ in planned], prompts, body.stream)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(out, q, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while not out.all_done:
                try:
                    i, ev = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                out.take(i, ev)
                if ev.kind == "error":
                    return _error(ev.status, ev.error, "internal_error" if ev.status >= 500 else "invalid_request_error")
            return out.response()
        finally:
            for job in jobs:
                if not out.done[jobs.index(job)]:
                    scheduler.abort(job)

    async def stream(out: "Output", q: asyncio.Queue, include_usage: bool):
        try:
            if out.chat:
                for i in range(len(out.jobs)):
                    yield out.sse(out.chunk(i, {"role": "assistant", "content": ""}, None, None))
            while not out.all_done:
                i, ev = await q.get()
                lp = out.take(i, ev)
                if ev.kind == "error":
                    yield out.sse(error_body(ev.error, "internal_error" if ev.status >= 500 else "invalid_request_error",
                                             code=ev.status))
                    break
                if ev.kind == "delta" and (ev.text or lp is not None):
                    delta = {"content": ev.text} if out.chat else ev.text
                    yield out.sse(out.chunk(i, delta, lp, None))
                elif ev.kind == "done":
                    yield out.sse(out.chunk(i, {} if out.chat else "", None, ev.finish_reason))
            else:
                if include_usage:
                    yield out.sse({"id": out.id, "object": out.object, "created": out.created,
                                   "model": out.model, "choices": [], "usage": out.usage()})
            yield "data: [DONE]\n\n"
        finally:  # a client that disconnects cancels this generator: free its rows now
            for j, job in enumerate(out.jobs):
                if not out.done[j]:
                    scheduler.abort(job)

    # ---- endpoints -----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, str):
            prompts = [tokenizer.encode(p)] if p else [[]]
        elif p and isinstance(p[0], str):
            prompts = [tokenizer.encode(s) if s else [] for s in p]
        elif p and isinstance(p[0], list):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        if not prompts:
            raise BadRequest("prompt is an empty list; it needs at least 1 prompt", "prompt")
        return await run(request, body, prompts, body.logprobs, chat=False, prompt_field="prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]
        try:
            ids = tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False)
        except SpecdecError as e:
            raise BadRequest(str(e), "messages") from None
        except Exception as e:  # a template that cannot render these messages
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await run(request, body, [ids], logprobs, chat=True, prompt_field="messages")

    return app


class Output:
    """What has come back for one API request's jobs, and its OpenAI-shaped rendering."""

    def __init__(self, rid, model, chat, tokenizer, jobs, prompt_of, prompts, streaming):
        self.id, self.model, self.chat, self.tok = rid, model, chat, tokenizer
        self.streaming = streaming  # logprobs rendered per event; else once, in response()
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.jobs, self.prompt_of, self.prompts = jobs, prompt_of, prompts
        n = len(jobs)
        self.text = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.lps: list[list] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.done = [False] * n
        self.offset = [0] * n  # text_offset of the next token (completions logprobs)

    @property
    def all_done(self) -> bool:
        return all(self.done)

    def take(self, i: int, ev: Event):
        """Record an event; returns its logprobs rendered for the API (None when not asked)."""
        if ev.kind == "delta":
            self.text[i] += ev.text
            self.tokens[i] += ev.token_ids
            if ev.logprobs is not None:
                self.lps[i] += ev.logprobs
                return self.render_logprobs(i, ev.logprobs) if self.streaming else None
        elif ev.kind == "done":
            self.finish[i], self.done[i] = ev.finish_reason, True
        else:
            self.done = [True] * len(self.done)
        return None

    def _piece(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def render_logprobs(self, i: int, lps: list):
        if self.chat:
            return {"content": [{"token": self._piece(x.token), "logprob": x.logprob,
                                 "bytes": list(self._piece(x.token).encode()),
                                 "top_logprobs": [{"token": self._piece(t), "logprob": v,
                                                   "bytes": list(self._piece(t).encode())} for t, v in x.top]}
                                for x in lps]}
        tokens = [self._piece(x.token) for x in lps]
        offsets = []
        for s in tokens:
            offsets.append(self.offset[i])
            self.offset[i] += len(s)
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": [{self._piece(t): v for t, v in x.top} for x in lps],
                "text_offset": offsets}

    def usage(self) -> dict:
        firsts = {}
        for j, p in enumerate(self.prompt_of):
            firsts.setdefault(p, j)
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(t) for t in self.tokens)
        cached = sum(self.jobs[j].cached_tokens for j in firsts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(self, i: int, delta, logprobs, finish_reason) -> dict:
        choice = {"index": i, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["delta" if self.chat else "text"] = delta
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}

    @staticmethod
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def response(self) -> dict:
        choices = []
        for i in range(len(self.jobs)):
            lp = None
            if self.jobs[i].params.logprobs is not None:
                lp = self.render_logprobs(i, self.lps[i])
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.text[i]},
                                "logprobs": lp, "finish_reason": self.finish[i]})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": lp,
                                "finish_reason": self.finish[i]})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
