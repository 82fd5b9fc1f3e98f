"""Benchmark the few-row weight-streaming kernel against F.linear on this CPU.

1. Read bandwidth: the extension's AVX2 read loop (and torch.sum for reference)
   over a 1 GiB fp32 buffer, 1 and 2 threads.
2. For the linear shapes of SmolLM2-135M and Qwen2.5-Coder-1.5B and M rows:
   time of our kernel (fp32 and bf16 storage) and of F.linear (fp32), the GB/s
   of weight bytes streamed, and t(M)/t(1).

Weights are timed *cold*, as in a real forward where the whole model streams
through the caches: each measurement cycles over enough copies of the weight
to exceed the last-level cache several times.  Times are medians of repeated
rounds; torch.set_num_threads(2).  Prints a table, then one JSON summary line.

    python benchmarks/kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import kernels

THREADS = 2
LLC_BYTES = 32 << 20      # L3 of the dev box; copies are sized to 4x this
COLD_BYTES = 4 * LLC_BYTES
MS = (1, 2, 4, 5, 8, 16)
SHAPES = {  # name -> [N, K] (out_features, in_features)
    "smol.q/o": (576, 576),
    "smol.k/v": (192, 576),
    "smol.gate/up": (1536, 576),
    "smol.down": (576, 1536),
    "smol.lm_head": (49152, 576),
    "qwen.q/o": (1536, 1536),
    "qwen.k/v": (256, 1536),
    "qwen.gate/up": (8960, 1536),
    "qwen.down": (1536, 8960),
    "qwen.lm_head": (151936, 1536),
}
BIG = ("smol.lm_head", "qwen.gate/up", "qwen.down", "qwen.lm_head")


def median_time(fn, rounds: int, calls_per_round: int) -> float:
    """Median over rounds of (round time / calls); fn(i) does call i of a round."""
    for i in range(calls_per_round):  # warm-up (page faults, thread pool spin-up)
        fn(i)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls_per_round):
            fn(i)
        ts.append((time.perf_counter() - t0) / calls_per_round)
    return statistics.median(ts)


def bandwidth(rounds: int) -> dict:
    buf = torch.rand(256 << 20)  # 1 GiB fp32
    ext = kernels.build()
    out = {}
    for nt in (1, 2):
        torch.set_num_threads(nt)
        out[f"torch_sum_{nt}t"] = buf.numel() * 4 / median_time(lambda i: buf.sum(), rounds, 1) / 1e9
        if ext is not None:
            out[f"ext_read_{nt}t"] = buf.numel() * 4 / median_time(
                lambda i: ext.stream_read(buf, nt), rounds, 1) / 1e9
    torch.set_num_threads(THREADS)
    return out


def bench_shape(n: int, k: int, ms, rounds: int) -> dict:
    """{impl: {M: seconds}} for one weight shape."""
    wbytes = n * k * 4
    copies = max(2, -(-COLD_BYTES // wbytes))  # enough copies to defeat the LLC
    ws = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
    impls = {"torch": lambda x, i: F.linear(x, ws[i])}
    if kernels.kernel_available():
        pw32 = [kernels.prepare_weight(w, "fp32") for w in ws]
        pw16 = [kernels.prepare_weight(w, "bf16") for w in ws]
        impls["ours_fp32"] = lambda x, i: kernels.linear(x, pw32[i])
        impls["ours_bf16"] = lambda x, i: kernels.linear(x, pw16[i])
    res = {name: {} for name in impls}
    for m in ms:
        x = torch.randn(m, k)
        for name, f in impls.items():
            res[name][m] = median_time(lambda i: f(x, i), rounds, copies)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, big shapes only")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 11)
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)

    avail = kernels.kernel_available()
    bw = bandwidth(rounds)
    peak = max(v for key, v in bw.items() if key.endswith(f"_{THREADS}t"))
    print(f"kernel available: {avail}   threads: {THREADS}   (weights cold: cycled over >= "
          f"{COLD_BYTES >> 20} MiB)")
    print("read bandwidth, 1 GiB fp32: " + "  ".join(f"{k_}={v:.1f} GB/s" for k_, v in bw.items()))
    print()

    shapes = {s: SHAPES[s] for s in (BIG if args.quick else SHAPES)}
    hdr = (f"{'shape':<14}{'[N, K]':>14} {'impl':<10}" + "".join(f"{'M=' + str(m):>9}" for m in MS)
           + f"{'GB/s@1':>8}{'%bw':>6}" + "".join(f"{'t' + str(m) + '/t1':>8}" for m in (2, 5, 8, 16))
           + f"{'vs torch@5':>11}")
    print("times in microseconds (median); GB/s = weight bytes streamed / time")
    print(hdr)
    print("-" * len(hdr))
    summary = {}
    for name, (n, k) in shapes.items():
        res = bench_shape(n, k, MS, rounds)
        for impl, t in res.items():
            wb = n * k * (2 if impl.endswith("bf16") else 4)
            gbs = wb / t[1] / 1e9
            ratios = {m: t[m] / t[1] for m in MS}
            speed5 = res["torch"][5] / t[5]
            print(f"{name:<14}{str([n, k]):>14} {impl:<10}"
                  + "".join(f"{t[m] * 1e6:>9.1f}" for m in MS)
                  + f"{gbs:>8.1f}{100 * gbs / peak:>5.0f}%"
                  + "".join(f"{ratios[m]:>8.2f}" for m in (2, 5, 8, 16))
                  + f"{speed5:>10.2f}x")
            summary.setdefault(name, {})[impl] = {
                "us": {m: round(t[m] * 1e6, 1) for m in MS},
                "gbs_m1": round(gbs, 1),
                "ratio": {m: round(ratios[m], 3) for m in MS if m > 1},
            }
        print()
    print(json.dumps({"threads": THREADS, "kernel_available": avail,
                      "bandwidth_gbs": {k_: round(v, 1) for k_, v in bw.items()},
                      "shapes": summary}, separators=(",", ":")))


if __name__ == "__main__":
    main()
