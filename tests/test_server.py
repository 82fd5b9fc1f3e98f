"""`specdec serve` as users run it: a subprocess on a free loopback port, spoken to with the real
`openai` client and with raw HTTP (http.client), on SmolLM2-135M at its own quantisation.

The speculative server (n-gram proposer, k = 4) must give each of 16 concurrent greedy requests
exactly what plain decoding gives that request alone (text, tokens, log-probabilities), and
/metrics must show that it drafted and accepted. Stops and EOS inside an accepted run leak
nothing; a client that disconnects frees its row; bad input is a clear 400 that leaves the other
requests running.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import torch

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
KEY = "test-key"
PROMPTS = [
    "def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef mean(xs):",
    "Once upon a time", "for i in range(10):", "The three primary colours are",
    "class Stack:\n    def __init__(self):", "SELECT name FROM users WHERE", "Water boils at",
    "def is_prime(n):", "The quick brown fox", "# Sort a list in Python\n",
    "A haiku about autumn:\n", "HTTP status 404 means", "def reverse(s):", "My favourite book is",
]


def start_server(*flags, ready_timeout=120):
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", MODEL, "--port", "0", "--threads", "2",
           "--max-model-len", "1024", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + ready_timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+)/v1", line or "")
        if m:
            url = m.group(1)
            while time.time() < deadline:  # the socket listens before uvicorn serves: wait for /health
                try:
                    if raw(url, "GET", "/health")[0] == 200:
                        return proc, url
                except OSError:
                    time.sleep(0.2)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"server did not start: {proc.stderr.read()}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def raw(url, method, path, body=None, key=KEY, headers=None):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, text


def metric(url, name, **labels) -> float:
    _, text = raw(url, "GET", "/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def spec_server():
    proc, url = start_server("--proposer", "ngram", "--num-draft-tokens", "4", "--max-batch", "16",
                             "--api-key", KEY)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def plain_llm():
    """Plain decoding, one request at a time: the reference every server answer must equal."""
    from specdec.api import LLM

    torch.set_num_threads(2)
    return LLM(MODEL, max_model_len=1024, max_batch=1)


def plain_completion(llm, prompt, max_tokens, **kw):
    from specdec.config import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, **kw),
                       raw=True)[0]
    return out


def test_health_models_and_api_key(spec_server, client):
    assert raw(spec_server, "GET", "/health", key=None)[0] == 200  # load balancers send no key
    status, text = raw(spec_server, "GET", "/v1/models", key=None)
    assert status == 401 and json.loads(text)["error"]["type"] == "authentication_error"
    assert raw(spec_server, "GET", "/v1/models", key="wrong")[0] == 401
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=spec_server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_concurrent_greedy_requests_equal_plain_alone(spec_server, client, plain_llm):
    drafted0 = metric(spec_server, "specdec_spec_decode_num_draft_tokens_total")
    accepted0 = metric(spec_server, "specdec_spec_decode_num_accepted_tokens_total")

    def ask(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0, logprobs=1)

    with ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(ask, PROMPTS))
    for p, a in zip(PROMPTS, answers):
        ref = plain_completion(plain_llm, p, 48)
        ch = a.choices[0]
        assert ch.text == ref.text, p
        assert ch.logprobs.tokens == [plain_llm.tokenizer.decode([t], skip_special_tokens=False)
                                      for t in ref.token_ids], p
        assert ch.logprobs.token_logprobs == [t.logprob for t in ref.logprobs], p  # exact, not close
        assert a.usage.completion_tokens == len(ref.token_ids) and a.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert metric(spec_server, "specdec_spec_decode_num_draft_tokens_total") > drafted0  # it speculated
    assert metric(spec_server, "specdec_spec_decode_num_accepted_tokens_total") > accepted0


def test_chat_and_completions_streaming_equal_non_streaming(client):
    msgs = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    comp = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=30, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=30, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in parts) == comp.choices[0].text


def test_n_choices_and_seed_reproduce(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # each choice has its own dice
    one = client.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == a.choices[0].text  # choice 0 uses the seed itself
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once


def test_stop_string_across_tokens_leaks_nothing(client, plain_llm):
    prompt = "def fibonacci(n):"
    ref = plain_completion(plain_llm, prompt, 48)
    pieces = [plain_llm.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert "".join(pieces) == ref.text
    # a stop string that starts with token i's last character and ends with token i + 1's first,
    # found nowhere earlier in the answer, well into it
    cut_at = [len("".join(pieces[: j + 1])) - 1 for j in range(len(pieces))]
    i = next(j for j in range(6, len(pieces) - 1)
             if pieces[j + 1] and ref.text.find(pieces[j][-1:] + pieces[j + 1][0]) == cut_at[j])
    stop, cut = pieces[i][-1] + pieces[i + 1][0], cut_at[i]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop], logprobs=1)
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            toks = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            usage, finish = chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            a = client.completions.create(**kw)
            text, toks, usage, finish = a.choices[0].text, a.choices[0].logprobs.tokens, a.usage, a.choices[0].finish_reason
        assert text == ref.text[:cut] and stop not in text
        assert toks == pieces[: i + 2]  # up to the token that completed the stop string, no later one
        assert usage.completion_tokens == i + 2 and finish == "stop"


def test_eos_inside_an_accepted_run_leaks_nothing(client, plain_llm):
    """A chat answer that ends with EOS, while the n-gram proposer drafts 4 tokens a round (the
    round that emits EOS may have drafts past it): nothing after the EOS comes back."""
    msgs = [{"role": "user", "content": "Reply with the single word: yes"}]
    ids = plain_llm.tokenizer.encode(plain_llm.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    ref = plain_completion(plain_llm, ids, 64)
    assert ref.finish_reason == "stop" and ref.token_ids[-1] in plain_llm.tokenizer.eos_token_ids
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0, logprobs=True)
    ch = a.choices[0]
    assert ch.message.content == ref.text and ch.finish_reason == "stop"
    assert len(ch.logprobs.content) == len(ref.token_ids) == a.usage.completion_tokens
    assert [x.logprob for x in ch.logprobs.content] == [t.logprob for t in ref.logprobs]


def test_disconnect_mid_stream_frees_the_row(spec_server, client):
    u = urlparse(spec_server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 900, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(5):
        assert resp.fp.readline()  # a few SSE lines: the request is running
    assert metric(spec_server, "specdec_num_requests_running") >= 1
    aborted0 = metric(spec_server, "specdec_request_finished_total", finish_reason="abort")
    conn.sock.close()
    conn.close()
    deadline = time.time() + 20
    while metric(spec_server, "specdec_num_requests_running") > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert metric(spec_server, "specdec_num_requests_running") == 0
    assert metric(spec_server, "specdec_kv_cache_tokens_used") == 0
    assert metric(spec_server, "specdec_request_finished_total", finish_reason="abort") == aborted0 + 1
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


C = "/v1/completions"
CH = "/v1/chat/completions"
GOOD_C = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
GOOD_CH = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [  # (path, body, status, the field the message must name)
    (C, {**GOOD_C, "temperature": 5}, 400, "temperature"),
    (C, {**GOOD_C, "temperature": -0.1}, 400, "temperature"),
    (C, {**GOOD_C, "temperature": "hot"}, 400, "temperature"),
    (C, {**GOOD_C, "top_p": 0}, 400, "top_p"),
    (C, {**GOOD_C, "top_p": 1.5}, 400, "top_p"),
    (C, {**GOOD_C, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**GOOD_C, "max_tokens": 5000}, 400, "max_tokens"),
    (C, {**GOOD_C, "max_tokens": True}, 400, "max_tokens"),
    (C, {**GOOD_C, "n": 0}, 400, "n"),
    (C, {**GOOD_C, "n": 17}, 400, "n"),
    (C, {**GOOD_C, "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {**GOOD_C, "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (C, {**GOOD_C, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {**GOOD_C, "top_k": -5}, 400, "top_k"),
    (C, {**GOOD_C, "min_p": 2}, 400, "min_p"),
    (C, {**GOOD_C, "seed": -1}, 400, "seed"),
    (C, {**GOOD_C, "seed": 2**64}, 400, "seed"),
    (C, {**GOOD_C, "logprobs": 6}, 400, "logprobs"),
    (C, {**GOOD_C, "stop": ""}, 400, "stop"),
    (C, {**GOOD_C, "stop": [1, 2]}, 400, "stop"),
    (C, {**GOOD_C, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {**GOOD_C, "prompt": ""}, 400, "prompt"),
    (C, {**GOOD_C, "prompt": []}, 400, "prompt"),
    (C, {**GOOD_C, "prompt": [1, 2, 10**9]}, 400, "prompt"),
    (C, {**GOOD_C, "prompt": "word " * 1100}, 400, "prompt"),
    (C, {**GOOD_C, "echo": True}, 400, "echo"),
    (C, {**GOOD_C, "best_of": 3}, 400, "best_of"),
    (C, {**GOOD_C, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    (C, {**GOOD_C, "temprature": 0.5}, 400, "temprature"),
    (C, {**GOOD_C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {k: v for k, v in GOOD_C.items() if k != "prompt"}, 400, "prompt"),
    (C, {**GOOD_C, "model": "gpt-4"}, 404, "model"),
    (C, "{not json", 400, "JSON"),
    (C, {**GOOD_C, "temperature": float("nan")}, 400, "temperature"),
    (CH, {**GOOD_CH, "messages": []}, 400, "messages"),
    (CH, {**GOOD_CH, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (CH, {**GOOD_CH, "messages": [{"role": "user"}]}, 400, "content"),
    (CH, {**GOOD_CH, "top_logprobs": 3}, 400, "top_logprobs"),
    (CH, {**GOOD_CH, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CH, {**GOOD_CH, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CH, {**GOOD_CH, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CH, {**GOOD_CH, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (C, {**GOOD_C, "guided_regex": "(unclosed"}, 400, "regex"),
    (CH, {**GOOD_CH, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
]


def test_bad_input_is_a_clear_4xx_and_touches_no_other_request(spec_server, client):
    good: list = []

    def run_good():
        for _ in range(2):
            s = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=40, temperature=0,
                                          stream=True)
            good.append("".join(c.choices[0].text for c in s))

    t = threading.Thread(target=run_good)
    t.start()
    assert len(BAD) >= 25
    for path, body, status, field in BAD:
        data = body if isinstance(body, str) else json.dumps(body, allow_nan=True)
        got, text = raw(spec_server, "POST", path, data)
        assert got == status, (body, text)
        err = json.loads(text)["error"]
        assert field.lower() in err["message"].lower(), (field, err)
        assert set(err) >= {"message", "type", "param", "code"}
        assert "Traceback" not in text
    big = "x" * (5 << 20)
    assert raw(spec_server, "POST", C, json.dumps({**GOOD_C, "prompt": big}))[0] == 413
    t.join(120)
    assert len(good) == 2 and good[0] == good[1] and good[0]


def test_structured_output(spec_server, client, plain_llm):
    """response_format json_schema and json_object, and the guided_regex extension: the answer
    is valid under its constraint, equals plain decoding under the same schema (greedy), and
    finishes with "stop"; a schema the library refuses is a 400 naming response_format."""
    import jsonschema

    from specdec.config import SamplingParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": schema}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"
    tok = plain_llm.models.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    want = plain_llm.generate([ids], SamplingParams(temperature=0, max_tokens=80, json_schema=schema))[0]
    assert text == want.text
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0.7, seed=5,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="The year is", max_tokens=8, temperature=1.0,
                                  extra_body={"guided_regex": " (19|20)[0-9]{2}"})
    assert re.fullmatch(r" (19|20)[0-9]{2}", r.choices[0].text), r.choices[0].text
    bad = {"model": MODEL, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}}
    got, text = raw(spec_server, "POST", "/v1/chat/completions", json.dumps(bad))
    assert got == 400 and "json_schema" in text, text


def test_full_queue_answers_429_and_recovers():
    proc, url = start_server("--max-batch", "1", "--max-waiting", "1")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def ask(_):
            try:
                return c.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=60, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].finish_reason
            except openai.RateLimitError:
                return 429

        # One request holds the only row (its first chunk proves it was admitted), so of four more
        # arriving together exactly one waits and three are refused; arriving all at once, before the
        # first was admitted, the queue would hold that first one and refuse four (a race, not a bug).
        holder = c.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=400, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(holder))
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(ask, range(4)))
        assert sorted(got, key=str) == [429, 429, 429, "length"], got
        assert [ch.choices[0].finish_reason for ch in holder if ch.choices][-1] == "length"
        assert ask(0) == "length"  # and the server goes on serving
    finally:
        stop_server(proc)


def test_kv_pool_preempts_and_every_stream_is_whole(plain_llm):
    """A KV pool of 1,024 tokens for 16 rows (each may reach a 1,024-token context): 16 greedy
    streams of 96 tokens need ~1,700 tokens at once, so the pool preempts (asserted through
    /metrics) and recomputes later; each stream's deltas equal plain decoding alone, token ids
    and text, nothing lost or repeated across its pause, and the pool is never over-held."""
    proc, url = start_server("--proposer", "ngram", "--num-draft-tokens", "4", "--max-batch", "16",
                             "--kv-cache-tokens", "1024")
    try:
        cl = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert metric(url, "specdec_kv_pool_tokens") == 1024

        def ask(p):
            chunks = list(cl.completions.create(model=MODEL, prompt=p, max_tokens=96, temperature=0, stream=True,
                                                logprobs=1, extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            return text, [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]

        with ThreadPoolExecutor(16) as ex:
            answers = list(ex.map(ask, PROMPTS))
        assert metric(url, "specdec_num_preemptions_total") > 0  # else this test shows nothing
        assert metric(url, "specdec_kv_pool_tokens_used") <= 1024
        assert metric(url, "specdec_kv_cache_resident_bytes") > 0
        for p, (text, pieces) in zip(PROMPTS, answers):
            ref = plain_completion(plain_llm, p, 96, ignore_eos=True)
            assert text == ref.text, p
            assert pieces == [plain_llm.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids], p
    finally:
        stop_server(proc)
