"""Serving under load: aggregate tokens/s, TTFT and inter-token latency at concurrency 1, 2, 4,
8, 16 against `specdec serve` with speculation, without it, and optionally llama-server and vLLM's
CPU build, on the same prompts; plus TTFT of a repeated long prefix with and without reuse.

Each server is started here as a subprocess on a free loopback port and warmed up. Ours (with and
without speculation) are up together and their levels interleaved, `--repeats` times each, the
median kept (the machine is noisy: two sweeps minutes apart differed by 1.5x); an anchor is
started alone afterwards, swept once, and stopped. A level sends
`--requests-per-level` x concurrency streaming greedy completions (asyncio + the openai client)
through a semaphore of that size. Tokens are counted from each stream's usage (or its chunks
where a server gives none), so servers that stop early are not flattered: aggregate tokens/s is
all tokens / wall time of the level. ITL is per stream: (last token time - first token time) /
(tokens - 1).

    .venv/bin/python benchmarks/serve.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --draft-dtype q4_0 --threads 2
    # optional anchors: --llama-server PATH/llama-server   --vllm-python PATH/venv/bin/python

Ends with a table, a plot (--plot), and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

from specdec.runtime.hub import model_path, resolve_model
from specdec.tools.prompts import humaneval

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, model_id: str, env=None):
        self.name, self.cmd, self.port, self.model_id = name, cmd, port, model_id
        self.env = env
        self.proc = None

    def __enter__(self):
        self.log = open(f"/tmp/bench_serve_{self.name}.log", "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})})
        deadline = time.time() + 900  # vLLM compiles for minutes on its first start
        import urllib.request

        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see /tmp/bench_serve_{self.name}.log")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name} did not start in time")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


async def one(client, model, prompt, max_tokens, ignore_eos, sampling=None):
    """sampling: temperature and top_p (default: greedy)."""
    t0 = time.perf_counter()
    times, usage, n_chunks = [], None, 0
    extra = {"ignore_eos": True} if ignore_eos else {}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                             **(sampling or {"temperature": 0}), stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra)
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].text:
            times.append(time.perf_counter())
            n_chunks += 1
    n = usage if usage is not None else n_chunks
    ttft = times[0] - t0 if times else float("nan")
    itl = (times[-1] - times[0]) / (n - 1) if n > 1 and len(times) > 1 else float("nan")
    return n, ttft, itl


async def level(url, model, prompts, concurrency, n_requests, max_tokens, ignore_eos, tag=None, sampling=None):
    """tag: each request's prompt starts with a comment line naming (tag, its index), so that no
    request shares a prefix with one sent before (a prompt held in a server's free rows would
    skip its prefill, and which ones are held depends on each server's history: TTFT would
    differ between two servers doing the same work). Both of ours get the same texts."""
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    sem = asyncio.Semaphore(concurrency)

    async def run(i):
        prompt = prompts[i % len(prompts)]
        if tag is not None:
            prompt = f"# request {tag}-{i}\n{prompt}"
        async with sem:
            return await one(client, model, prompt, max_tokens, ignore_eos, sampling)

    t0 = time.perf_counter()
    res = await asyncio.gather(*(run(i) for i in range(n_requests)))
    wall = time.perf_counter() - t0
    await client.close()
    toks = sum(r[0] for r in res)
    ttfts = sorted(r[1] for r in res)
    itls = sorted(r[2] for r in res if r[2] == r[2])
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"concurrency": concurrency, "requests": n_requests, "tokens": toks, "wall_s": wall,
            "tok_s": toks / wall, "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "itl_p50": pct(itls, 0.5), "itl_p99": pct(itls, 0.99)}


async def prefix_ttft(url, model, tokenizer_words: list[str], trials: int):
    """TTFT of a ~1000-token prefix seen for the first time (cold: a fresh random prefix) and
    of the same prefix again with another question (warm: its KV reused)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    cold, warm = [], []
    rnd = random.Random(0)
    for t in range(trials):
        prefix = " ".join(rnd.choice(tokenizer_words) for _ in range(700))
        for bucket, q in ((cold, "Question 1: summarise."), (warm, "Question 2: what comes next?")):
            t0 = time.perf_counter()
            s = await client.completions.create(model=model, prompt=prefix + "\n" + q, max_tokens=1,
                                                temperature=0, stream=True)
            async for _ in s:
                pass
            bucket.append(time.perf_counter() - t0)
    await client.close()
    return statistics.median(cold), statistics.median(warm)


def print_table(first: str, levels: list[int], results: dict[str, list[dict]]) -> None:
    """A Markdown table: a row of aggregate tokens/s per server, a column per concurrency level."""
    print(f"\n| {first} | " + " | ".join(f"c={c}" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for name, rows in results.items():
        print(f"| {name} tok/s | " + " | ".join(f"{r['tok_s']:.1f}" for r in rows) + " |")


def print_ratio(label: str, levels: list[int], top: list[dict], bottom: list[dict]) -> dict[int, float]:
    """The table's last row: top / bottom tokens/s at each level; returns them by level."""
    ratios = {c: t["tok_s"] / b["tok_s"] for c, t, b in zip(levels, top, bottom)}
    print(f"| {label} | " + " | ".join(f"{ratios[c]:.2f}x" for c in levels) + " |")
    return ratios


def our_server(name, a, port, speculative: bool, proposer: str | None = None) -> Server:
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--port", str(port),
           "--threads", str(a.threads), "--max-batch", str(max(a.levels)), "--max-model-len", str(a.max_model_len)]
    if speculative:
        if a.draft:
            cmd += ["--draft", a.draft, "--draft-dtype", a.draft_dtype, "--proposer", proposer or a.proposer]
        else:
            cmd += ["--proposer", "ngram"]
        cmd += ["--num-draft-tokens", a.k]
    return Server(name, cmd, port, a.model)


def llama_server(name, a, port, draft: bool) -> Server:
    gguf = str(model_path(a.model))
    cmd = [a.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(a.threads),
           "-tb", str(a.threads), "-np", str(max(a.levels)), "-c", str(a.max_model_len * max(a.levels)), "-cb"]
    if draft and a.draft:  # its default draft settings but for the draft length, as ours (k_max 8)
        cmd += ["-md", str(model_path(a.draft)), "--spec-draft-n-max", "8", "-td", str(a.threads)]
    return Server(name, cmd, port, "default")


def vllm_server(name, a, port, ngram: bool) -> Server:
    path = str(resolve_model(a.model))
    cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
           "--served-model-name", a.model, "--dtype", "bfloat16", "--max-model-len", str(a.max_model_len),
           "--max-num-seqs", str(max(a.levels))]
    if ngram:
        cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_max": 4})]
    return Server(name, cmd, port, a.model, env={"VLLM_CPU_KVCACHE_SPACE": "4",
                                                  "OMP_NUM_THREADS": str(a.threads)})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model ('' for the n-gram proposer)")
    ap.add_argument("--draft-dtype", default="q4_0")
    ap.add_argument("--proposer", default="composite", choices=("draft", "composite"),
                    help="our speculative server's proposer with --draft (composite, the default: n-gram "
                         "lookup first, then the draft model)")
    ap.add_argument("--k", default="auto", help="--num-draft-tokens of our speculative server")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests = this x concurrency (min 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", help="every request decodes --max-tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="of every request")
    ap.add_argument("--prompts", type=int, default=16, help="HumanEval prompts used (cycled)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--servers", default="spec,plain",
                    help="of spec, spec-draft / spec-composite (ours with that proposer, beside spec), plain, "
                         "llama, llama-draft, vllm, vllm-ngram")
    ap.add_argument("--llama-server", default=None, help="path of a llama-server binary")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--prefix-trials", type=int, default=3, help="repeated-prefix TTFT trials (0: skip)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each level per server of ours (median kept)")
    ap.add_argument("--reuse-prompts", action="store_true",
                    help="send the HumanEval prompts as they are, so a level may find earlier levels' prompts "
                         "in a server's prefix cache (default: each request's prompt is made unique by a first "
                         "comment line, and every request prefills its whole prompt)")
    ap.add_argument("--plot", default="docs/bench/serve.png")
    a = ap.parse_args()
    a.levels = [int(x) for x in a.levels.split(",")]
    a.draft = a.draft or None
    prompts = humaneval(a.prompts)
    makers = {"spec": lambda n, p: our_server(n, a, p, True), "plain": lambda n, p: our_server(n, a, p, False),
              "spec-draft": lambda n, p: our_server(n, a, p, True, "draft"),
              "spec-composite": lambda n, p: our_server(n, a, p, True, "composite"),
              "llama": lambda n, p: llama_server(n, a, p, False), "llama-draft": lambda n, p: llama_server(n, a, p, True),
              "vllm": lambda n, p: vllm_server(n, a, p, False), "vllm-ngram": lambda n, p: vllm_server(n, a, p, True)}
    names = a.servers.split(",")
    for n in names:
        if n not in makers:
            sys.exit(f"--servers: {n!r}; allowed: {', '.join(makers)}")
        if n.startswith("llama") and not a.llama_server:
            sys.exit(f"--servers {n} needs --llama-server PATH")
        if n.startswith("vllm") and not a.vllm_python:
            sys.exit(f"--servers {n} needs --vllm-python PATH")
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} cores; model {a.model}, draft {a.draft} ({a.draft_dtype}), "
          f"proposer {a.proposer if a.draft else 'ngram'}, "
          f"k={a.k}, threads {a.threads}, {a.max_tokens} tokens/request, temperature {a.temperature}, top_p {a.top_p}, "
          f"prompts: HumanEval x{len(prompts)}"
          f"{', as they are (prefix reuse across levels)' if a.reuse_prompts else ', each made unique by a first comment line'}")
    results, prefix = {}, {}
    sampling = {"temperature": a.temperature, **({"top_p": a.top_p} if a.top_p < 1 else {})}

    def sweep_level(srv, name, c, rep=0):
        tag = None if a.reuse_prompts else f"c{c}r{rep}"
        r = asyncio.run(level(srv.url, srv.model_id, prompts, c, max(4, a.requests_per_level * c),
                              a.max_tokens, a.ignore_eos, tag, sampling))
        print(f"{name:12s} c={c:3d}  {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50']:6.2f}s "
              f"p99 {r['ttft_p99']:6.2f}s  ITL p50 {r['itl_p50'] * 1e3:6.1f}ms p99 {r['itl_p99'] * 1e3:6.1f}ms",
              flush=True)
        return r

    def prefix_reuse(srv, name):
        words = re.findall(r"[a-z]+", " ".join(prompts))
        cold, warm = asyncio.run(prefix_ttft(srv.url, srv.model_id, words, a.prefix_trials))
        prefix[name] = {"cold_ttft_s": cold, "warm_ttft_s": warm, "speedup": cold / warm}
        print(f"{name:12s} repeated ~1000-token prefix: TTFT cold {cold:.2f}s, warm {warm:.3f}s "
              f"({cold / warm:.1f}x)", flush=True)

    ours = [n for n in names if n in ("spec", "spec-draft", "spec-composite", "plain")]
    if ours:  # both up at once (an idle server costs nothing), levels interleaved, best of --repeats
        servers = [makers[n](n, free_port()) for n in ours]
        try:
            for srv in servers:
                srv.__enter__()
                asyncio.run(level(srv.url, srv.model_id, prompts[:2], 1, 2, 8, False))  # warm-up
            for srv in servers:
                results[srv.name] = []
            for c in a.levels:
                runs = {srv.name: [] for srv in servers}
                for rep in range(a.repeats):
                    for srv in servers:
                        runs[srv.name].append(sweep_level(srv, srv.name, c, rep))
                for name, rs in runs.items():
                    results[name].append(sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2])  # median
            if a.prefix_trials:
                for srv in servers:
                    prefix_reuse(srv, srv.name)
        finally:
            for srv in servers:
                if srv.proc is not None:
                    srv.__exit__(None, None, None)
    failed = {}
    for name in [n for n in names if n not in ours]:  # anchors one at a time
        try:  # an anchor that fails is reported, and the others' results are kept
            with makers[name](name, free_port()) as srv:
                asyncio.run(level(srv.url, srv.model_id, prompts[:2], 1, 2, 8, False))  # warm-up
                results[name] = [sweep_level(srv, name, c) for c in a.levels]
        except (RuntimeError, OSError, openai.OpenAIError) as e:
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"{name:12s} failed: {failed[name]} (its log: /tmp/bench_serve_{name}.log)", flush=True)
    print_table("server", a.levels, results)
    ratios, ratios_composite = {}, {}
    if "spec" in results and "plain" in results:
        ratios = print_ratio("spec / plain", a.levels, results["spec"], results["plain"])
    if "spec-composite" in results and "plain" in results:
        ratios_composite = print_ratio("spec-composite / plain", a.levels, results["spec-composite"], results["plain"])
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in results.items():
            ax1.plot(a.levels, [r["tok_s"] for r in rows], marker="o", label=name)
            ax2.plot(a.levels, [r["itl_p50"] * 1e3 for r in rows], marker="o", label=name)
        ax1.set(xscale="log", xlabel="concurrent requests", ylabel="aggregate tokens/s", title="throughput")
        ax2.set(xscale="log", xlabel="concurrent requests", ylabel="ITL p50 (ms)", title="inter-token latency")
        for ax in (ax1, ax2):
            ax.set_xticks(a.levels, [str(c) for c in a.levels])
            ax.set_xticks([], minor=True)  # (no "3 x 10^0" between the levels)
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"{a.model} (draft {a.draft}), {cpu_name()}, {a.threads} threads"
                     + (f", T = {a.temperature}, top_p = {a.top_p}" if a.temperature else ", greedy"))
        fig.tight_layout()
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(a.plot, dpi=110)
        print(f"plot: {a.plot}")
    print(json.dumps({"bench": "serve", "cpu": cpu_name(), "model": a.model, "draft": a.draft,
                      "proposer": a.proposer if a.draft else "ngram", "k": a.k, "temperature": a.temperature,
                      "top_p": a.top_p, "threads": a.threads, "max_tokens": a.max_tokens, "results": results,
                      "spec_over_plain": ratios, "composite_over_plain": ratios_composite, "prefix_reuse": prefix, "failed": failed}))


if __name__ == "__main__":
    main()
