"""The draft head against the other proposers: plain decoding, the head at fixed k and adaptive k,
n-gram lookup (adaptive k), and for the Qwen pair the 0.5B draft (q4_0, k = 4, the demo's, or `--draft-ks`), on
the same prompts, interleaved per prompt (`specdec bench`'s own runner and table). Decode
tokens/s exclude the prompt; speedups are per-prompt ratios to plain, median over prompts; greedy
speculative output must equal plain token for token (`greedy_mismatches`).

    .venv/bin/python benchmarks/head.py --model smollm2-135m --head DIR --prompts chat
    .venv/bin/python benchmarks/head.py --model qwen2.5-coder-1.5b --head DIR --prompts humaneval --draft
    .venv/bin/python benchmarks/head.py --baseline-head DIR ...   # another head beside it, same prompts
    .venv/bin/python benchmarks/head.py --step-ab ...              # first: one draft step, fused vs torch
    .venv/bin/python benchmarks/head.py --ks 1,2 --trees 3 3,1 auto  # head draft trees beside its chains
    .venv/bin/python benchmarks/head.py --composite 1,auto             # n-gram lookup first, then the head

Held out: the chat set and HumanEval are never in a head's training data (specdec.head.data).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.head import load_head, shipped_head
from specdec.head.model import HeadCache
from specdec.loader import build_engine, load_models
from specdec.runtime.kernels import prepare_weight
from specdec.runtime.kernels.quant import QuantWeight
from specdec.tools import bench
from specdec.tools.prompts import load_prompts


def step_ab(models, head_dir: str | None, model: str, reps: int = 300) -> dict:
    """One draft step (B = 1, one pair after a 256-pair prefill, as decoding drafts) on the
    prepared head: the fused layer path against the torch ops, interleaved; median ms and their
    ratio to one plain target forward (B = 1, T = 1) timed in the same loop."""
    target = models.target
    head = load_head(head_dir or shipped_head(model), target).prepare()
    d = head.cfg.dim
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 256, head.cfg.feature_dim, generator=g)  # the target's features (taps, f_j)
    toks = torch.randint(0, 1000, (1, 256), generator=g)
    caches = {n: HeadCache(1, head.cfg.n_kv_heads, head.cfg.head_dim, 512) for n in ("fused", "torch")}
    fns = {"fused": head._step_layer, "torch": head._step_torch}
    tcache = target.new_cache(1, 512)
    with torch.inference_mode():
        target.forward(toks, torch.arange(256).view(1, -1), tcache, logits_at=torch.zeros(1, 0, dtype=torch.long))
        for n, fn in fns.items():
            fn(feats, toks, torch.arange(256).view(1, -1), caches[n], [0])
        times = {"fused": [], "torch": [], "target": []}
        f1, t1, p1 = feats[:, :1, -d:], toks[:, :1], torch.tensor([[256]])  # a draft step feeds its own g
        for _ in range(reps):
            for n, fn in fns.items():
                t0 = time.perf_counter()
                fn(f1, t1, p1, caches[n], [0])
                times[n].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            target.forward(t1, p1, tcache)
            times["target"].append(time.perf_counter() - t0)
    med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
    print(f"{'draft step':<14} {'ms (median)':>12} {'x target forward':>17}")
    for n in ("fused", "torch", "target"):
        print(f"{n:<14} {med[n]:>12.3f} {med[n] / med['target']:>17.3f}")
    print(f"fused / torch: {med['fused'] / med['torch']:.2f}x the time")
    return {"step_ms": {n: round(v, 4) for n, v in med.items()}, "fused_vs_torch": round(med["fused"] / med["torch"], 3)}


def bf16_weights(proposer) -> None:
    """The proposer's head drafting as before Q8_0: bf16 panels for its linears and output rows
    (its own copy of the head; the engines beside it keep theirs)."""
    head = copy.copy(proposer.head)
    head._kernels = {n: prepare_weight(getattr(head, n).weight, "bf16") if isinstance(w, QuantWeight) else w
                     for n, w in head._kernels.items()}
    proposer.head = head
    proposer.rows_out = prepare_weight(head.out[head.vocab < proposer.V], "bf16")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="a trained head (default: the shipped one)")
    ap.add_argument("--draft", action="store_true", help="also the 0.5B draft (Qwen pair)")
    ap.add_argument("--draft-ks", default="4", help="the 0.5B draft's k (a list; auto: adaptive)")
    ap.add_argument("--prompts", default="chat")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--ks", default="2,3,4,auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trees", nargs="*", default=[], metavar="W1,W2,...|auto|dynamic[:N]",
                    help="head draft trees (children per depth, k = depth; auto: adaptive k and shape; "
                         "dynamic: grown by the head's confidence, depth --dynamic-k)")
    ap.add_argument("--dynamic-k", default="4", help="depth of the dynamic trees (an integer or auto)")
    ap.add_argument("--composite", default="", metavar="K,K,...",
                    help="also the n-gram + head composite at these k (an integer or auto)")
    ap.add_argument("--ngram-min", default="1", help="the composite's shortest n-gram match (a list: one row each)")
    ap.add_argument("--baseline-head", default=None, help="another head, benchmarked beside --head")
    ap.add_argument("--baseline-ks", default="auto", help="the baseline head's k (a list)")
    ap.add_argument("--bf16-ks", default="", metavar="K,K,...",
                    help="also the head at these k drafting on bf16 weights and output rows (before Q8_0)")
    ap.add_argument("--step-ab", action="store_true", help="first time one draft step: fused vs torch ops")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    draft = "qwen2.5-coder-0.5b" if a.draft else None
    t0 = time.perf_counter()
    models = load_models(a.model, draft, "native", "q4_0")
    load_s = time.perf_counter() - t0
    ab = step_ab(models, a.head, a.model) if a.step_ab else None
    prompts = load_prompts(a.prompts, a.num_prompts)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=0 if a.temperature else None)
    settings = bench.BenchSettings(prompts=prompts, params=params, ks=[], proposer="head", head=a.head,
                                   max_seq_len=4096)
    configs = [bench.Ours(bench.PLAIN, build_engine(models, None, 4096), 0)]
    for k in a.ks.split(","):
        k = k if k == "auto" else int(k)
        spec = SpeculativeConfig(proposer="head", head=a.head, num_draft_tokens=k)
        configs.append(bench.Ours(f"head k={k}", build_engine(models, spec, 4096), k, "head"))
    for widths in a.trees:
        dyn_k = a.dynamic_k if a.dynamic_k == "auto" else int(a.dynamic_k)
        k = "auto" if widths == "auto" else dyn_k if widths.startswith("dynamic") else len(widths.split(","))
        spec = SpeculativeConfig(proposer="head", head=a.head, num_draft_tokens=k, draft_tree=widths)
        configs.append(bench.Ours(f"head tree {widths}", build_engine(models, spec, 4096), k, "head"))
    for k in filter(None, a.composite.split(",")):
        k = k if k == "auto" else int(k)
        for m in (int(x) for x in a.ngram_min.split(",")):
            spec = SpeculativeConfig(proposer="composite", head=a.head, num_draft_tokens=k, ngram_min=m)
            name = f"composite k={k}" + (f" ngram-min {m}" if a.ngram_min != "1" else "")
            configs.append(bench.Ours(name, build_engine(models, spec, 4096), k, "composite"))
    for k in filter(None, a.bf16_ks.split(",")):
        k = k if k == "auto" else int(k)
        eng = build_engine(models, SpeculativeConfig(proposer="head", head=a.head, num_draft_tokens=k), 4096)
        bf16_weights(eng.proposer)
        configs.append(bench.Ours(f"head k={k} bf16 weights", eng, k, "head"))
    for k in filter(None, a.baseline_ks.split(",") if a.baseline_head else []):
        k = k if k == "auto" else int(k)
        spec = SpeculativeConfig(proposer="head", head=a.baseline_head, num_draft_tokens=k)
        configs.append(bench.Ours(f"baseline head k={k}", build_engine(models, spec, 4096), k, "head"))
    configs.append(bench.Ours("ngram k=auto", build_engine(models, SpeculativeConfig(proposer="ngram"), 4096),
                              "auto", "ngram"))
    for k in filter(None, a.draft_ks.split(",") if draft else []):
        k = k if k == "auto" else int(k)
        spec = SpeculativeConfig(draft=draft, proposer="draft", num_draft_tokens=k, draft_dtype="q4_0")
        configs.append(bench.Ours(f"draft 0.5b q4_0 k={k}", build_engine(models, spec, 4096), k, "draft"))
    runs = bench.run_bench(models, settings, configs,
                           progress=lambda what: print(what, flush=True) if "prompt" in what else None)
    summary = bench.summarise(runs, configs, settings.params)
    head = configs[1].engine.proposer.head
    size = sum(p.numel() for p in head.parameters())
    title = (f"{a.model}, {len(prompts)} {a.prompts} prompts x {a.max_tokens} tokens, T={a.temperature}, "
             f"{a.threads} threads, {cpu_name()}")
    bench.print_table(summary, title)
    print(f"head: {size / 1e6:.2f} M parameters ({head.cfg.draft_vocab} draft tokens, MLP {head.cfg.intermediate}); "
          f"held-out acceptance at training: {json.dumps(head.cfg.held_out)}")
    print(json.dumps({"benchmark": "head", "model": a.model, "cpu": cpu_name(), "prompts": a.prompts,
                      "num_prompts": len(prompts), "max_tokens": a.max_tokens, "temperature": a.temperature,
                      "threads": a.threads, "load_s": round(load_s, 1), "head_params": size, "head": a.head, "baseline_head": a.baseline_head,
                      "step_ab": ab, **summary}))


if __name__ == "__main__":
    main()
