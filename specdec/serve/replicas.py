"""`specdec serve --replicas N`: N engine replicas behind one OpenAI-compatible ingress, on Ray Serve
(the optional dependency `pip install 'specdec[ray]'`; docs/distributed.md).

Everything cluster-shaped is Ray Serve's: placement, health checks, replacing a dead replica,
autoscaling on queue length, sending a request to a replica and retrying when one refuses. What
is ours is small:
  - EngineReplica (a deployment, N replicas): one engine, its scheduler thread and the single
    server's app (specdec.serve.build), answering each relayed HTTP request in-process
    (specdec.serve.relay.run_asgi), so routes, checks, errors and streaming are the single
    server's. It reports health (Serve replaces it when its engine loop has stopped) and metrics.
  - Ingress (one replica): the HTTP face behind Serve's proxy. It refuses a wrong API key or an
    oversized body as the single server does, relays every other request to an engine replica
    through a DeploymentHandle whose request router is specdec.serve.routing.PrefixAffinityRouter
    (a repeated prompt prefix goes back to the replica holding its KV, the rest to the least
    loaded), streams the answer back, and merges every replica's /metrics under a `replica` label.
  - serve_replicas: the command. Starts Ray on this machine (or joins a cluster, --ray-address),
    Serve's HTTP proxy on --host/--port, the application, and stops it all on SIGINT / SIGTERM.

A replica whose process dies: its accepted requests end with a 503 in OpenAI's error shape (a
stream gets it as its last event), requests not yet sent to it go to the others (they wait at the
ingress, since a replica accepts only --max-batch at once), and Serve starts a replacement. Not
done: sharing KV between replicas, or retrying a request a dead replica had started (part of its
answer may already be with the client).

The engine loop runs on a thread of the replica process here, not on the main thread as in the
single server (Ray owns that thread), which costs ~15% of decode speed (specdec.serve.scheduler).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.errors import SpecdecError, check_range, show
from specdec.runtime.hub import resolve_model
from specdec.serve.app import MAX_BODY_BYTES, Output, error_body, refusal
from specdec.serve.build import build_served
from specdec.serve.relay import STREAM_END, RelayedCall, ReplicaMetrics, merge_metrics, prefix_key, run_asgi

APP = "specdec"
ENGINE = "EngineReplica"
ROUTER = "specdec.serve.routing:PrefixAffinityRouter"
# Serve kills its HTTP proxy after three readiness checks of 5 s each go unanswered; on a small
# machine whose cores are busy (replicas loading models, other jobs) the proxy can take longer
# to answer, and the server then failed to start (seen twice on 2 vCPUs under load).
PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
MAX_REPLICAS = 64
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 10.0, 120.0
DIED = ("the engine replica serving this request{where} stopped before finishing it (its process "
        "died); the request did not complete: retry it")
log = logging.getLogger("specdec.serve.replicas")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas under Ray Serve (pip install 'specdec[ray]'; docs/distributed.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help=f"run N engine replicas behind one ingress, in [1, {MAX_REPLICAS}]; with "
                        "--min/--max-replicas, the number to start with")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscaling: most replicas (default: --replicas or --min-replicas)")
    g.add_argument("--target-ongoing-requests", type=int, default=None,
                   help="autoscaling: requests per replica, running and queued, that it aims at "
                        "(default: --max-batch)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto', or HEAD_IP:6379) instead of starting one here")


@dataclass
class ReplicaPlan:
    initial: int
    bounds: tuple[int, int] | None  # (min, max) when autoscaling
    target: int | None  # autoscaling: ongoing requests per replica
    threads: int  # torch threads (and Ray CPUs) per replica

    @property
    def most(self) -> int:
        return self.bounds[1] if self.bounds else self.initial


def wanted(a) -> bool:
    """Whether the flags ask for replicas; the replica-only flags without them are an error."""
    on = any(v is not None for v in (a.replicas, a.min_replicas, a.max_replicas))
    for flag in ("target_ongoing_requests", "ray_address"):
        if not on and getattr(a, flag) is not None:
            raise SpecdecError(f"{flag}={show(getattr(a, flag))} needs --replicas (or --min-replicas / "
                               "--max-replicas); a single server has no replicas", flag)
    return on


def plan_replicas(a) -> ReplicaPlan:
    """The flags checked (each a one-line error naming it and its range) before Ray is touched."""
    if a.replicas is not None:
        check_range("replicas", a.replicas, 1, MAX_REPLICAS)
    if a.kv_cache_tokens is not None:  # Serve's per-replica limit is set before a model is loaded
        raise SpecdecError(f"kv_cache_tokens={a.kv_cache_tokens} does not go with --replicas: set each "
                           "replica's rows with --max-batch", "kv_cache_tokens")
    bounds, target = None, None
    if a.min_replicas is None and a.max_replicas is None:
        if a.target_ongoing_requests is not None:
            raise SpecdecError(f"target_ongoing_requests={a.target_ongoing_requests} needs autoscaling "
                               "(--min-replicas / --max-replicas)", "target_ongoing_requests")
        initial = a.replicas
    else:
        lo = 1 if a.min_replicas is None else a.min_replicas
        check_range("min_replicas", lo, 1, MAX_REPLICAS)
        hi = max(lo, a.replicas or lo) if a.max_replicas is None else a.max_replicas
        check_range("max_replicas", hi, lo, MAX_REPLICAS)
        initial = lo if a.replicas is None else a.replicas
        check_range("replicas", initial, lo, hi)
        target = a.max_batch if a.target_ongoing_requests is None else a.target_ongoing_requests
        check_range("target_ongoing_requests", target, 1, None)
        bounds = (lo, hi)
    cores, most = os.cpu_count() or 1, bounds[1] if bounds else initial
    threads = a.threads if a.threads is not None else max(1, cores // most)
    if a.ray_address is None and threads * most > cores:
        raise SpecdecError(f"threads={threads} x {most} replicas needs {threads * most} cores; this machine has "
                           f"{cores}: lower --threads or the replicas, or join a cluster (--ray-address)",
                           "threads")
    return ReplicaPlan(initial, bounds, target, threads)


def serve_replicas(a) -> int:
    plan = plan_replicas(a)
    ray, serve = _import_ray()
    if a.ray_address is None:  # fetch and check each model once here, not once per replica
        for name in (a.model, a.draft):
            if name is not None:
                resolve_model(name, weights=False)
    port = _port(a.host, a.port)
    a = argparse.Namespace(**{**vars(a), "threads": plan.threads})
    _start_ray(ray, a)
    stop = _stop_on_signal()  # after ray.init, whose own handlers it replaces
    try:
        serve.start(http_options={"host": a.host, "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(build_application(serve, a, plan), name=APP, route_prefix="/")
        info = serve.get_deployment_handle(ENGINE, APP).describe.remote().result(timeout_s=120)
        count = f"{plan.initial} replica{'s' * (plan.initial > 1)}"
        if plan.bounds is not None:
            count += f", autoscaling {plan.bounds[0]}-{plan.bounds[1]} at {plan.target} requests each"
        shown = f"[{a.host}]" if ":" in a.host else a.host
        threads = f"{plan.threads} thread{'s' * (plan.threads > 1)}"
        print(f"specdec: serving {info['name']!r} ({info['mode']}, {count}, {info['max_batch']} rows and "
              f"{threads} each, context {info['context']}) on http://{shown}:{port}/v1", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        _stop(ray, serve, a.ray_address is None)
    return 0


def build_application(serve, a, plan: ReplicaPlan):
    """The Serve application: Ingress bound to an EngineReplica deployment of `plan`."""
    from ray.serve.config import RequestRouterConfig

    scale = {"num_replicas": plan.initial} if plan.bounds is None else {"autoscaling_config": {
        "min_replicas": plan.bounds[0], "max_replicas": plan.bounds[1], "initial_replicas": plan.initial,
        "target_ongoing_requests": plan.target, "upscale_delay_s": UPSCALE_DELAY_S,
        "downscale_delay_s": DOWNSCALE_DELAY_S}}
    engine = serve.deployment(EngineReplica, name=ENGINE).options(
        ray_actor_options={"num_cpus": plan.threads},
        max_ongoing_requests=a.max_batch,  # the rest wait at the ingress: routable, and safe from a death
        max_queued_requests=a.max_waiting,  # then 429, as the single server's queue
        health_check_period_s=2, graceful_shutdown_timeout_s=5,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_router_kwargs={"imbalance_slack": a.max_batch}),
        **scale)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=plan.most * a.max_batch + a.max_waiting + 64)
    return ingress.bind(engine.bind(a), a.api_key)


class EngineReplica:
    """One engine with its scheduler thread and the single server's app, served to the ingress."""

    def __init__(self, a):
        from ray import serve

        torch.set_num_threads(a.threads)
        self.served = build_served(a, api_key=None, progress=log.info)  # the ingress checks the key
        self.served.scheduler.start()
        self.id = serve.get_replica_context().replica_id.unique_id

    async def relay(self, call: RelayedCall):
        """(status, headers, replica id), then the body's pieces."""
        async for item in run_asgi(self.served.app, call):
            yield (*item, self.id) if isinstance(item, tuple) else item

    def health(self) -> bool:
        return self.served.scheduler.alive

    def check_health(self) -> None:  # called by Serve; raising makes it replace this replica
        if not self.served.scheduler.alive:
            raise RuntimeError("the engine loop has stopped")

    def metrics(self) -> ReplicaMetrics:
        return ReplicaMetrics(self.id, socket.gethostname(), os.getpid(), self.served.metrics.render().decode())

    def describe(self) -> dict:
        s = self.served
        return {"name": s.name, "mode": s.mode, "max_batch": s.max_batch, "context": s.context}

    def __del__(self):
        served = getattr(self, "served", None)
        if served is not None:
            served.scheduler.stop(timeout=5)


class Ingress:
    """The HTTP face (Serve's ingress deployment): its app is built on the replica (late-bound)."""

    def __init__(self, engine, api_key: str | None):
        self.engine, self.api_key = engine, api_key

    def __serve_build_asgi_app__(self):
        return ingress_app(self.engine, self.api_key)


def ingress_app(engine, api_key: str | None) -> FastAPI:
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    streaming = engine.options(stream=True)

    @app.exception_handler(Exception)
    async def _on_crash(request, exc):
        log.error("ingress failure on %s: %r", request.url.path, exc)
        return _error(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health():
        up = sum(1 for ok in await _broadcast(engine, "health") if ok is True)
        if not up:
            return _error(503, "no engine replica is up", "internal_error")
        return {"status": "ok", "replicas": up}

    @app.get("/metrics")
    async def metrics():
        parts = [p for p in await _broadcast(engine, "metrics") if isinstance(p, ReplicaMetrics)]
        return Response(merge_metrics(parts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def relay(request: Request):
        refused = refusal(request, api_key, MAX_BODY_BYTES)
        if refused is not None:
            return refused
        body = await request.body()
        path = request.url.path
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
        call = RelayedCall(request.method, path, request.scope.get("query_string", b""), headers, body,
                           prefix_key(path, body))
        return await _forward(streaming, call)

    return app


def _error(status: int, message: str, kind: str = "internal_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, code=status), status_code=status)


async def _forward(streaming, call: RelayedCall) -> Response:
    """Relay `call` to an engine replica; a stream is passed on as it comes, anything else whole."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    gen = streaming.relay.remote(call)
    handed_on = False
    try:
        status, headers, replica = await gen.__anext__()
        headers = {k.decode(): v.decode() for k, v in headers if k.lower() != b"content-length"}
        headers["x-specdec-replica"] = replica
        if headers.get("content-type", "").startswith("text/event-stream"):
            handed_on = True
            return StreamingResponse(_pass_on(gen, replica), status_code=status, headers=headers)
        body = b"".join([chunk async for chunk in gen])
        return Response(body, status_code=status, headers=headers)
    except BackPressureError as e:  # args: (queued, most queued, ...)
        return _error(429, f"the waiting queue is full ({e.args[1]} requests); retry later", "rate_limit_error")
    except RayActorError:
        return _error(503, DIED.format(where=""))
    finally:
        if not handed_on:
            _cancel(gen)


async def _pass_on(gen, replica: str):
    from ray.exceptions import RayActorError

    try:
        async for chunk in gen:
            yield chunk
    except RayActorError:
        yield Output.sse(error_body(DIED.format(where=f" ({replica})"), "internal_error", code=503)).encode()
        yield STREAM_END
    finally:  # the client went away, or the stream ended: either way nothing more is wanted
        _cancel(gen)


def _cancel(gen) -> None:
    """Best effort, as Serve's cancel is; it re-raises a call's own failure (back-pressure, a dead
    replica), which has been answered already."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001 - nothing left to cancel
        pass


async def _broadcast(engine, method: str) -> list:
    try:
        return await engine.broadcast(method).results_async(timeout_s=10, return_exceptions=True)
    except TimeoutError:
        return []


def _import_ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecdecError("--replicas needs Ray Serve, which is not installed: pip install 'specdec[ray]'",
                           "replicas") from None
    return ray, serve


def _port(host: str, port: int) -> int:
    """The port for Serve's proxy, checked free here (0: a free one). Serve binds it itself (it
    takes a number, not a socket): a small race, but a busy port is a clear error, not a hang."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        return s.getsockname()[1]


def _start_ray(ray, a) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls home
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if a.ray_address is not None:
        ray.init(address=a.ray_address, **quiet)
    else:  # a new one-machine cluster (never another one found running here): every core for
        # replicas, a small object store (only messages go through it)
        for name, seconds in PROXY_PATIENCE.items():  # read by Serve's controller, which inherits them
            os.environ.setdefault(name, seconds)
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 _node_ip_address="127.0.0.1", object_store_memory=256 << 20, **quiet)


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _stop(ray, serve, own_cluster: bool) -> None:
    try:
        if own_cluster:
            serve.shutdown()
        else:
            serve.delete(APP)  # a shared cluster keeps Serve and its other applications
    finally:
        ray.shutdown()
