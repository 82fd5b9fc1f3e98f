"""`specdec serve --replicas 2` under Ray Serve, as users run it: a subprocess starting a
one-machine Ray cluster on loopback, two engine replicas (SmolLM2-135M, n-gram proposer, k = 4,
4 rows and 1 thread each) behind one ingress.

The single server's openai-client tests (tests/test_server.py) run here unchanged: imported, they
take this module's `spec_server`. Then what replicas add: a repeated prompt prefix stays on one
replica (seen in the per-replica /metrics), new prompts go to the least loaded replica, and a
replica killed mid-load fails only the requests it had accepted, with a clear 503, while the rest
finish and Serve starts a replacement. Without Ray: the flags' errors, and the relay helpers.

Ray is imported at the top on purpose: the test extra installs it, so these tests run, never skip.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import ray  # noqa: F401  (a hard requirement: see the docstring)

from specdec.cli import main
from specdec.serve.relay import RelayedCall, ReplicaMetrics, merge_metrics, prefix_key, run_asgi
from test_server import (KEY, MODEL, client, metric, plain_llm, raw, start_server,  # noqa: F401
                         stop_server, test_bad_input_is_a_clear_4xx_and_touches_no_other_request,
                         test_chat_and_completions_streaming_equal_non_streaming,
                         test_concurrent_greedy_requests_equal_plain_alone,
                         test_disconnect_mid_stream_frees_the_row, test_eos_inside_an_accepted_run_leaks_nothing,
                         test_health_models_and_api_key, test_n_choices_and_seed_reproduce,
                         test_stop_string_across_tokens_leaks_nothing, test_structured_output)

ROWS = 4  # per replica: 16 concurrent requests leave 8 waiting at the ingress


@pytest.fixture(scope="module")
def spec_server():
    proc, url = start_server("--proposer", "ngram", "--num-draft-tokens", "4", "--max-batch", str(ROWS),
                             "--api-key", KEY, "--replicas", "2", "--threads", "1", ready_timeout=240)
    yield url
    stop_server(proc)


def replicas_up(url) -> dict[str, int]:
    """replica id -> pid, from specdec_replica_info in the merged /metrics."""
    _, text = raw(url, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("specdec_replica_info{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[labels["replica"].strip('"')] = int(labels["pid"].strip('"'))
    return out


def wait_for_replicas(url, n: int, timeout: float = 120) -> dict[str, int]:
    deadline = time.time() + timeout
    while (up := replicas_up(url)) and len(up) != n and time.time() < deadline:
        time.sleep(1)
    assert len(up) == n, up
    return up


def test_metrics_are_per_replica_and_sum_to_the_totals(spec_server, client):
    up = wait_for_replicas(spec_server, 2)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    total = metric(spec_server, "specdec_request_finished_total")
    assert total == sum(metric(spec_server, "specdec_request_finished_total", replica=r) for r in up) > 0
    assert metric(spec_server, "specdec_kv_cache_rows") == 2 * ROWS


def test_a_repeated_prefix_stays_on_one_replica(spec_server, client):
    """Four prompts sharing a 400-character prefix (past the 256 the key reads) land on one
    replica, whose prefix cache serves the shared part from the second on; the other replica
    sees none of them."""
    up = wait_for_replicas(spec_server, 2)
    shared = "You are a careful assistant who answers in one short sentence. " * 7
    before = {r: (metric(spec_server, "specdec_request_finished_total", replica=r),
                  metric(spec_server, "specdec_prefix_cache_hit_tokens_total", replica=r)) for r in up}
    seen = set()
    for i in range(4):
        r = client.completions.with_raw_response.create(model=MODEL, prompt=f"{shared}Question {i}: why?",
                                                        max_tokens=2, temperature=0)
        seen.add(r.headers["x-specdec-replica"])
    assert len(seen) == 1, seen
    (holder,) = seen
    for r in up:
        finished = metric(spec_server, "specdec_request_finished_total", replica=r) - before[r][0]
        cached = metric(spec_server, "specdec_prefix_cache_hit_tokens_total", replica=r) - before[r][1]
        assert finished == (4 if r == holder else 0), (r, finished)
        assert (cached >= 3 * 60) if r == holder else cached == 0, (r, cached)  # ~80 shared tokens


def open_stream(url, prompt, max_tokens=200):
    """A streaming completion opened with raw HTTP: (connection, response) once headers are in."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    return conn, conn.getresponse()


def test_new_prompts_go_to_the_least_loaded_replica(spec_server):
    wait_for_replicas(spec_server, 2)
    first = open_stream(spec_server, "Spell the alphabet backwards:")
    assert first[1].fp.readline()  # running on its replica
    second = open_stream(spec_server, "Name every planet, slowly:")
    try:
        assert first[1].getheader("x-specdec-replica") != second[1].getheader("x-specdec-replica")
    finally:
        for conn, _ in (first, second):
            conn.close()


def read_stream(resp) -> dict:
    """How a stream ended: 'length' (complete, [DONE] seen) or the error event's message."""
    end = {"finish": None, "error": None, "done": False}
    for line in resp:
        line = line.decode().strip()
        if line == "data: [DONE]":
            end["done"] = True
        elif line.startswith("data: "):
            ev = json.loads(line[6:])
            if "error" in ev:
                end["error"] = ev["error"]
            elif ev["choices"][0]["finish_reason"]:
                end["finish"] = ev["choices"][0]["finish_reason"]
    return end


def test_killing_a_replica_fails_only_what_it_had_accepted(spec_server, client):
    """12 streams on 2 replicas of 4 rows: 8 start, 4 wait at the ingress. One replica's process
    is killed (SIGKILL) while they run. The streams it was serving (at most its 4 rows) end with a
    503 error event naming it; every other stream, the 4 that were waiting included, completes;
    Serve replaces the dead replica and the deployment serves again."""
    up = wait_for_replicas(spec_server, 2)
    results: dict[int, dict] = {}
    started = threading.Semaphore(0)

    def one(i):
        conn, resp = open_stream(spec_server, f"Count from {i * 100}:", max_tokens=120)
        try:
            results[i] = {"replica": resp.getheader("x-specdec-replica"), "status": resp.status,
                          "at": time.monotonic()}
            started.release()
            results[i].update(read_stream(resp))
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for _ in range(2 * ROWS):
        assert started.acquire(timeout=120)
    victim = next(iter(results.values()))["replica"]
    killed_at = time.monotonic()
    os.kill(up[victim], signal.SIGKILL)
    for t in threads:
        t.join(240)
    assert len(results) == 12 and all("done" in r for r in results.values()), results
    lost = [r for r in results.values() if r["replica"] == victim]
    assert 1 <= len(lost) <= ROWS
    for r in lost:  # accepted by the victim before it died: a clear error, then the stream's end
        assert r["error"]["code"] == 503 and victim in r["error"]["message"], r
        assert "stopped before finishing" in r["error"]["message"] and r["done"], r
    others = [r for r in results.values() if r["replica"] != victim]
    assert all(r["finish"] == "length" and r["done"] and r["error"] is None for r in others), others
    assert any(r["at"] > killed_at for r in others)  # some had waited at the ingress: not lost
    after = wait_for_replicas(spec_server, 2, timeout=180)  # replaced
    assert victim not in after
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load():
    """--min-replicas 1 --max-replicas 2 at 2 requests per replica (2 rows each): 6 clients
    keep ~3 requests queued beyond the first replica's rows for 75 s at most; Serve adds the
    second replica (10 s above target, then its model load). About a minute: `make test-slow`."""
    proc, url = start_server("--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
                             "--max-batch", "2", "--threads", "1", ready_timeout=240)
    stop = time.time() + 75
    try:
        def load(i):
            while time.time() < stop and len(replicas_up(url)) < 2:
                raw(url, "POST", "/v1/completions", {"prompt": f"Count from {i}:", "max_tokens": 40,
                                                     "ignore_eos": True}, key=None)

        assert len(replicas_up(url)) == 1
        clients = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(120)
        assert len(replicas_up(url)) == 2
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_full_queue_answers_429_and_recovers():
    """One replica of 1 row and a queue of 1 at the ingress: of 5 at once, at least one gets the
    single server's 429, at least two finish, and the next request is served."""
    proc, url = start_server("--replicas", "1", "--max-batch", "1", "--max-waiting", "1", "--threads", "1",
                             ready_timeout=240)
    try:
        def ask(_):
            status, text = raw(url, "POST", "/v1/completions", {"prompt": "Count: 1, 2,", "max_tokens": 30,
                                                                "ignore_eos": True}, key=None)
            assert status in (200, 429), text
            return json.loads(text)["choices"][0]["finish_reason"] if status == 200 else json.loads(text)

        with ThreadPoolExecutor(5) as ex:
            got = list(ex.map(ask, range(5)))
        refused = [g for g in got if isinstance(g, dict)]
        assert refused and got.count("length") >= 2, got
        assert refused[0]["error"]["type"] == "rate_limit_error" and "queue is full" in refused[0]["error"]["message"]
        assert ask(0) == "length"
    finally:
        stop_server(proc)


# ---- without Ray: flags and helpers ------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--replicas", "0"], "replicas=0 is out of range; allowed [1, 64]"),
    (["--replicas", "65"], "replicas=65 is out of range; allowed [1, 64]"),
    (["--min-replicas", "3", "--max-replicas", "2"], "max_replicas=2 is out of range; allowed [3, 64]"),
    (["--min-replicas", "0"], "min_replicas=0 is out of range; allowed [1, 64]"),
    (["--replicas", "5", "--max-replicas", "4"], "replicas=5 is out of range; allowed [1, 4]"),
    (["--replicas", "2", "--target-ongoing-requests", "4"], "target_ongoing_requests=4 needs autoscaling"),
    (["--max-replicas", "2", "--target-ongoing-requests", "0"], "target_ongoing_requests=0 is out of range"),
    (["--target-ongoing-requests", "4"], "target_ongoing_requests=4 needs --replicas"),
    (["--ray-address", "auto"], "ray_address='auto' needs --replicas"),
    (["--replicas", "2", "--threads", "100000"], "threads=100000 x 2 replicas needs 200000 cores"),
    (["--replicas", "2", "--kv-cache-tokens", "4096"], "kv_cache_tokens=4096 does not go with --replicas"),
])
def test_bad_replica_flags_are_one_line_errors(flags, named, capsys):
    assert main(["serve", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err


def test_without_ray_the_error_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert main(["serve", "--port", "0", "--replicas", "1"]) == 2
    assert "pip install 'specdec[ray]'" in capsys.readouterr().err


def test_a_busy_port_is_a_clear_error_before_ray_starts(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port), "--replicas", "1"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_prefix_key():
    c, ch = "/v1/completions", "/v1/chat/completions"
    long = "x" * 300

    def key(path, body):
        return prefix_key(path, json.dumps(body).encode())

    assert key(c, {"prompt": long + "a"}) == key(c, {"prompt": long + "b"})  # past 256 characters
    assert key(c, {"prompt": "short a"}) != key(c, {"prompt": "short b"})
    assert key(c, {"prompt": "same"}) == key(c, {"prompt": ["same", "other"]})
    assert key(c, {"prompt": [1, 2, 3]}) == key(c, {"prompt": [[1, 2, 3]]}) != key(c, {"prompt": [1, 2]})
    sys_msg = {"role": "system", "content": long}
    assert key(ch, {"messages": [sys_msg, {"role": "user", "content": "a"}]}) == \
        key(ch, {"messages": [sys_msg, {"role": "user", "content": "b"}]})
    user = [{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]
    assert key(ch, {"messages": user[0]}) != key(ch, {"messages": user[1]})
    assert prefix_key(c, b"{not json") is None and key(c, {"prompt": ""}) is None
    assert key("/v1/models", {"prompt": "x"}) is None and key(c, ["a list"]) is None


def test_merge_metrics_labels_every_sample_and_keeps_one_header():
    text = ("# HELP specdec_rounds_total Engine rounds\n# TYPE specdec_rounds_total counter\n"
            'specdec_rounds_total{model_name="m"} 3.0\n# HELP up Up\n# TYPE up gauge\nup 1.0\n')
    merged = merge_metrics([ReplicaMetrics("b", "n1", 7, text), ReplicaMetrics("a", "n0", 5, text)])
    lines = merged.splitlines()
    assert lines.count("# TYPE specdec_rounds_total counter") == 1 and lines.count("# TYPE up gauge") == 1
    assert 'specdec_rounds_total{replica="a",model_name="m"} 3.0' in lines
    assert 'specdec_rounds_total{replica="b",model_name="m"} 3.0' in lines
    assert 'up{replica="a"} 1.0' in lines and 'up{replica="b"} 1.0' in lines
    assert 'specdec_replica_info{replica="a",node="n0",pid="5"} 1.0' in lines
    i = lines.index("# TYPE up gauge")  # a family's samples follow its own header
    assert lines[i + 1:] == ['up{replica="a"} 1.0', 'up{replica="b"} 1.0']


def test_run_asgi_streams_and_tells_the_app_when_the_client_goes():
    """The relay hands the app the body, passes its pieces on, and closing it early is a
    disconnect the app sees (its `finally` runs), as under uvicorn."""
    import asyncio

    seen = {}

    async def app(scope, receive, send):
        seen["body"] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        try:
            for i in range(1000):
                await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
                await asyncio.sleep(0)
        finally:
            seen["ended"] = True

    async def go():
        gen = run_asgi(app, RelayedCall("POST", "/x", body=b"hello"))
        start = await gen.__anext__()
        pieces = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        await asyncio.sleep(0.01)
        return start, pieces

    start, pieces = asyncio.run(go())
    assert start == (200, [(b"content-type", b"text/plain")]) and pieces == [b"0;", b"1;", b"2;"]
    assert seen == {"body": b"hello", "ended": True}


def test_router_policy_affinity_unless_imbalanced_else_least_loaded():
    """PrefixAffinityRouter.choose_replicas on fake replicas (Serve's cache, no cluster): a new
    key ranks replicas by load; a known key puts its holder first while its load is within the
    slack of the least loaded, and last once past it; a replica that does not answer its probe
    counts as full."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    from specdec.serve.routing import PrefixAffinityRouter

    class Bare(PrefixAffinityRouter):
        def __init__(self):  # no deployment, no event loop: only the state choose_replicas reads
            self._replica_queue_len_cache = ReplicaQueueLengthCache()
            self.initialize_state(imbalance_slack=2)

        def on_new_queue_len_info(self, replica_id, n):
            self._replica_queue_len_cache.update(replica_id, n)

    load = {"a": 0, "b": 0, "dead": None}

    async def queue_len(rid):
        if load[rid] is None:
            raise RuntimeError("actor died")
        return load[rid]

    def replica(rid):
        return SimpleNamespace(replica_id=rid, max_ongoing_requests=4,
                               get_queue_len=lambda deadline_s, rid=rid: queue_len(rid))

    a, b, dead = replica("a"), replica("b"), replica("dead")
    router = Bare()

    def choose(key):
        router._replica_queue_len_cache = ReplicaQueueLengthCache()  # stale: probe again
        pr = SimpleNamespace(args=[RelayedCall("POST", "/v1/completions", prefix_key=key)],
                             routing_context=SimpleNamespace())
        ranks = asyncio.run(router.choose_replicas([a, b, dead], pr))
        return [[r.replica_id for r in rank] for rank in ranks]

    assert choose("k") == [["a", "b"], ["dead"]]  # equal loads share a rank; no answer = full
    router.on_request_routed(SimpleNamespace(args=[RelayedCall("POST", "/", prefix_key="k")]), "b", None)
    load.update(a=0, b=2)
    assert choose("k") == [["b"], ["a"], ["dead"]]  # holder within the slack: first
    load.update(a=0, b=3)
    assert choose("k") == [["a"], ["b"], ["dead"]]  # past it: least loaded first
    assert choose("other") == [["a"], ["b"], ["dead"]]
