"""Draft trees against chains: plain decoding, the draft model's chain at fixed k, and its trees
of a few shapes, on the same prompts, interleaved per prompt (`specdec bench`'s runner and table).
Decode tokens/s exclude the prompt; speedups are per-prompt ratios to plain, median over prompts;
greedy speculative output must equal plain token for token (`greedy_mismatches`).

    .venv/bin/python benchmarks/tree.py --temperature 0                       # Qwen pair, HumanEval
    .venv/bin/python benchmarks/tree.py --temperature 0.8 --trees 2,2,1,1 3,2,1
    .venv/bin/python benchmarks/tree.py --proposer ngram --chains 4,8 --trees dynamic:8 dynamic:16 --dynamic-k 8
    .venv/bin/python benchmarks/tree.py --proposer draft,composite --chains 4 --trees dynamic:8

The issue's goals: tree >= 1.15x the best chain at T = 0.8 and >= 1.05x at T = 0.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

from specdec.config import SamplingParams, SpeculativeConfig, parse_draft_tree, tree_text
from specdec.loader import build_engine, load_models
from specdec.tools import bench
from specdec.tools.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft-dtype", default="q4_0")
    ap.add_argument("--proposer", default="draft",
                    help="draft, ngram (chains and tries, dynamic trees only; no draft model) or composite "
                         "(n-gram first, then the draft model; its trees are the union of both), or several, "
                         "comma-separated: each drafts every chain and tree")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--chains", default="3,4,5", help="chain k values")
    ap.add_argument("--trees", nargs="*", default=["2,1,1,1", "2,2,1,1", "3,2,1"],
                    help="tree widths, or dynamic[:N] (grown by the draft's confidence, depth --dynamic-k)")
    ap.add_argument("--dynamic-k", default="4", help="depth of the dynamic trees, or auto (adaptive k)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ngram-min", default="1",
                    help="shortest n-gram match of the n-gram and composite proposers; several, comma-separated: "
                         "each its own set of configurations")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    proposers = a.proposer.split(",")
    for p in proposers:
        if p not in ("draft", "ngram", "composite"):
            ap.error(f"--proposer {p!r}: allowed: draft, ngram, composite")
    ngram = proposers == ["ngram"]
    draft = None if ngram else a.draft
    models = load_models(a.model, draft, "native", a.draft_dtype)
    load_s = time.perf_counter() - t0
    prompts = load_prompts(a.prompts, a.num_prompts)
    # standard rejection sampling at T > 0: seed-stable rows (the default with a seed) take chains
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=0 if a.temperature else None,
                            seed_stable=False)
    settings = bench.BenchSettings(prompts=prompts, params=params, ks=[], proposer=a.proposer, max_seq_len=4096)
    configs = [bench.Ours(bench.PLAIN, build_engine(models, None, 4096), 0)]
    mins = [int(x) for x in a.ngram_min.split(",")]
    for p, n_min in ((p, n) for p in proposers for n in (mins if p != "draft" else [1])):
        kw = dict(proposer=p) if p == "ngram" else dict(proposer=p, draft=a.draft, draft_dtype=a.draft_dtype)
        if p != "draft":
            kw["ngram_min"] = n_min
        tag = f"{p} " if len(proposers) > 1 else ""
        if len(mins) > 1 and p != "draft":
            tag += f"n>={n_min} "
        for k in (int(x) if x != "auto" else x for x in a.chains.split(",")):
            spec = SpeculativeConfig(num_draft_tokens=k, **kw)
            configs.append(bench.Ours(f"{tag}chain k={k}", build_engine(models, spec, 4096), k, p))
        for widths in (parse_draft_tree(t) for t in a.trees):
            k = (a.dynamic_k if a.dynamic_k == "auto" else int(a.dynamic_k)) if isinstance(widths, str) else len(widths)
            spec = SpeculativeConfig(num_draft_tokens=k, draft_tree=widths, **kw)
            name = f"{tag}tree {tree_text(widths)}" + (f" k={k}" if isinstance(widths, str) else "")
            configs.append(bench.Ours(name, build_engine(models, spec, 4096), k, p))
    runs = bench.run_bench(models, settings, configs,
                           progress=lambda what: print(what, flush=True) if "prompt" in what else None)
    summary = bench.summarise(runs, configs, settings.params)
    title = (f"{a.model} + {a.proposer} ({'no draft model' if ngram else f'{a.draft} {a.draft_dtype}'}), {len(prompts)} {a.prompts} prompts x {a.max_tokens} "
             f"tokens, T={a.temperature}, {a.threads} threads, {cpu_name()}")
    bench.print_table(summary, title)
    print(json.dumps({"benchmark": "tree", "model": a.model, "draft": draft, "proposer": a.proposer, "cpu": cpu_name(),
                      "ngram_min": mins,
                      "prompts": a.prompts, "num_prompts": len(prompts), "max_tokens": a.max_tokens,
                      "temperature": a.temperature, "threads": a.threads, "load_s": round(load_s, 1), **summary}))


if __name__ == "__main__":
    main()
