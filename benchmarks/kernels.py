"""Benchmark the few-row weight-streaming kernel against F.linear on this CPU.

1. Read bandwidth: the extension's AVX2 read loop (and torch.sum, for
   reference) over a 1 GiB fp32 buffer with 1 and 2 threads, measured at the
   start and again at the end of the run (the box is shared; drift shows).
2. For the linear shapes of SmolLM2-135M and Qwen2.5-Coder-1.5B and M rows:
   our kernel (fp32 and bf16 storage) against F.linear (fp32): median time,
   GB/s of weight bytes streamed, t(M)/t(1), and the speed-up over F.linear.
3. (--crossover) larger M, to see where F.linear catches up; this is what
   MAX_KERNEL_ROWS in specdec/kernels is based on.

The dev box is a shared 2-vCPU VM: at times the host starves the second vCPU
and every 2-thread fork/join waits 4-16 ms.  The run measures read bandwidth
at its start and end and flags itself (JSON "contended") when 2 threads read
less than 1.3x what 1 thread reads; rerun then.

Weights are timed *cold*, as in a real forward where the whole model streams
through the caches: calls cycle over enough copies of the weight to exceed the
last-level cache 4x.  Every call is timed on its own and the implementations
are interleaved round by round, so the medians shrug off the host's stalls.
torch.set_num_threads(2).  Prints tables, then exactly one JSON summary line.

    python benchmarks/kernels.py [--quick] [--crossover] [--isa auto|avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from specdec import kernels

THREADS = 2
COLD_BYTES = 128 << 20  # 4x the 32 MiB L3 of the dev box
MS = (1, 2, 4, 5, 8, 16)
XO_MS = (16, 64, 256, 512)
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


def interleaved_medians(fns: dict, copies: int, min_calls: int, min_seconds: float) -> dict:
    """{name: median seconds per call}; fns[name](i) runs one call on copy i.

    Rounds go over all copies for each fn in turn (same conditions for all);
    each call is timed alone so a host stall spoils one sample, not a round.
    """
    samples = {name: [] for name in fns}
    for f in fns.values():  # warm-up: page faults, thread pool spin-up
        for i in range(copies):
            f(i)
    t_end = time.perf_counter() + min_seconds
    while min(len(s) for s in samples.values()) < min_calls or time.perf_counter() < t_end:
        for name, f in fns.items():
            s = samples[name]
            for i in range(copies):
                t0 = time.perf_counter()
                f(i)
                s.append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def bandwidth() -> dict:
    """Read GB/s over 1 GiB, 1 and 2 threads (median of 7 passes each)."""
    buf = torch.rand(256 << 20)
    ext = kernels.build()
    fns = {}
    for nt in (1, 2):
        def tsum(i, nt=nt):
            torch.set_num_threads(nt)
            buf.sum()
        fns[f"torch_sum_{nt}t"] = tsum
        if ext is not None:
            fns[f"ext_read_{nt}t"] = lambda i, nt=nt: ext.stream_read(buf, nt)
    med = interleaved_medians(fns, 1, 7, 0.0)
    torch.set_num_threads(THREADS)
    return {k: buf.numel() * 4 / t / 1e9 for k, t in med.items()}


def bench_shape(n: int, k: int, ms, impls=("torch", "ours_fp32", "ours_bf16"), quick=False) -> dict:
    """{impl: {M: seconds}} for one [N, K] weight, cold.

    "ours_*" always run the C++ kernel (also past MAX_KERNEL_ROWS, for the
    crossover), through the same wrapper `linear` uses.
    """
    wbytes = n * k * 4
    copies = max(2, -(-COLD_BYTES // wbytes))
    ws = [torch.randn(n, k) / k**0.5 for _ in range(copies)]
    make = {"torch": lambda x: (lambda i: F.linear(x, ws[i]))}
    if kernels.kernel_available():
        pw = {dt: [kernels.prepare_weight(w, dt) for w in ws] for dt in ("fp32", "bf16")}
        make["ours_fp32"] = lambda x: (lambda i: kernels._kernel_linear(x, pw["fp32"][i]))
        make["ours_bf16"] = lambda x: (lambda i: kernels._kernel_linear(x, pw["bf16"][i]))
    impls = [i for i in impls if i in make]
    res = {name: {} for name in impls}
    min_calls, min_s = (15, 0.05) if quick else (41, 0.2)
    for m in ms:
        x = torch.randn(m, k)
        med = interleaved_medians({name: make[name](x) for name in impls}, copies, min_calls, min_s)
        for name in impls:
            res[name][m] = med[name]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="big shapes only, fewer samples")
    ap.add_argument("--crossover", action="store_true", help="also M = 16..512 on big shapes")
    ap.add_argument("--isa", choices=("auto", "avx2"), default="auto",
                    help="avx2: keep the kernel on its AVX2 tiles (SPECDEC_KERNEL=avx2)")
    args = ap.parse_args()
    if args.isa == "avx2":
        os.environ["SPECDEC_KERNEL"] = "avx2"
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)

    avail = kernels.kernel_available()
    bw0 = bandwidth()
    peak = max(bw0.get(f"ext_read_{THREADS}t", 0.0), bw0[f"torch_sum_{THREADS}t"])
    print(f"kernel available: {avail}  isa: {kernels.kernel_isa()}  threads: {THREADS}  "
          f"MAX_KERNEL_ROWS: {kernels.MAX_KERNEL_ROWS}  (weights cold: cycled over >= "
          f"{COLD_BYTES >> 20} MiB of copies)")
    print("read bandwidth, 1 GiB fp32 (start): "
          + "  ".join(f"{k_}={v:.1f}" for k_, v in bw0.items()) + "  GB/s")
    print()

    shapes = {s: SHAPES[s] for s in (BIG if args.quick else SHAPES)}
    hdr = (f"{'shape':<14}{'[N, K]':>15} {'impl':<10}" + "".join(f"{'M=' + str(m):>9}" for m in MS)
           + f"{'GB/s@1':>8}{'%bw':>5}" + "".join(f"{'t' + str(m) + '/t1':>7}" for m in (2, 4, 5, 8, 16))
           + f"{'vs F.linear @M=1,5,16':>23}")
    print(f"time per call in microseconds (median); GB/s = weight bytes / time; %bw = of the "
          f"{THREADS}-thread read bandwidth ({peak:.1f} GB/s)")
    print(hdr)
    print("-" * len(hdr))
    summary = {}
    for name, (n, k) in shapes.items():
        res = bench_shape(n, k, MS, quick=args.quick)
        for impl, t in res.items():
            gbs = n * k * (2 if impl.endswith("bf16") else 4) / t[1] / 1e9
            ratio = {m: t[m] / t[1] for m in MS}
            speed = {m: res["torch"][m] / t[m] for m in (1, 5, 16)}
            print(f"{name:<14}{str([n, k]):>15} {impl:<10}"
                  + "".join(f"{t[m] * 1e6:>9.1f}" for m in MS)
                  + f"{gbs:>8.1f}{100 * gbs / peak:>4.0f}%"
                  + "".join(f"{ratio[m]:>7.2f}" for m in (2, 4, 5, 8, 16))
                  + ("" if impl == "torch" else
                     f"{'':>5}" + " ".join(f"{speed[m]:5.2f}x" for m in (1, 5, 16))))
            summary.setdefault(name, {})[impl] = {
                "us": {m: round(t[m] * 1e6, 1) for m in MS},
                "gbs_m1": round(gbs, 1),
                "t_ratio": {m: round(ratio[m], 3) for m in MS if m > 1},
            }
        print()

    xo = {}
    if args.crossover:
        print("crossover: F.linear time / our time at larger M (> 1: ours faster)")
        for name in BIG[:3]:
            n, k = SHAPES[name]
            res = bench_shape(n, k, XO_MS, quick=True)
            for impl in ("ours_fp32", "ours_bf16"):
                if impl in res:
                    sp = {m: res["torch"][m] / res[impl][m] for m in XO_MS}
                    xo.setdefault(name, {})[impl] = {m: round(v, 2) for m, v in sp.items()}
                    print(f"  {name:<14}{impl:<10}" + "".join(f"  M={m}: {v:.2f}x" for m, v in sp.items()))
        print()

    bw1 = bandwidth()
    print("read bandwidth, 1 GiB fp32 (end):   "
          + "  ".join(f"{k_}={v:.1f}" for k_, v in bw1.items()) + "  GB/s")
    contended = any(bw[f"torch_sum_{THREADS}t"] < 1.3 * bw["torch_sum_1t"] for bw in (bw0, bw1))
    if contended:
        print("WARNING: 2 threads read < 1.3x one thread: the second vCPU looks contended; "
              "2-thread numbers are unreliable, rerun")
    print(json.dumps({"threads": THREADS, "kernel_available": avail, "isa": kernels.kernel_isa(),
                      "max_kernel_rows": kernels.MAX_KERNEL_ROWS, "contended": contended,
                      "bandwidth_gbs": {"start": {k_: round(v, 1) for k_, v in bw0.items()},
                                        "end": {k_: round(v, 1) for k_, v in bw1.items()}},
                      "shapes": summary, "crossover_speedup": xo}, separators=(",", ":")))


if __name__ == "__main__":
    main()
