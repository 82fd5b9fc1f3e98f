"""A draft tree's attention against a chain's of the same width: the fused kernel's attend over
T = 11 new tokens (a (2, 2, 1) tree under its ancestor mask, or 11 causal tokens) after a
250-token history, at SmolLM2's and Qwen 1.5B's head shapes; medians of interleaved calls.

    .venv/bin/python benchmarks/tree_attention.py                          # this checkout
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/tree_attention.py   # A/B

Ends with one JSON line. The tree's nodes must cost what a chain's tokens do (each node's bits
are a plain forward's over its path either way: tests/test_tree_attention.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

from specdec.runtime.kernels import fused
from specdec.tree import ancestor_mask, depths, tree_from_widths

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-coder-1.5b": (12, 2, 128)}


def measure(H: int, Hkv: int, D: int, history: int, reps: int, threads: int) -> tuple[float, float]:
    parents = tree_from_widths((2, 2, 1))
    T, S = len(parents) + 1, history + 64
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, T, (H + 2 * Hkv) * D, generator=g)
    kc, vc = torch.randn(1, Hkv, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g)
    cos, sin = torch.randn(S, D // 2, generator=g), torch.randn(S, D // 2, generator=g)
    chain = (history - 1 + torch.arange(T)).view(1, T)
    tree = (history - 1 + depths(parents)).view(1, T)
    mask = ancestor_mask(parents).unsqueeze(0)
    calls = {"chain": lambda: fused._ext.attend(qkv, chain, cos, sin, kc, vc, None, None, H, Hkv, threads, None),
             "tree": lambda: fused._ext.attend(qkv, tree, cos, sin, kc, vc, None, mask, H, Hkv, threads, chain)}
    times = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return statistics.median(times["chain"]) * 1e6, statistics.median(times["tree"]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", type=int, default=250)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if fused.build() is None:
        raise SystemExit("the fused extension did not build on this machine")
    print(f"{cpu_name()}, {a.threads} threads, 11 new tokens after {a.history}; median of {a.reps}")
    print(f"{'shape':22s} {'chain us':>9s} {'tree us':>9s} {'tree / chain':>13s}")
    rows = {}
    for name, (H, Hkv, D) in SHAPES.items():
        c, t = measure(H, Hkv, D, a.history, a.reps, a.threads)
        rows[name] = {"heads": H, "kv_heads": Hkv, "head_dim": D, "chain_us": c, "tree_us": t, "ratio": t / c}
        print(f"{name:22s} {c:9.1f} {t:9.1f} {t / c:12.2f}x")
    print(json.dumps({"benchmark": "tree_attention", "cpu": cpu_name(), "threads": a.threads,
                      "history": a.history, "rows": rows}))


if __name__ == "__main__":
    main()
