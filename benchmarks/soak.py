"""Soak: many concurrent streaming clients against `specdec serve` for a bounded time.

Starts the server (speculative, n-gram proposer by default), runs `--clients` asyncio clients that
each stream greedy completions back to back for `--minutes`, then stops by itself. Checks:
  - errors: any non-200, any exception, any stream without a finish_reason;
  - lost or duplicated tokens: greedy output is deterministic (batch-invariant kernels), so every
    stream of one prompt must concatenate to the same text, equal to a non-streamed request for
    that prompt sent after the soak, and its usage must match its token count;
  - memory: the server's resident set sampled every 5 s; flat after warm-up means the last
    third's median is within 5% of the second third's.
Prints a summary and one JSON line.

    .venv/bin/python benchmarks/soak.py --model smollm2-135m --clients 64 --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import Server, cpu_name, free_port  # noqa: E402

PROMPTS = ["def quicksort(xs):", "The history of Rome", "import json\n\ndef load(path):", "Dear team,",
           "SELECT * FROM orders WHERE", "A list of prime numbers: 2, 3, 5,", "class Node:", "Once upon a time"]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def client_loop(i, url, model, deadline, max_tokens, results, errors):
    c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    n = 0
    while time.monotonic() < deadline:
        prompt = PROMPTS[(i + n) % len(PROMPTS)]
        n += 1
        try:
            s = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
            text, finish, usage = [], None, None
            async for ch in s:
                if ch.choices:
                    text.append(ch.choices[0].text)
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage is not None:
                    usage = ch.usage.completion_tokens
            if finish is None or usage is None:
                errors.append(f"client {i}: stream ended without finish_reason/usage")
            results[prompt].append(("".join(text), usage))
        except Exception as e:  # noqa: BLE001 - every failure is counted, the soak goes on
            errors.append(f"client {i}: {type(e).__name__}: {e}")
    await c.close()


async def soak(url, model, a, pid):
    results, errors, rss = defaultdict(list), [], []
    deadline = time.monotonic() + a.minutes * 60

    async def sample_rss():
        while time.monotonic() < deadline:
            rss.append(rss_mb(pid))
            await asyncio.sleep(5)

    t0 = time.monotonic()
    await asyncio.gather(sample_rss(), *(client_loop(i, url, model, deadline, a.max_tokens, results, errors)
                                         for i in range(a.clients)))
    wall = time.monotonic() - t0
    c = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    mismatched = 0
    for prompt, outs in results.items():
        ref = (await c.completions.create(model=model, prompt=prompt, max_tokens=a.max_tokens, temperature=0))
        want = (ref.choices[0].text, ref.usage.completion_tokens)
        mismatched += sum(1 for o in outs if o != want)
    await c.close()
    return results, errors, rss, mismatched, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--proposer", default="ngram")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--port", str(port), "--threads",
           str(a.threads), "--max-batch", str(a.max_batch), "--max-model-len", "1024", "--proposer", a.proposer]
    print(f"# CPU: {cpu_name()}; {a.model}, proposer {a.proposer}, {a.clients} streaming clients, "
          f"{a.minutes} min, {a.max_tokens} tokens/request, {a.max_batch} rows")
    with Server("soak", cmd, port, a.model) as srv:
        results, errors, rss, mismatched, wall = asyncio.run(soak(srv.url, a.model, a, srv.proc.pid))
    n = sum(len(v) for v in results.values())
    toks = sum(u or 0 for v in results.values() for _, u in v)
    third = max(len(rss) // 3, 1)
    mid, last = statistics.median(rss[third:2 * third] or rss), statistics.median(rss[2 * third:] or rss)
    flat = abs(last - mid) <= 0.05 * mid
    print(f"requests {n}, tokens {toks} ({toks / wall:.1f} tok/s), errors {len(errors)}, "
          f"mismatched streams {mismatched}")
    print(f"RSS MB: start {rss[0]:.0f}, middle third median {mid:.0f}, last third median {last:.0f}, "
          f"max {max(rss):.0f} -> {'flat' if flat else 'NOT flat'}")
    for e in errors[:10]:
        print("  error:", e)
    print(json.dumps({"bench": "soak", "cpu": cpu_name(), "model": a.model, "clients": a.clients,
                      "minutes": a.minutes, "requests": n, "tokens": toks, "errors": len(errors),
                      "mismatched": mismatched, "rss_mb": {"start": rss[0], "mid": mid, "last": last,
                                                           "max": max(rss)}, "rss_flat": flat}))
    return 0 if not errors and not mismatched and flat else 1


if __name__ == "__main__":
    sys.exit(main())
