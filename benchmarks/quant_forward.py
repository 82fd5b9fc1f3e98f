"""forward(T) / forward(1) of whole models at `--dtype native`: what a verify round costs.

For each model: load it on the GGUF's own blocks, prefill `--context` random tokens, then time
one forward over T new tokens (positions context .. context+T-1, the cache rolled back after
each) for every T in `--widths`, interleaved per repeat; medians.  forward(k + 1) / forward(1)
is the verify cost of k drafts against one plain decode step (issue #7's goal: <= 1.5 at T = 5).
Also prints the share of forward(T) spent in the quantised matmuls.  With `--llamacpp` (needs
llama-cpp-python: `make bench-deps`), llama.cpp's own forward(T) on the same GGUF runs in the same
process, interleaved with ours: eval of T tokens after the same context, rewound after each,
logits for all T positions (what a verify needs).  A table, then one JSON line.

    .venv/bin/python benchmarks/quant_forward.py [--models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b]
        [--threads 2] [--widths 1,2,5,9] [--repeats 9] [--llamacpp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def llamacpp_forward(name: str, threads: int, context: int, width: int):
    """-> f(tokens): llama.cpp's forward over `tokens` after a `context`-token prompt, rewound."""
    from llama_cpp import Llama

    from specdec.runtime.hub import model_path

    llm = Llama(model_path=str(model_path(name)), n_ctx=context + width + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, logits_all=True, verbose=False, seed=0)
    g = torch.Generator().manual_seed(0)
    llm.eval(torch.randint(0, 1000, (context,), generator=g).tolist())

    def forward(tokens: list[int]) -> None:
        llm.n_tokens = context  # eval drops the cache beyond n_tokens first
        llm.eval(tokens)
    return forward


def measure(name: str, widths: list[int], context: int, repeats: int, llamacpp: bool = False,
            threads: int = 2) -> dict:
    from specdec.runtime import kernels
    from specdec.loader import load_model

    model, _ = load_model(name, dtype="native", device="cpu")
    cache = model.new_cache(1, context + max(widths) + 8)
    g = torch.Generator().manual_seed(0)
    model.forward(torch.randint(0, 1000, (1, context), generator=g), torch.arange(context)[None], cache)
    cache.advance(0, context)
    times = {t: [] for t in widths}
    in_linear = {t: [] for t in widths}
    lc = llamacpp_forward(name, threads, context, max(widths)) if llamacpp else None
    lc_times = {t: [] for t in widths}
    linear = kernels.linear
    spent = [0.0]

    def timed_linear(*args, **kw):
        t0 = time.perf_counter()
        y = linear(*args, **kw)
        spent[0] += time.perf_counter() - t0
        return y

    for rep in range(repeats + 1):  # repeat 0 warms up
        for t in widths:
            toks = torch.randint(0, 1000, (1, t), generator=g)
            pos = torch.arange(context, context + t)[None]
            if lc is not None:
                time.sleep(0.05)  # let llama.cpp's worker threads stop polling before we run
            kernels.linear, spent[0] = timed_linear, 0.0
            t0 = time.perf_counter()
            model.forward(toks, pos, cache)  # writes KV at context.. but never advances: rolled back
            dt = time.perf_counter() - t0
            kernels.linear = linear
            if rep:
                times[t].append(dt)
                in_linear[t].append(spent[0] / dt)
            if lc is not None:
                time.sleep(0.05)  # and ours (OpenMP) before llama.cpp runs
                t0 = time.perf_counter()
                lc(toks[0].tolist())
                if rep:
                    lc_times[t].append(time.perf_counter() - t0)
    f1 = statistics.median(times[widths[0]])
    res = {t: {"ms": statistics.median(times[t]) * 1e3, "ratio": statistics.median(times[t]) / f1,
               "matmul_share": statistics.median(in_linear[t])} for t in widths}
    if lc is not None:
        l1 = statistics.median(lc_times[widths[0]])
        for t in widths:
            res[t]["llamacpp_ms"] = statistics.median(lc_times[t]) * 1e3
            res[t]["llamacpp_ratio"] = statistics.median(lc_times[t]) / l1
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widths", default="1,2,5,9")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp's forward(T)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    widths = sorted({int(w) for w in a.widths.split(",")} | {1})
    res = {m: measure(m, widths, a.context, a.repeats, a.llamacpp, a.threads) for m in a.models.split(",")}
    print(f"--dtype native, {a.threads} threads, {a.context}-token cache, median of {a.repeats}")
    print("| model | " + " | ".join(f"T={t}" for t in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for m, r in res.items():
        print(f"| {m} | " + " | ".join(f"{r[t]['ms']:.1f} ms ({r[t]['ratio']:.2f}x, matmul "
                                       f"{r[t]['matmul_share']:.0%})" for t in widths) + " |")
        if a.llamacpp:
            print(f"| {m}: llama.cpp | " + " | ".join(
                f"{r[t]['llamacpp_ms']:.1f} ms ({r[t]['llamacpp_ratio']:.2f}x)" for t in widths) + " |")
    print(json.dumps({"benchmark": "quant_forward", "threads": a.threads, "context": a.context,
                      "results": res}))


if __name__ == "__main__":
    main()
