"""Seed-stable against standard sampling at T > 0: acceptance, speed, and the text identity.

Standard speculative sampling accepts a draft with probability min(1, p/q) and resamples from the
residual: acceptance 1 - TV(p, q) per position for a draft sampled from q, p(d) for a
deterministic draft. Seed-stable sampling (SamplingParams.seed_stable) emits argmax(z_t + g_t)
for Gumbel noise g_t fixed by (seed, t), and the draft model draws argmax(log q_t + g_t) from the
same noise: a coupling, whose acceptance P(argmax(log p + g) = argmax(log q + g)) is lower than
1 - TV for a sampled draft and equal (p(d)) for a deterministic one. What it buys: the text of a
seed is the same with speculation on or off, at any k, under any load. This script measures the
price per configuration, on the same prompts and seeds, interleaved: mean accepted drafts per
round, acceptance rate, decode tokens/s (median over prompts x seeds), and checks that every
seed-stable speculative output equals the seed-stable plain output. It also times the noise
itself (one position's Gumbel vector of the target's vocabulary).

    .venv/bin/python benchmarks/seed_stable.py [--pair qwen|smollm2] [--num-prompts 3]
        [--seeds 2] [--max-tokens 64] [--temperature 0.8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

PAIRS = {"qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "draft", "humaneval"),
         "smollm2": ("smollm2-135m", None, "ngram", "copy")}


def noise_ms(V: int, reps: int = 50) -> float:
    from specdec.rejection import GumbelStream

    s = GumbelStream(0)
    s.gumbel(0, V)
    t0 = time.perf_counter()
    for t in range(1, reps + 1):
        s.gumbel(t, V)
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", choices=list(PAIRS), default="qwen")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    from specdec.config import SamplingParams, SpeculativeConfig
    from specdec.loader import build_engine, load_models
    from specdec.metrics import SpecStats
    from specdec.tools.prompts import load_prompts

    target, draft, proposer, prompt_set = PAIRS[a.pair]
    draft_dtype = "q4_0" if draft else "auto"
    models = load_models(target, draft, "native", draft_dtype, "cpu")
    tok = models.tokenizer

    def eng(k):
        spec = None if k == 0 else SpeculativeConfig(draft=models.draft_name, proposer=proposer,
                                                     num_draft_tokens=k)
        return build_engine(models, spec, max_model_len=2048)

    configs = {"plain": 0, f"{proposer} k={a.k}": a.k, f"{proposer} auto": "auto"}
    engines = {n: eng(k) for n, k in configs.items()}
    warm = tok.encode_prompt("Hello")
    for e in engines.values():
        e.generate([warm], SamplingParams(temperature=0, max_tokens=4))
    prompts = [tok.encode_prompt(p) for p in load_prompts(prompt_set, a.num_prompts)]
    modes = {"standard": False, "seed-stable": True}
    tps = {(m, n): [] for m in modes for n in configs}
    stats = {(m, n): SpecStats() for m in modes for n in configs}
    mismatches = 0
    for i, ids in enumerate(prompts):
        for seed in range(a.seeds):
            plain_stable = None
            for m, stable in modes.items():
                params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=seed,
                                        seed_stable=stable, ignore_eos=True)
                for n, e in engines.items():
                    r = e.generate([ids], params)[0]
                    tps[(m, n)].append(len(r.output) / (r.decode_time + r.draft_prefill_time))
                    stats[(m, n)].merge(r.stats)
                    if stable and n == "plain":
                        plain_stable = r.output
                    elif stable and r.output != plain_stable:
                        mismatches += 1
            print(f"  prompt {i + 1}/{len(prompts)} seed {seed}: " + "  ".join(
                f"{m[:4]}/{n} {v[-1]:.1f}" for (m, n), v in tps.items()), flush=True)
    V = models.vocab
    rows = []
    for (m, n), v in tps.items():
        s = stats[(m, n)].to_dict()
        base = tps[(m, "plain")]
        rows.append({"mode": m, "config": n, "tok_s": statistics.median(v),
                     "vs_standard_plain": statistics.median([x / b for x, b in zip(v, tps[("standard", "plain")])]),
                     "vs_same_mode_plain": statistics.median([x / b for x, b in zip(v, base)]),
                     "acceptance_rate": s["acceptance_rate"],
                     "mean_acceptance_length": s["mean_acceptance_length"]})
    ms = noise_ms(V)
    print(f"\n{target}" + (f" <- {draft} ({draft_dtype})" if draft else f" ({proposer})")
          + f", T = {a.temperature}, {len(prompts)} {prompt_set} prompts x {a.seeds} seeds x {a.max_tokens} "
          f"tokens, {a.threads} threads, CPU: {cpu_name()}")
    print(f"  {'mode':<13}{'config':<16}{'tok/s':>8}{'vs std plain':>14}{'vs own plain':>14}{'accept':>8}{'mean len':>10}")
    for r in rows:
        print(f"  {r['mode']:<13}{r['config']:<16}{r['tok_s']:>8.1f}{r['vs_standard_plain']:>13.2f}x"
              f"{r['vs_same_mode_plain']:>13.2f}x{r['acceptance_rate']:>8.2f}{r['mean_acceptance_length']:>10.2f}")
    print(f"  Gumbel noise per position (V = {V}): {ms:.2f} ms; seed-stable speculative outputs "
          f"differing from seed-stable plain: {mismatches}")
    print(json.dumps({"benchmark": "seed_stable", "cpu": cpu_name(), "target": target, "draft": draft,
                      "proposer": proposer, "temperature": a.temperature, "threads": a.threads,
                      "prompts": len(prompts), "seeds": a.seeds, "max_tokens": a.max_tokens,
                      "noise_ms_per_position": ms, "mismatches": mismatches, "rows": rows}))


if __name__ == "__main__":
    main()
