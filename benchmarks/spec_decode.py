"""Speculative decode against our own plain decode, same run, interleaved.

Default: Qwen2.5-Coder-1.5B target, 0.5B draft, HumanEval prompts, greedy, k in {2, 4, 6}.
For each prompt the configurations run back to back (plain, k=2, k=4, ...), so machine noise
hits all alike; tokens/s are totals over prompts, speedups are per-prompt medians. Reports
acceptance rate, mean acceptance length, measured draft cost ratio c, the cost model's
predicted speedup and the measured one. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/spec_decode.py [--num-prompts 20] [--max-tokens 128] [--ks 2,4,6]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--draft-dtype", default="fp32")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from specdec.config import SamplingParams, SpeculativeConfig
    from specdec.loader import build_engine, load_models
    from specdec.metrics import SpecStats
    from specdec.tools.prompts import load_prompts

    ks = [int(x) for x in a.ks.split(",")]
    models = load_models(a.target, a.draft, a.dtype, a.draft_dtype, "cpu")
    tok = models.tokenizer
    prompts = [tok.encode_prompt(p) for p in load_prompts(a.prompts, a.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    engines = {"plain": build_engine(models, None, max_model_len=2048)}
    for k in ks:
        engines[f"k={k}"] = build_engine(models, SpeculativeConfig(draft=a.draft, proposer="draft", num_draft_tokens=k),
                                         max_model_len=2048)
    engines["plain"].generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    tokens = {n: 0 for n in engines}
    secs = {n: 0.0 for n in engines}
    ratios = {n: [] for n in engines}
    stats = {n: SpecStats() for n in engines}
    for i, ids in enumerate(prompts):
        per = {}
        for name, eng in engines.items():
            r = eng.generate([ids], params)[0]
            tokens[name] += len(r.output)
            secs[name] += r.decode_time + r.draft_prefill_time  # the draft's prompt is its cost
            per[name] = len(r.output) / (r.decode_time + r.draft_prefill_time)
            stats[name].merge(r.stats)
            if name == "plain":
                plain_out = r.output
            elif r.output != plain_out:  # greedy speculative must equal plain, token for token
                raise SystemExit(f"prompt {i}: {name} output differs from plain decode")
        for name in engines:
            ratios[name].append(per[name] / per["plain"])
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(f"{n} {v:.2f} tok/s" for n, v in per.items()),
              flush=True)
    rows = []
    for name in engines:
        s = stats[name].to_dict()
        rows.append({"config": name, "tok_s": tokens[name] / secs[name],
                     "speedup": statistics.median(ratios[name]),
                     "acceptance_rate": s["acceptance_rate"],
                     "mean_acceptance_length": s["mean_acceptance_length"],
                     "draft_cost_ratio": s["draft_cost_ratio"], "predicted_speedup": s["predicted_speedup"]})
    print(f"\n{a.target} <- {a.draft}, {len(prompts)} {a.prompts} prompts x {a.max_tokens} tokens, greedy, "
          f"{a.threads} threads")
    print(f"{'config':<8}{'tok/s':>8}{'speedup':>9}{'alpha':>7}{'mean len':>10}{'c':>7}{'predicted':>11}")
    for r in rows:
        print(f"{r['config']:<8}{r['tok_s']:>8.2f}{r['speedup']:>8.2f}x{r['acceptance_rate']:>7.2f}"
              f"{r['mean_acceptance_length']:>10.2f}{r['draft_cost_ratio']:>7.2f}{r['predicted_speedup']:>10.2f}x")
    best = max(rows[1:], key=lambda r: r["speedup"]) if len(rows) > 1 else rows[0]
    print(json.dumps({"benchmark": "spec_decode", "target": a.target, "draft": a.draft,
                      "prompts": a.prompts, "num_prompts": len(prompts), "max_tokens": a.max_tokens,
                      "rows": rows, "best": best["config"], "best_speedup": best["speedup"]}))


if __name__ == "__main__":
    main()
