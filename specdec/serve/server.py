"""`specdec serve`: load the models, build the engine, start the engine loop and uvicorn; with
`--replicas` (or `--min-replicas` / `--max-replicas`), several engines under Ray Serve instead
(specdec.serve.replicas).

Binds 127.0.0.1 unless told otherwise. The listening socket is opened here (port 0 takes a free
port) so the printed URL is the one really served.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading

import torch
import uvicorn

from specdec.errors import SpecdecError, check_range
from specdec.serve import replicas
from specdec.serve.build import build_served

DEFAULT_PREFILL_CHUNK = 256


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0 for a free one (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (KV rows; default 8)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond the batch before the server answers 429 (default 256)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"most prompt tokens prefilled per round, so a long prompt stalls running "
                        f"requests one chunk at a time (default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--max-tokens-cap", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="the KV pool in tokens, shared by all rows (at least the context): a request "
                        "holds memory for its own length; when the pool is full new requests wait "
                        "and the newest running ones are preempted and recomputed later (default: "
                        "no pool, each row may hold a whole context)")
    replicas.add_replica_args(p)


def cmd_serve(a) -> int:
    check_range("port", a.port, 0, 65535)
    check_range("max_batch", a.max_batch, 1, 256)
    check_range("max_waiting", a.max_waiting, 0, None)
    check_range("prefill_chunk", a.prefill_chunk, 1, None)
    if a.max_tokens_cap is not None:
        check_range("max_tokens_cap", a.max_tokens_cap, 1, None)
    if a.threads is not None:
        check_range("threads", a.threads, 1, None)
    if replicas.wanted(a):
        return replicas.serve_replicas(a)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as e:
        raise SpecdecError(f"cannot listen on {a.host}:{a.port}: {e.strerror}") from None
    progress = (lambda s: print(s, file=sys.stderr, flush=True))
    served = build_served(a, a.api_key, progress)
    sched = served.scheduler
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    pool = "" if a.kv_cache_tokens is None else f", KV pool {a.kv_cache_tokens} tokens"
    print(f"specdec: serving {served.name!r} ({served.mode}, {served.max_batch} rows{pool}, context {served.context}) "
          f"on http://{shown}:{port}/v1", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # uvicorn on a thread of its own (it installs no signal handlers there), the engine loop on
    # the main thread (specdec.serve.scheduler says why); SIGINT / SIGTERM end both.
    web = uvicorn.Server(uvicorn.Config(served.app, log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=5))
    web_thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, name="specdec-web", daemon=True)
    web_thread.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sched.request_stop())
    try:
        sched.run()
    finally:
        web.should_exit = True
        web_thread.join(10)
    return 0
