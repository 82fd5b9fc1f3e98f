"""llama.cpp against our `--dtype native` runtime on the same GGUF files, same run, interleaved.

Optional dependency: llama-cpp-python, built from source for this CPU (`make bench-deps`, about
12 minutes); never a runtime dependency of specdec.

For each prompt, back to back: llama.cpp plain greedy decode, our plain greedy decode on the
GGUF's own blocks (--dtype native), and our speculative decode (--dtype native; the Qwen pair
drafts with the 0.5B model at `--draft-dtype`: its own Q5_0/Q8_0 blocks, "native", or those
requantised to Q4_0, "q4_0"; SmolLM2 with the n-gram proposer).  Same
prompt token ids (our tokenizer's chat template, fed to llama.cpp as ids), same thread count,
`--max-tokens` tokens each with EOS ignored, so every engine decodes the same number of tokens.
Decode tokens/s excludes prompt processing on every side (llama.cpp: from the first generated
token to the last; ours: the target's prompt prefill and the draft model's, both done before the
first round; also shown with the draft's prompt prefill charged to decoding).  End-to-end
tokens/s counts it (tokens / time from the call to the last token), so
a cost moved from decoding into prompt processing shows there.  Reports per-engine median
tokens/s over prompts, per-prompt median ratios, then one JSON line.

    .venv/bin/python benchmarks/llamacpp.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    .venv/bin/python benchmarks/llamacpp.py --model smollm2-135m --proposer ngram
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def llama_decode(llm, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """Greedy decode n tokens after ids; returns (tokens, decode tokens/s after the first,
    end-to-end tokens/s from the call)."""
    llm.reset()
    out, t_first, t_call = [], None, time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True):
        out.append(tok)
        if t_first is None:
            t_first = time.perf_counter()
        if len(out) == n:
            break
    t_end = time.perf_counter()
    return out, (len(out) - 1) / (t_end - t_first), len(out) / (t_end - t_call)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="draft model (default: n-gram proposer)")
    ap.add_argument("--proposer", default=None, help="ngram (default without --draft)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--draft-dtype", default="native", choices=["native", "q4_0"],
                    help="the draft model's weights: its GGUF blocks, or those requantised to Q4_0")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: run `make bench-deps` (builds it, ~12 min)")
    from specdec.config import SamplingParams, SpeculativeConfig
    from specdec.loader import build_engine, load_models
    from specdec.runtime.hub import fetch
    from specdec.tools.prompts import humaneval

    models = load_models(a.model, a.draft, "native", a.draft_dtype, "cpu")
    tok = models.tokenizer
    k = a.num_draft_tokens
    if a.draft:
        cfg = SpeculativeConfig(draft=a.draft, proposer="draft", num_draft_tokens=k, draft_dtype=a.draft_dtype)
        spec_name = f"ours spec (draft {a.draft}, {a.draft_dtype})"
    else:
        cfg = SpeculativeConfig(proposer="ngram", num_draft_tokens=k)
        spec_name = "ours spec (n-gram)"
    llm = Llama(model_path=str(fetch(a.model)), n_ctx=2048, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=512, verbose=False, seed=0)
    plain = build_engine(models, None, max_model_len=2048)
    spec = build_engine(models, cfg, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = [tok.encode_prompt(p) for p in humaneval(a.num_prompts + 1)]

    def ours(eng, ids):
        r = eng.generate([ids], params)[0]
        n = len(r.output)
        return r.output, n / r.decode_time, n / (r.prefill_time + r.decode_time), \
            n / (r.decode_time + r.draft_prefill_time), r.stats

    names = ["llama.cpp plain", "ours plain (native)", f"{spec_name} k={k}"]
    rates = {n: [] for n in names}
    e2e = {n: [] for n in names}
    with_draft_prefill = []  # ours spec: decode + the draft's prompt prefill
    agree, acc = [], []
    llama_decode(llm, prompts[0], 8), ours(plain, prompts[0]), ours(spec, prompts[0])  # warm-up
    for i, ids in enumerate(prompts[1:]):
        lt, lr, le = llama_decode(llm, ids, a.max_tokens)
        pt, pr, pe, _, _ = ours(plain, ids)
        st, sr, se, sd, stats = ours(spec, ids)
        with_draft_prefill.append(sd / lr)
        assert st == pt, f"prompt {i}: speculative output differs from plain"
        for n, r, e in zip(names, (lr, pr, sr), (le, pe, se)):
            rates[n].append(r)
            e2e[n].append(e)
        same = next((j for j, (x, y) in enumerate(zip(lt, pt)) if x != y), min(len(lt), len(pt)))
        agree.append(same)
        acc.append(stats.to_dict()["acceptance_rate"])
        print(f"prompt {i:2d}: " + "  ".join(f"{n} {r:6.2f}" for n, r in zip(names, (lr, pr, sr)))
              + f"  tok/s; same first tokens as llama.cpp: {same}", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    ratio = {n: statistics.median(r / l for r, l in zip(v, rates[names[0]])) for n, v in rates.items()}
    med_e2e = {n: statistics.median(v) for n, v in e2e.items()}
    ratio_e2e = {n: statistics.median(r / l for r, l in zip(v, e2e[names[0]])) for n, v in e2e.items()}
    print(f"\n{a.model}, {len(prompts) - 1} HumanEval prompts x {a.max_tokens} tokens, greedy, "
          f"{a.threads} threads")
    print("| engine | decode tok/s (median) | ratio vs llama.cpp | end-to-end tok/s | ratio |\n"
          "|---|---|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.2f} | {ratio[n]:.2f}x | {med_e2e[n]:.2f} | {ratio_e2e[n]:.2f}x |")
    print(f"ours spec with the draft's prompt prefill charged to decoding: "
          f"{statistics.median(with_draft_prefill):.2f}x llama.cpp's decode (median ratio)")
    print(f"acceptance rate (median): {statistics.median(acc):.3f}; tokens identical to llama.cpp "
          f"before the first difference (median): {statistics.median(agree)}")
    print(json.dumps({"benchmark": "llamacpp", "model": a.model, "draft": a.draft or "ngram", "k": k,
                      "draft_dtype": a.draft_dtype if a.draft else None,
                      "median_end_to_end_tok_s": med_e2e, "median_end_to_end_ratio": ratio_e2e,
                      "spec_with_draft_prefill_ratio": statistics.median(with_draft_prefill),
                      "threads": a.threads, "prompts": len(prompts) - 1, "max_tokens": a.max_tokens,
                      "median_tok_s": med, "median_ratio_vs_llamacpp": ratio,
                      "acceptance_rate": statistics.median(acc)}))


if __name__ == "__main__":
    main()
