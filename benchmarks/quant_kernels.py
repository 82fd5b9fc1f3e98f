"""The quantised matmul (`--dtype native`): bytes streamed per second for each GGUF block type.

For each type, real rows of one of our GGUF files (tiled to `--mb` MB of packed weight, well past
the caches) are multiplied by M = 1, 2, 5, 8, 16 rows of activations; the same run measures the
machine's read bandwidth with the fp32 kernel's stream-read probe.  GB/s = packed bytes / median
time.  Variants are interleaved per repeat.  A table, then one JSON line.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2] [--mb 96] [--isa 0|2|512|1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SOURCES = {  # type -> (model, tensor): the tensors our three models run in that format
    "Q4_K": ("qwen2.5-coder-1.5b", "blk.0.ffn_gate.weight"),
    "Q6_K": ("qwen2.5-coder-1.5b", "blk.0.ffn_down.weight"),
    "Q5_0": ("qwen2.5-coder-0.5b", "blk.0.ffn_gate.weight"),
    "Q8_0": ("qwen2.5-coder-0.5b", "output.weight"),
    "Q4_1": ("smollm2-135m", "blk.0.ffn_gate.weight"),
}
MS = (1, 2, 5, 8, 16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mb", type=float, default=96.0)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--isa", type=int, default=0, help="0 = auto (per call: AMX from 16 rows where the CPU has it), 2 = AVX2, "
                    "512 = AVX-512 VNNI, 1024 = AMX")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from gguf import GGUFReader

    from specdec.runtime import kernels
    from specdec.runtime.hub import is_fetched, model_path
    from specdec.runtime.kernels import quant as Q

    buf = torch.ones(int(a.mb * 2**20 / 4))
    bw = []
    weights = {}
    for qtype, (model, name) in SOURCES.items():
        if not is_fetched(model):
            print(f"skip {qtype}: {model} not fetched")
            continue
        t = next(t for t in GGUFReader(str(model_path(model))).tensors if t.name == name)
        k = int(t.shape[0])
        rows = np.asarray(t.data)
        reps = max(1, int(a.mb * 2**20 // rows.nbytes) + 1)
        raw = np.tile(rows, (reps, 1))[: int(a.mb * 2**20 // rows.shape[1])]
        qw = Q.prepare_quant([Q.QuantTensor(qtype, np.ascontiguousarray(raw), (raw.shape[0], k))])
        weights[qtype] = (qw, {m: torch.randn(m, k) for m in MS})
    times = {(q, m): [] for q in weights for m in MS}
    ext = Q._qext()
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        kernels._ext.stream_read(buf, a.threads)
        bw.append(buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        for q, (qw, xs) in weights.items():
            fmts, ns = list(qw.fids), [qw.n]
            for m in MS:
                t0 = time.perf_counter()
                ext.qlinear(xs[m], qw.packed, fmts, ns, None, a.threads, a.isa)
                times[q, m].append(time.perf_counter() - t0)
    read_bw = statistics.median(bw)
    isa = a.isa or f"auto (best {ext.best_isa()})"
    print(f"threads {a.threads}, isa {isa}, stream read {read_bw:.1f} GB/s; GB/s of packed weight "
          f"(bits/weight) for M rows")
    print("| type | bits/w | " + " | ".join(f"M={m}" for m in MS) + " | M=5 / M=1 time |")
    print("|---|---|" + "---|" * (len(MS) + 1))
    res = {}
    for q, (qw, _) in weights.items():
        gbs = {m: qw.nbytes / statistics.median(times[q, m]) / 1e9 for m in MS}
        bits = qw.nbytes * 8 / (qw.n * qw.k)
        res[q] = {"bits_per_weight": bits, "gb_s": gbs}
        print(f"| {q} | {bits:.2f} | " + " | ".join(f"{gbs[m]:.1f}" for m in MS)
              + f" | {gbs[1] / gbs[5]:.2f} |")
    print(json.dumps({"benchmark": "quant_kernels", "threads": a.threads, "isa": isa,
                      "stream_read_gb_s": read_bw, "types": res}))


if __name__ == "__main__":
    main()
