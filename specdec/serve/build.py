"""One engine's serving stack from the `specdec serve` flags: models -> engine -> scheduler (not yet
running) -> the HTTP app with its metrics. The single server (specdec.serve.server) and each Ray
Serve replica (specdec.serve.replicas) build exactly this; where it runs and who starts the loop is
theirs to decide.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from specdec.api import context_length
from specdec.loader import build_engine, load_models
from specdec.serve.app import create_app
from specdec.serve.metrics import ServerMetrics
from specdec.serve.scheduler import Scheduler
from specdec.tools.commands import spec_config


@dataclass
class Served:
    scheduler: Scheduler
    app: FastAPI
    metrics: ServerMetrics
    name: str  # the model id clients send
    context: int
    max_batch: int  # KV rows
    mode: str  # "plain decoding" or "speculative (proposer, k=...)", for the start-up line


def build_served(a, api_key: str | None, progress=None) -> Served:
    spec = spec_config(a)
    draft = a.draft if spec is not None and spec.proposer in ("draft", "composite") else None
    models = load_models(a.model, draft, a.dtype, spec.draft_dtype if spec else "auto", a.device, progress,
                         a.max_model_len)
    ctx = context_length(models, a.max_model_len)  # above the model's own: an error, not a cap
    max_batch = a.max_batch
    engine = build_engine(models, spec, max_model_len=ctx, max_batch=max_batch)
    engine.set_kv_pool(a.kv_cache_tokens)  # rows hold their own length; the pool bounds them all
    engine.prefill_chunk = a.prefill_chunk
    name = a.served_model_name or a.model
    metrics = ServerMetrics(name)
    sched = Scheduler(engine, max_waiting=a.max_waiting, metrics=metrics)
    app = create_app(sched, models.tokenizer, name, ctx, engine.V, api_key=api_key,
                     max_tokens_cap=a.max_tokens_cap, metrics=metrics)
    mode = "plain decoding" if spec is None else f"speculative ({spec.proposer}, k={spec.num_draft_tokens})"
    return Served(sched, app, metrics, name, ctx, max_batch, mode)
