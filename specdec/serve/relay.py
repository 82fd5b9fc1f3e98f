"""What passes between the Ray Serve ingress and an engine replica, without Ray: one HTTP request
relayed whole (`RelayedCall`), an ASGI app run in-process on it (`run_asgi`), the key that
prefix-affinity routing reads (`prefix_key`), and the replicas' /metrics merged into one
exposition with a `replica` label (`merge_metrics`).

A replica answers a relayed call with the very app `specdec serve` runs (specdec.serve.app), so
the routes, checks, errors and streaming are the single server's, byte for byte. This module knows
nothing of engines, Ray or routing policy; specdec.serve.replicas puts it to work.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field

# Prompts whose first AFFINITY_CHARS characters agree share a key: long enough that a shared
# system prompt or an earlier chat turn (the prefixes worth reusing) decides it, short enough
# that the rest of the prompt does not split them.
AFFINITY_CHARS = 256
AFFINITY_ROUTES = ("/v1/completions", "/v1/chat/completions")
STREAM_END = b"data: [DONE]\n\n"


@dataclass
class RelayedCall:
    """One HTTP request as the ingress read it: an engine replica replays it on its own app."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    prefix_key: str | None = None  # set on completion routes with a prompt (routing reads it)


def prefix_key(path: str, body: bytes, chars: int = AFFINITY_CHARS) -> str | None:
    """A short hash of the prompt's first `chars` characters (the whole prompt when shorter), or
    None when the request has no prompt to reuse (another route, a body that is not JSON). For chat
    the messages' roles and contents are the text; token-id prompts hash their JSON."""
    if path not in AFFINITY_ROUTES:
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    text = _chat_text(req.get("messages")) if path.endswith("chat/completions") else _prompt_text(req.get("prompt"))
    if not text:
        return None
    return hashlib.blake2b(text[:chars].encode("utf-8", "replace"), digest_size=8).hexdigest()


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: keyed by its first
    return prompt if isinstance(prompt, str) else json.dumps(prompt) if isinstance(prompt, list) else ""


def _chat_text(messages) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"{m.get('role')}\x00{content if isinstance(content, str) else json.dumps(content)}\x00")
    return "".join(parts)


async def run_asgi(app, call: RelayedCall):
    """Serve `call` with the ASGI `app` in this process. Yields (status, headers) once, then the
    body in the pieces the app sends them. Closing the generator early is the client going away:
    the app sees http.disconnect and is cancelled, so its own clean-up (aborting jobs) runs."""
    sent = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive():
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(_scope(call), receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (msg := await sent.get()) is not None:
            if msg["type"] == "http.response.start":
                yield msg["status"], [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
        await task  # an exception inside the app surfaces here
    finally:
        gone.set()
        if not task.done():
            task.cancel()


def _scope(call: RelayedCall) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "query_string": call.query, "root_path": "", "headers": call.headers,
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}


# ---- /metrics of several replicas as one exposition ------------------------------------------------
@dataclass
class ReplicaMetrics:
    """One replica's /metrics text and where it runs (operators find a replica by node and pid)."""

    replica: str
    node: str
    pid: int
    text: str


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def _label(line: str, replica: str) -> str:
    m = _SAMPLE.match(line)
    if m is None:
        return line
    name, _, labels, rest = m.groups()
    extra = f'replica="{replica}"' + (f",{labels}" if labels else "")
    return f"{name}{{{extra}}}{rest}"


def merge_metrics(parts: list[ReplicaMetrics]) -> str:
    """Every replica's samples under one HELP/TYPE per metric family, each sample labelled with
    its replica; first a `specdec_replica_info` family, one sample per replica (node, pid).
    Totals over replicas are sums over the label (`sum without (replica) (...)`)."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP/TYPE lines, samples)
    info = ["# HELP specdec_replica_info Engine replicas answering /metrics (node, process id)",
            "# TYPE specdec_replica_info gauge"]
    for p in sorted(parts, key=lambda p: p.replica):
        info.append(f'specdec_replica_info{{replica="{p.replica}",node="{p.node}",pid="{p.pid}"}} 1.0')
        family = None
        for line in p.text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                head, _ = families.setdefault(family, ([], []))
                if len(head) < 2 and line not in head:
                    head.append(line)
            elif line and not line.startswith("#") and family is not None:
                families[family][1].append(_label(line, p.replica))
    out = info[:]
    for head, samples in families.values():
        out += head + samples
    return "\n".join(out) + "\n"
