"""Throughput of 1 vs 2 engine replicas under Ray Serve on this machine, next to the single server.

Three servers on the same cores: the single server (no Ray) with --threads T, one replica with T
threads, and two replicas with T/2 threads each, so every configuration has the same cores. All
are up at once (the Ray ones as two separate one-machine clusters) and warmed up; each
concurrency level sends `--requests-per-level` x concurrency streaming greedy completions
(benchmarks/serve.py's client: aggregate tokens/s is all tokens / wall time of the level) to
each server in turn, `--repeats` times, median kept.

On a machine with few cores expect about 1x for 2 replicas over 1. Decoding is bound by the cores
(arithmetic and memory bandwidth), and two replicas split the same cores rather than add any.
A second replica wins only what one engine leaves idle: the Python part of each round, run under
one GIL, and 2-thread matmuls waiting on each other when other work takes a core. On a small
model that can be a third or more (docs/distributed.md has the measurements and the reasons).
Replicas add throughput with machines, not within one.

    .venv/bin/python benchmarks/replicas.py                      # SmolLM2-135M, 2 threads
    .venv/bin/python benchmarks/replicas.py --model qwen2.5-coder-0.5b --levels 1,4,8

Ends with a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import Server, cpu_name, free_port, level, print_ratio, print_table  # noqa: E402

from specdec.tools.prompts import humaneval  # noqa: E402


def server(name: str, a, replicas: int | None) -> Server:
    threads = a.threads if replicas is None else max(1, a.threads // replicas)
    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--port", str(port),
           "--threads", str(threads), "--max-batch", str(a.max_batch), "--max-model-len", str(a.max_model_len)]
    if replicas is not None:
        cmd += ["--replicas", str(replicas)]
    return Server(name, cmd, port, a.model)


def measure(servers: list[Server], a, prompts) -> dict[str, list[dict]]:
    """Every level on every server, the servers taking turns `--repeats` times (the background
    load of a shared machine drifts: turns spread it over all of them); the median run is kept."""
    for srv in servers:
        asyncio.run(level(srv.url, srv.model_id, prompts[:2], 1, 2, 8, False))  # warm-up
    results: dict[str, list[dict]] = {srv.name: [] for srv in servers}
    for c in a.levels:
        runs: dict[str, list[dict]] = {srv.name: [] for srv in servers}
        for _ in range(a.repeats):
            for srv in servers:
                runs[srv.name].append(asyncio.run(level(srv.url, srv.model_id, prompts, c,
                                                        max(4, a.requests_per_level * c), a.max_tokens, True)))
        for name, rs in runs.items():
            mid = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
            mid["tok_s_runs"] = [round(r["tok_s"], 1) for r in rs]
            results[name].append(mid)
            print(f"{name:12s} c={c:3d}  {mid['tok_s']:7.1f} tok/s  (runs {mid['tok_s_runs']})  "
                  f"TTFT p50 {mid['ttft_p50']:.2f}s  ITL p50 {mid['itl_p50'] * 1e3:.1f}ms", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores for every configuration")
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests = this x concurrency (min 4)")
    ap.add_argument("--max-tokens", type=int, default=64, help="every request decodes this many (ignore_eos)")
    ap.add_argument("--max-batch", type=int, default=16, help="KV rows per replica (and of the single server)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=16, help="HumanEval prompts used (cycled)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="single,1-replica,2-replicas")
    a = ap.parse_args()
    a.levels = [int(x) for x in a.levels.split(",")]
    prompts = humaneval(a.prompts)
    makers = {"single": None, "1-replica": 1, "2-replicas": 2}
    names = a.configs.split(",")
    for n in names:
        if n not in makers:
            sys.exit(f"--configs: {n!r}; allowed: {', '.join(makers)}")
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} cores; model {a.model}, plain decoding, {a.threads} threads "
          f"per configuration, {a.max_tokens} tokens/request, {a.max_batch} rows per engine", flush=True)
    with ExitStack() as up:  # all up at once: an idle server costs little, and turns need them all
        servers = [up.enter_context(server(name, a, makers[name])) for name in names]
        results = measure(servers, a, prompts)
    print_table("configuration", a.levels, results)
    ratio = {}
    if "1-replica" in results and "2-replicas" in results:
        ratio = print_ratio("2 / 1 replicas", a.levels, results["2-replicas"], results["1-replica"])
    print(json.dumps({"bench": "replicas", "cpu": cpu_name(), "cores": os.cpu_count(), "model": a.model,
                      "threads": a.threads, "max_tokens": a.max_tokens, "max_batch": a.max_batch,
                      "results": results, "two_over_one_replica": ratio,
                      "median_two_over_one": statistics.median(ratio.values()) if ratio else None}))


if __name__ == "__main__":
    main()
