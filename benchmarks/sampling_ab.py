"""Sampling at T > 0, before and after, in one process: the categorical draw (torch.multinomial
against the two-level inverse CDF, `rejection.inverse_cdf`) or top-p (a full sort of the
vocabulary against `sampling.top_p_keep`'s top-k candidates). The "before" code lives here as
the baseline and is switched in per run; prompts interleaved, the order of the two alternating.
Plain decoding, the composite (n-gram, then the draft) and the draft model alone at k = 4, end
to end (prefill included), `ignore_eos` so every run makes the same number of tokens.

    .venv/bin/python benchmarks/sampling_ab.py --what sampler --prompts chat
    .venv/bin/python benchmarks/sampling_ab.py --what top-p --prompts humaneval

The two variants draw different random streams, so their texts differ: compare medians of
per-prompt ratios over several prompts, not single runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

import specdec
from specdec import rejection, sampling
from specdec.tools.prompts import load_prompts


def multinomial(self, probs: torch.Tensor) -> torch.Tensor:
    """TorchRng.categorical before: ~3 ms per row of 151,936."""
    return torch.multinomial(probs.float(), 1, generator=self.gen).squeeze(-1)


def sorted_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p before: a full sort, the smallest prefix reaching top_p (~14 ms per row of 151,936)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    remove = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    remove[..., 0] = False
    return ~torch.zeros_like(remove).scatter(-1, order, remove)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", choices=["sampler", "top-p"], required=True)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=None, help="default: 0.95 with --what top-p, else 1")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    top_p = a.top_p if a.top_p is not None else (0.95 if a.what == "top-p" else 1.0)
    new_cat, new_keep = rejection.TorchRng.categorical, sampling.top_p_keep
    kept_sizes = collections.Counter()

    def counting_keep(logits, p):
        keep = new_keep(logits, p)
        n = int(keep.sum(-1).max())
        kept_sizes["<=256" if n <= 256 else "<=4096" if n <= 4096 else "more"] += 1
        return keep

    def use(variant: str) -> None:
        if a.what == "sampler":
            rejection.TorchRng.categorical = multinomial if variant == "before" else new_cat
        else:
            sampling.top_p_keep = sorted_top_p if variant == "before" else counting_keep

    spec = {"draft": a.draft, "draft_dtype": "q4_0"}
    engines = {"plain": specdec.LLM(model=a.model),
               "composite": specdec.LLM(model=a.model, speculative_config=spec),
               "draft k=4": specdec.LLM(model=a.model, speculative_config={**spec, "proposer": "draft",
                                                                           "num_draft_tokens": 4})}
    params = specdec.SamplingParams(temperature=a.temperature, top_p=top_p, max_tokens=a.max_tokens,
                                    ignore_eos=True)
    prompts = load_prompts(a.prompts, a.num_prompts)
    for llm in engines.values():  # warm-up
        llm.generate([prompts[0]], params)
    tok_s = {(e, v): [] for e in engines for v in ("before", "after")}
    for i, prompt in enumerate(prompts):
        for name, llm in engines.items():
            for variant in ("before", "after") if i % 2 == 0 else ("after", "before"):
                use(variant)
                t = time.perf_counter()
                out = llm.generate([prompt], params)[0]
                tok_s[(name, variant)].append(len(out.token_ids) / (time.perf_counter() - t))
    use("after")
    label = {"sampler": ("multinomial", "inverse CDF"), "top-p": ("full sort", "top-k candidates")}[a.what]
    print(f"# {cpu_name()}, {a.threads} threads, {a.model} native (+ {a.draft} q4_0), {a.prompts} x{len(prompts)}, "
          f"{a.max_tokens} tokens, T = {a.temperature}, top_p = {top_p}, end-to-end tok/s (prefill included)")
    print(f"| config | before ({label[0]}) tok/s | after ({label[1]}) tok/s | after / before (median of per-prompt ratios) |")
    print("|---|---|---|---|")
    results = {}
    for name in engines:
        b, f = tok_s[(name, "before")], tok_s[(name, "after")]
        r = statistics.median(x / y for x, y in zip(f, b))
        results[name] = {"before": statistics.median(b), "after": statistics.median(f), "ratio": r}
        print(f"| {name} | {results[name]['before']:.1f} | {results[name]['after']:.1f} | {r:.3f}x |")
    if kept_sizes:
        print(f"top-p calls by the largest kept set in the call: {dict(kept_sizes)}")
    print(json.dumps({"bench": "sampling_ab", "what": a.what, "cpu": cpu_name(), "prompts": a.prompts,
                      "temperature": a.temperature, "top_p": top_p, "results": results,
                      "top_p_kept": dict(kept_sizes)}))


if __name__ == "__main__":
    main()
