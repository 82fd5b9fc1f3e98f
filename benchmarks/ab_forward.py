"""A/B of kernel sources at model level, in one process: forward(1) and forward(T) of a model at
`--dtype native`, each source built as its own extension and swapped in per repeat.

On a shared, noisy machine two benchmark processes run minutes apart can differ by 25%; here
the builds alternate inside one process (order reversed every repeat) on the same loaded model
and cache, so their ratio is what a change did.  Sources are files with the same functions as
`specdec/runtime/kernels/qlinear.cpp` (`--kernel qlinear`) or `fused.cpp` (`--kernel fused`), e.g. an old
revision: `git show HEAD~1:specdec/runtime/kernels/qlinear.cpp > /tmp/old.cpp`.  The first source is the
baseline.  A table, then one JSON line.

    .venv/bin/python benchmarks/ab_forward.py --kernel qlinear /tmp/old.cpp specdec/runtime/kernels/qlinear.cpp
        [--model qwen2.5-coder-1.5b] [--dtype native|q4_0] [--width 5] [--repeats 15] [--threads 2] [--context 200]

`--prompt` makes the wide forward prompt processing: logits at its last position only (without
it every position's logits are computed, as a verify does; at T = 2,048 that output head is most of
the time for Qwen).

`--kernel fused --attention-only` times just the attention calls of one forward (one per layer,
the model's shapes, each layer its own random cache; a 256 MB write between passes evicts the
caches as the rest of a forward would), for changes too small to see in a whole forward here.

`--kernel qlinear --matmul TENSOR` times one quantised matmul instead: the first `--rows` output
rows of that GGUF tensor (in its own format) times `--width` random activation rows, with
`--isa` (0 auto, 512 AVX-512 VNNI, 1024 AMX, ...), and checks every source's output bits against
the first's.  E.g. variants of the AMX K-quant routine with parts of it removed, to see where a
wide call's time goes:

    .venv/bin/python benchmarks/ab_forward.py --kernel qlinear /tmp/base.cpp /tmp/variant.cpp \
        --matmul blk.0.ffn_gate.weight --rows 2048 --width 512 --isa 1024 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

KERNELS = ("qlinear", "fused")


def build(src: str, kernel: str, root: Path):
    from torch.utils import cpp_extension

    from specdec.runtime import kernels
    from specdec.runtime.kernels import fused

    name = f"ab_{kernel}_{hashlib.sha256(Path(src).read_bytes()).hexdigest()[:12]}"
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, d / f"{name}.cpp")
    return cpp_extension.load(name=name, sources=[str(d / f"{name}.cpp")], build_directory=str(d),
                              extra_cflags=kernels.CFLAGS if kernel == "qlinear" else fused.CFLAGS,
                              extra_ldflags=["-fopenmp"])  # the flags the package builds it with


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", nargs="+", help="kernel source files; the first is the baseline")
    ap.add_argument("--kernel", choices=KERNELS, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", choices=("native", "q4_0"), default="native",
                    help="the GGUF's own blocks, or requantised to Q4_0 (how a draft may run)")
    ap.add_argument("--width", type=int, default=5, help="T of the wide forward (a verify of T-1 drafts)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--attention-only", action="store_true", help="--kernel fused: time attend alone")
    ap.add_argument("--prompt", action="store_true",
                    help="the wide forward returns the last position's logits only (prompt processing, as "
                         "benchmarks/prefill.py times it), not every position's (a verify)")
    ap.add_argument("--matmul", metavar="TENSOR", help="--kernel qlinear: time one matmul on this GGUF tensor")
    ap.add_argument("--rows", type=int, default=2048, help="--matmul: output rows of the tensor used")
    ap.add_argument("--isa", type=int, default=0, help="--matmul: 0 auto, 2 AVX2, 512 AVX-512 VNNI, 1024 AMX")
    args = ap.parse_args()
    if args.width < 2 or args.repeats < 1 or args.threads < 1 or args.context < 1:
        ap.error("--width must be >= 2, --repeats, --threads and --context >= 1")
    if args.attention_only and args.kernel != "fused":
        ap.error("--attention-only needs --kernel fused")
    if args.matmul and args.kernel != "qlinear":
        ap.error("--matmul needs --kernel qlinear")
    if args.prompt and (args.attention_only or args.matmul):
        ap.error("--prompt times whole forwards: not with --attention-only or --matmul")
    torch.set_num_threads(args.threads)
    if args.matmul:
        return matmul_ab(args)

    from specdec.loader import load_model
    from specdec.runtime.kernels import fused, quant

    module = quant if args.kernel == "qlinear" else fused
    with tempfile.TemporaryDirectory(prefix="specdec_ab_") as tmp:
        exts = [build(s, args.kernel, Path(tmp)) for s in args.sources]
        model, _ = load_model(args.model, dtype=args.dtype, device="cpu")
        g = torch.Generator().manual_seed(0)
        widths = (1, args.width)
        times = {(e, w): [] for e in range(len(exts)) for w in widths}
        if args.attention_only:
            a = model.args
            H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
            kvs = [(torch.randn(1, Hkv, args.context + args.width + 8, D, generator=g),
                    torch.randn(1, Hkv, args.context + args.width + 8, D, generator=g)) for _ in range(a.n_layers)]
            qkv = {w: torch.randn(1, w, (H + 2 * Hkv) * D, generator=g) for w in widths}
            flush = torch.zeros(64 << 20)
        else:
            cache = model.new_cache(1, args.context + args.width + 8)
            model.forward(torch.randint(0, 1000, (1, args.context), generator=g),
                          torch.arange(args.context)[None], cache)
            cache.advance(0, args.context)
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            order = list(range(len(exts)))[::-1 if rep % 2 else 1]
            for e in order:
                module._ext = exts[e]
                for w in widths:
                    pos = torch.arange(args.context, args.context + w)[None]
                    if args.attention_only:
                        flush.add_(1.0)
                        step = fused.plan(pos, None, None, model.cos, model.sin)
                        t0 = time.perf_counter()
                        for kc, vc in kvs:
                            fused.attend(step, qkv[w], kc, vc, H, Hkv)
                    else:
                        toks = torch.randint(0, 1000, (1, w), generator=g)
                        last = torch.full((1, 1), w - 1) if args.prompt and w > 1 else None
                        t0 = time.perf_counter()
                        model.forward(toks, pos, cache, logits_at=last)  # KV written past the context, never advanced
                    if rep:
                        times[e, w].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    T = args.width
    what = ("attention calls of one forward" if args.attention_only else f"--dtype {args.dtype}"
            + (", the wide forward's last logits only" if args.prompt else ""))
    print(f"{args.model}, {what}, {args.threads} threads, {args.context}-token cache, "
          f"median of {args.repeats}, builds alternating in one process")
    print(f"| source | T=1 | T={T} | T={T}/T=1 |")
    print("|---|---|---|---|")
    rows = []
    for e, s in enumerate(args.sources):
        a, b = med[e, 1], med[e, T]
        print(f"| {s} | {a:.2f} ms ({a / med[0, 1]:.3f}x) | {b:.2f} ms ({b / med[0, T]:.3f}x) | {b / a:.3f} |")
        rows.append({"source": s, "t1_ms": a, f"t{T}_ms": b, "t1_vs_base": a / med[0, 1],
                     f"t{T}_vs_base": b / med[0, T], "ratio": b / a})
    print(json.dumps({"benchmark": "ab_forward", "kernel": args.kernel, "model": args.model, "dtype": args.dtype,
                      "attention_only": args.attention_only, "prompt": args.prompt,
                      "threads": args.threads, "width": T, "repeats": args.repeats, "results": rows}))


def matmul_ab(args) -> None:
    """One qlinear call on real rows of a GGUF tensor, each source in turn (see --matmul)."""
    import numpy as np
    from gguf import GGUFReader

    from specdec.runtime.hub import model_path
    from specdec.runtime.kernels import quant

    t = next((t for t in GGUFReader(str(model_path(args.model))).tensors if t.name == args.matmul), None)
    if t is None:
        raise SystemExit(f"--matmul: no tensor {args.matmul!r} in {args.model}")
    qtype, k = t.tensor_type.name, int(t.shape[0])
    rows = np.ascontiguousarray(np.asarray(t.data)[: args.rows])
    qw = quant.prepare_quant([quant.QuantTensor(qtype, rows, (rows.shape[0], k))])
    x = torch.randn(args.width, k, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="specdec_ab_") as tmp:
        exts = [build(s, args.kernel, Path(tmp)) for s in args.sources]
        times, same, ref = {e: [] for e in range(len(exts))}, {}, None  # ref: source 0's output
        for rep in range(args.repeats + 1):  # repeat 0 warms up and checks the bits
            for e in list(range(len(exts)))[::-1 if rep % 2 else 1]:
                t0 = time.perf_counter()
                y = exts[e].qlinear(x, qw.packed, list(qw.fids), [qw.n], None, args.threads, args.isa)
                if rep:
                    times[e].append(time.perf_counter() - t0)
                elif e == 0:
                    ref = y
        for e in range(len(exts)):  # the bits, once more, outside the timed loop
            same[e] = bool(torch.equal(exts[e].qlinear(x, qw.packed, list(qw.fids), [qw.n], None,
                                                       args.threads, args.isa), ref))
    macs = args.width * qw.n * k
    base = statistics.median(times[0])
    print(f"{args.model} {args.matmul} ({qtype}) rows 0..{qw.n - 1}, K = {k}, M = {args.width}, "
          f"isa {args.isa}, {args.threads} threads, median of {args.repeats}, sources alternating in one process")
    print("| source | ms | GMAC/s | time / first | same bits as first |")
    print("|---|---|---|---|---|")
    rows_out = []
    for e, s in enumerate(args.sources):
        m = statistics.median(times[e])
        print(f"| {s} | {m * 1e3:.2f} | {macs / m / 1e9:.0f} | {m / base:.3f} | {same[e]} |")
        rows_out.append({"source": s, "ms": m * 1e3, "gmac_s": macs / m / 1e9, "vs_base": m / base, "same_bits": same[e]})
    print(json.dumps({"benchmark": "ab_forward", "kernel": "qlinear", "matmul": args.matmul, "qtype": qtype,
                      "model": args.model, "m": args.width, "n": qw.n, "k": k, "isa": args.isa,
                      "threads": args.threads, "repeats": args.repeats, "results": rows_out}))


if __name__ == "__main__":
    main()
