"""Plain greedy decode: specdec against transformers' generate (default SmolLM2-135M).

Same prompts, same thread count, runs alternate (ours, theirs, ours, ...) so machine noise hits
both alike; medians over repeats. Also prints the verify-cost curve: one forward of k new tokens
on a 256-token cache as a ratio to k = 1. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/plain_decode.py [--model smollm2-135m] [--threads 2] [--tokens 64]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a bicycle stays upright.",
           "Give three tips for writing clear documentation."]


def ours_decode(engine, tok, prompt, n):
    from specdec.config import SamplingParams

    ids = tok.encode_prompt(prompt)
    r = engine.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    return len(r.output) / r.decode_time


def hf_decode(model, ids, n):
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # prefill timing
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0 - t_prefill
    return (out.shape[1] - ids.shape[1] - 2) / dt


def verify_curve(model, ks=(1, 2, 4, 5, 6, 8, 16), ctx=256, repeats=7):
    cache = model.new_cache(1, 1024)
    model.forward(torch.randint(0, 1000, (1, ctx)), torch.arange(ctx).view(1, -1), cache)
    cache.set_length(0, ctx)
    times = {}
    for _ in range(repeats):
        for k in ks:
            toks = torch.randint(0, 1000, (1, k))
            t0 = time.perf_counter()
            model.forward(toks, torch.arange(ctx, ctx + k).view(1, -1), cache)
            times.setdefault(k, []).append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {k: (med[k], med[k] / med[1]) for k in ks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdec.loader import build_engine, load_models
    from specdec.runtime.hub import model_path, resolve_model

    hf_logging.set_verbosity_error()
    resolve_model(a.model)
    t0 = time.perf_counter()
    models = load_models(a.model, dtype="fp32", device="cpu")  # transformers' GGUF path is fp32 too
    tok = models.tokenizer
    load_s = time.perf_counter() - t0
    engine = build_engine(models, None, max_model_len=1024)
    p = model_path(a.model)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ours_decode(engine, tok, PROMPTS[0], 8)  # warm-up
    hf_decode(hf, torch.tensor([tok.encode_prompt(PROMPTS[0])]), 8)
    ours, theirs = [], []
    for _ in range(a.repeats):
        for prompt in PROMPTS:
            ours.append(ours_decode(engine, tok, prompt, a.tokens))
            theirs.append(hf_decode(hf, torch.tensor([tok.encode_prompt(prompt)]), a.tokens))
    o, t = statistics.median(ours), statistics.median(theirs)
    curve = verify_curve(models.target)
    print(f"{a.model} greedy decode, {a.threads} threads, {a.tokens} tokens, "
          f"{len(ours)} runs each (median)")
    print(f"{'engine':<28}{'tok/s':>10}")
    print(f"{'specdec (plain)':<28}{o:>10.1f}")
    print(f"{'transformers generate':<28}{t:>10.1f}")
    print(f"{'ratio':<28}{o / t:>10.2f}x")
    print("\nverify-cost curve (256-token cache): forward(k) / forward(1)")
    for k, (sec, r) in curve.items():
        print(f"  k={k:<3} {sec * 1e3:8.1f} ms  {r:5.2f}x")
    print(f"\nload time (converted cache): {load_s:.2f} s")
    print(json.dumps({"benchmark": "plain_decode", "model": a.model, "threads": a.threads,
                      "specdec_tok_s": o, "transformers_tok_s": t, "speedup": o / t,
                      "verify_cost_ratio": {str(k): r for k, (_, r) in curve.items()},
                      "load_s": load_s}))


if __name__ == "__main__":
    main()
