"""Prompt processing at `--dtype native`: ours (each kernel ISA this CPU has) against llama.cpp.

For each model and prompt length T: one forward over T random prompt tokens into a fresh cache,
logits for the last position only (what time to first token pays before the first decode step),
in chunks of `--chunk` tokens (0: the whole prompt in one forward; a comma list compares chunk
sizes, interleaved like the kernels).  Ours runs once per kernel setting in `--kernels` (`auto`: AMX tiles where the CPU has them and a call
is wide enough; `avx512`: the AVX-512 VNNI routine only, what ran before AMX; `avx2`), and
llama.cpp (`llama-cpp-python`, `make bench-deps`; on an AMX machine build it with AMX off, see
docs/bench/README.md) on the same GGUF with the same threads, all interleaved per repeat;
medians.  The int8 matmul rate counts 2 operations per multiply-add of the model's weights
(the layers' matmuls: the head runs once) and is shown against the machine's int8 peak (cores x MHz x multiply-adds
per cycle: 1,024 with AMX tiles, 128 with AVX-512 VNNI (64 on AMD Zen 4, family 25, which runs
each 512-bit operation as two 256-bit halves), 32 with AVX2).  Then forward(M) /
forward(1) after a 200-token context for the verify and server widths, each with its share of the
int8 peak (the layers' and the head's multiply-adds: it computes logits at every position).  A
table, one JSON line.

    .venv/bin/python benchmarks/prefill.py [--models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
        [--lengths 128,512,2048] [--threads 2] [--repeats 3] [--kernels auto,avx512] [--no-llamacpp]
        [--chunk 0,256,512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def cpu_info() -> tuple[str, float, set[str]]:
    """(model name, MHz, flags); an AMD Zen 4 (family 25 with AVX-512) gets the pseudo-flag
    "zen4_avx512": its 512-bit integer multiply-adds run as two 256-bit halves."""
    name, mhz, flags, amd, family = "unknown CPU", 0.0, set(), False, 0
    with open("/proc/cpuinfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            k = k.strip()
            if k == "model name" and name == "unknown CPU":
                name = v.strip()
            elif k == "cpu MHz" and not mhz:
                mhz = float(v)
            elif k == "flags" and not flags:
                flags = set(v.split())
            elif k == "vendor_id":
                amd = v.strip() == "AuthenticAMD"
            elif k == "cpu family" and not family:
                family = int(v)
    if amd and family == 25 and "avx512f" in flags:
        flags.add("zen4_avx512")
    return name, mhz, flags


def peak_gops(threads: int, mhz: float, flags: set[str], kernel: str) -> float:
    amx = {"amx_tile", "amx_int8"} <= flags
    vnni = "avx512_vnni" in flags
    if kernel == "auto":
        kernel = "amx" if amx else "avx512" if vnni else "avx2"
    macs = {"amx": 1024, "avx512": 64 if "zen4_avx512" in flags else 128, "avx2": 32}[kernel]
    return 2 * macs * mhz * 1e6 * threads / 1e9


def matmul_params(model) -> int:
    """Multiply-adds per prompt token in the layers' matmuls (the output head runs for the last
    token only)."""
    return sum(w.n * w.k for lw in model.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down))


def head_params(model) -> int:
    """Multiply-adds per position of the output head (a forward(M) below computes logits at
    every position)."""
    h = model.lm_head
    return h.n * h.k if h is not None and hasattr(h, "n") else 0


def llamacpp(name: str, threads: int, ctx: int):
    from llama_cpp import Llama

    from specdec.runtime.hub import model_path

    llm = Llama(model_path=str(model_path(name)), n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, n_ubatch=512, logits_all=False, verbose=False, seed=0)

    def run(tokens: list[int]) -> None:
        llm.reset()
        llm.eval(tokens)
    return run


def ours(model, chunk: int):
    def run(tokens: torch.Tensor) -> None:  # [T]
        t = tokens.numel()
        cache = model.new_cache(1, t + 8)
        step = chunk or t
        for s in range(0, t, step):
            e = min(t, s + step)
            at = torch.tensor([[e - s - 1]]) if e == t else torch.zeros(1, 0, dtype=torch.long)
            model.forward(tokens[None, s:e], torch.arange(s, e)[None], cache, logits_at=at)
            cache.advance(0, e - s)
    return run


def widths(model, ms: list[int], repeats: int, context: int = 200) -> dict[int, float]:
    """Median forward(M) ms after a `context`-token cache, rolled back after each."""
    cache = model.new_cache(1, context + max(ms) + 8)
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(0, 1000, (1, context), generator=g), torch.arange(context)[None], cache)
    cache.advance(0, context)
    times = {m: [] for m in ms}
    for rep in range(repeats + 1):
        for m in ms:
            toks = torch.randint(0, 1000, (1, m), generator=g)
            t0 = time.perf_counter()
            model.forward(toks, torch.arange(context, context + m)[None], cache)
            if rep:
                times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(v) * 1e3 for m, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", default="0", help="prefill chunk(s), comma-separated (0: the whole prompt)")
    ap.add_argument("--kernels", default="auto,avx512", help="SPECDEC_KERNEL settings to compare")
    ap.add_argument("--widths", default="1,5,16,40,80,128")
    ap.add_argument("--no-llamacpp", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specdec.loader import load_model

    cpu, mhz, flags = cpu_info()
    lengths = [int(x) for x in a.lengths.split(",")]
    chunks = [int(x) for x in a.chunk.split(",")]
    # one column per (kernel, chunk): the kernel's name alone when one chunk size is measured
    variants = {(k if len(chunks) == 1 else f"{k}/{c or 'whole'}"): (k, c)
                for k in a.kernels.split(",") for c in chunks}
    kernels = list(variants)
    ms = [int(x) for x in a.widths.split(",")]
    results = {}
    for name in a.models.split(","):
        model, _ = load_model(name, dtype="native", device="cpu")
        macs = matmul_params(model)
        lc = None if a.no_llamacpp else llamacpp(name, a.threads, max(lengths) + 16)
        g = torch.Generator().manual_seed(0)
        res = {}
        for t in lengths:
            toks = torch.randint(0, 1000, (t,), generator=g)
            times = {k: [] for k in kernels + (["llama.cpp"] if lc else [])}
            for rep in range(a.repeats + 1):  # repeat 0 warms up
                for k in kernels:
                    kern, chunk = variants[k]
                    os.environ["SPECDEC_KERNEL"] = "" if kern == "auto" else kern
                    time.sleep(0.05)  # llama.cpp's threads stop polling
                    t0 = time.perf_counter()
                    ours(model, chunk)(toks)
                    if rep:
                        times[k].append(time.perf_counter() - t0)
                os.environ.pop("SPECDEC_KERNEL", None)
                if lc:
                    time.sleep(0.05)
                    t0 = time.perf_counter()
                    lc(toks.tolist())
                    if rep:
                        times["llama.cpp"].append(time.perf_counter() - t0)
            row = {}
            for k, v in times.items():
                s = statistics.median(v)
                row[k] = {"s": s, "tok_s": t / s}
                if k != "llama.cpp":
                    gops = 2 * macs * t / s / 1e9
                    row[k].update(gops=gops, peak_frac=gops / peak_gops(a.threads, mhz, flags, variants[k][0]))
            res[t] = row
        fw = {}
        for k in dict.fromkeys(kern for kern, _ in variants.values()):
            os.environ["SPECDEC_KERNEL"] = "" if k == "auto" else k
            fw[k] = widths(model, ms, a.repeats)
        os.environ.pop("SPECDEC_KERNEL", None)
        per_row = macs + head_params(model)
        fw_peak = {k: {m: 2 * per_row * m / (t / 1e3) / 1e9 / peak_gops(a.threads, mhz, flags, k) for m, t in f.items()}
                   for k, f in fw.items()}
        results[name] = {"prefill": res, "forward_ms": fw, "forward_peak_frac": fw_peak}
        del model, lc

    print(f"{cpu}, {a.threads} threads, {mhz:.0f} MHz; --dtype native; chunk {a.chunk if a.chunk != '0' else 'whole prompt'}; "
          f"median of {a.repeats}")
    cols = kernels + ([] if a.no_llamacpp else ["llama.cpp"])
    print("| model | T | " + " | ".join(f"{k} tok/s" for k in cols)
          + (" | auto / llama.cpp" if not a.no_llamacpp else "") + " | auto int8 GOP/s (of peak) |")
    print("|---|---|" + "---|" * (len(cols) + (0 if a.no_llamacpp else 1) + 1))
    for name, r in results.items():
        for t, row in r["prefill"].items():
            cells = [f"{row[k]['tok_s']:.0f}" for k in cols]
            if not a.no_llamacpp:
                cells.append(f"{row[kernels[0]]['tok_s'] / row['llama.cpp']['tok_s']:.2f}x")
            au = row[kernels[0]]
            cells.append(f"{au['gops']:.0f} ({au['peak_frac']:.1%})")
            print(f"| {name} | {t} | " + " | ".join(cells) + " |")
    print()
    print("forward(M) / forward(1), 200-token context (int8 peak fraction: layers' and head's multiply-adds)")
    print("| model | kernel | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|---|" + "---|" * len(ms))
    for name, r in results.items():
        for k, f in r["forward_ms"].items():
            pk = r["forward_peak_frac"][k]
            print(f"| {name} | {k} | " + " | ".join(f"{f[m]:.1f} ms ({f[m] / f[ms[0]]:.2f}x, {pk[m]:.0%})" for m in ms)
                  + " |")
    print(json.dumps({"benchmark": "prefill", "cpu": cpu, "threads": a.threads, "chunk": chunks if len(chunks) > 1 else chunks[0],
                      "results": results}))


if __name__ == "__main__":
    main()
