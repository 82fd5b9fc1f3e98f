"""Load time and peak resident memory per model and dtype: a checkout before the prepared-weights
cache against this one, cold and warm, each in a fresh process.

Each measurement is one subprocess under `/usr/bin/time -v` that imports specdec, loads the model
with `specdec.loader.load_model` (as `specdec generate` does) and runs one forward over a 16-token
prompt (the first token's logits). Reported: the load's wall time, the process's wall time to
that first token (imports included), peak resident memory, and the resident memory above the
runtime's own (peak after the imports, the kernel builds and nothing else), against the weights'
own bytes (the GGUF's tensors for native, 4 / 2 bytes a parameter for fp32 / bf16, the
requantised tensors for q4_0).

cold: an empty specdec cache (the model files linked in, each side's kernels built beforehand;
the OS page cache holds the files either way); warm: the same cache again, what every later start costs (median of
--repeats). Runs interleave before / after per repeat.

    git worktree add /tmp/before BASE_COMMIT   # the code before the change
    .venv/bin/python benchmarks/load.py --before /tmp/before [--configs smollm2-135m:native,...]
        [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = ["smollm2-135m:native", "smollm2-135m:fp32", "qwen2.5-coder-0.5b:q4_0",
           "qwen2.5-coder-1.5b:native", "qwen2.5-coder-1.5b:bf16", "qwen2.5-coder-1.5b:fp32"]

PROBE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[3]))
from specdec.loader import load_model
from specdec.runtime import kernels
from specdec.runtime.kernels import fused, quant
kernels.build(); fused.build(); quant._qext()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t1 = time.perf_counter()
model, tok = load_model(sys.argv[1], sys.argv[2], "cpu")
t2 = time.perf_counter()
ids = torch.tensor([tok.encode("def quicksort(items):\n    if len(items) <= 1: return items")[:16]])
model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, 64))
t3 = time.perf_counter()
a = model.args
params = a.vocab_size * a.dim * (1 if a.tie_embeddings else 2) + a.dim * (a.n_layers * 2 + 1) + a.n_layers * (
    a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim
    + 3 * a.dim * a.intermediate_size + (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * a.qkv_bias)
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "forward_s": t3 - t2, "base_mb": base,
                  "params": params, "held_mb": model.weight_bytes() / 2**20}))
"""


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def isa() -> str:
    flags = open("/proc/cpuinfo").read()
    return "AMX" if "amx_int8" in flags else "AVX-512" if "avx512f" in flags else "AVX2"


def own_mb(name: str, dtype: str, probe: dict, cache: Path) -> float:
    """The weights' own bytes, in MiB."""
    if dtype == "native":
        from gguf import GGUFReader

        from specdec.runtime.hub import model_path

        return sum(int(t.n_bytes) for t in GGUFReader(str(model_path(name))).tensors) / 2**20
    if dtype == "q4_0":  # the requantised model holds what it streams (plus a stored embedding)
        return probe["held_mb"]
    return probe["params"] * {"fp32": 4, "bf16": 2}[dtype] / 2**20


def run(root: Path, cache: Path, name: str, dtype: str, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "SPECDEC_CACHE": str(cache), "OMP_NUM_THREADS": str(threads)}
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", PROBE, name, dtype, str(threads)],
                       env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{root} {name} {dtype}: {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["peak_mb"] = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)[1]) / 1024
    m = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", p.stderr)
    out["wall_s"] = int(m[1] or 0) * 3600 + int(m[2]) * 60 + float(m[3])
    return out


def fresh_cache(shared: Path, side: str) -> Path:
    """The side's specdec cache emptied but for the model files (linked) and its built kernels:
    one fixed directory per side, since a kernel build is tied to its absolute path."""
    c = Path(tempfile.gettempdir()) / f"specdec-load-{side}"
    c.mkdir(exist_ok=True)
    for p in c.iterdir():
        if p.name != "ext":
            p.unlink() if p.is_symlink() or p.is_file() else shutil.rmtree(p)
    for sub in ("models", "downloads"):
        if (shared / sub).exists():
            (c / sub).symlink_to(shared / sub)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code before the change")
    ap.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="model:dtype,...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="warm starts per side (median)")
    a = ap.parse_args()
    shared = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
    sides = {"before": a.before.resolve(), "after": a.after.resolve()}
    for s, root in sides.items():  # build each side's kernels now, not inside a timed load
        subprocess.run([sys.executable, "-c", "from specdec.runtime import kernels; from specdec.runtime.kernels "
                        "import fused, quant; kernels.build(); fused.build(); quant._qext()"],
                       env={**os.environ, "PYTHONPATH": str(root), "SPECDEC_CACHE": str(fresh_cache(shared, s))},
                       cwd=root, check=True)
    rows = []
    for cfg in a.configs.split(","):
        name, dtype = cfg.split(":")
        res = {}
        caches = {s: fresh_cache(shared, s) for s in sides}
        for s, root in sides.items():  # cold: an empty cache (conversion, packing, writing it)
            res[s, "cold"] = run(root, caches[s], name, dtype, a.threads)
        warm = {s: [] for s in sides}
        for _ in range(a.repeats):  # warm: interleaved
            for s, root in sides.items():
                warm[s].append(run(root, caches[s], name, dtype, a.threads))
        for s in sides:
            res[s, "warm"] = {k: statistics.median(r[k] for r in warm[s]) for k in warm[s][0]}
        own = own_mb(name, dtype, res["after", "warm"], shared)
        for (s, mode), r in res.items():
            rows.append({"model": name, "dtype": dtype, "side": s, "mode": mode, "load_s": r["load_s"],
                         "first_token_s": r["wall_s"], "peak_mb": r["peak_mb"], "base_mb": r["base_mb"],
                         "weights_mb": own, "peak_over_weights": r["peak_mb"] / own,
                         "above_runtime_over_weights": (r["peak_mb"] - r["base_mb"]) / own})
            print(f"{name:20} {dtype:7} {s:6} {mode:4}  load {r['load_s']:7.2f} s  first token {r['wall_s']:7.2f} s"
                  f"  peak {r['peak_mb']:7.0f} MB  (runtime {r['base_mb']:4.0f})  weights {own:6.0f} MB", flush=True)
    print()
    print("| model | dtype | side | cold load s | warm load s | warm first token s | warm peak MB | "
          "peak / weights | (peak - runtime) / weights |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), 4):
        for s in ("before", "after"):
            cold, warm = (next(r for r in rows[i:i + 4] if r["side"] == s and r["mode"] == m) for m in ("cold", "warm"))
            print(f"| {warm['model']} | {warm['dtype']} | {s} | {cold['load_s']:.1f} | {warm['load_s']:.2f} | "
                  f"{warm['first_token_s']:.2f} | {warm['peak_mb']:.0f} | {warm['peak_over_weights']:.2f} | "
                  f"{warm['above_runtime_over_weights']:.2f} |")
    print(json.dumps({"benchmark": "load", "cpu": cpu_name(), "isa": isa(), "threads": a.threads, "rows": rows}))


if __name__ == "__main__":
    main()
