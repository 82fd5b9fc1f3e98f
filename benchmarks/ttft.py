"""Time to first token through `specdec.LLM` for a long prompt, by prefill piece size.

The prompt is `--tokens` token ids of real code (the Python standard library's own sources,
consecutive windows, a fresh one each repeat), fed as ids so its length is exact; greedy,
`--max-tokens` new tokens. For each repeat every piece size in `--pieces` runs the same window
back to back (order rotated per repeat), each after a short unrelated prompt that evicts the
row's KV so nothing is reused (asserted: cached_tokens == 0). Time to first token is measured
as the CLI measures it (the call to the first streamed text); "prompt s" is the engine's
prefill clock (target, and with `--draft` the draft's prompt too). The generated tokens must be
the same for every piece size (asserted). A table, then one JSON line.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ttft.py --model qwen2.5-coder-1.5b \\
        [--draft qwen2.5-coder-0.5b] [--tokens 1000] [--pieces 0,256] [--repeats 5] [--batch 1]

`--batch N`: N different windows in one `generate` call (N rows prefilled together); the time
to first token is then the first streamed text of any of them.

`--pieces 0` is one forward over the whole prompt (what the engine did before PREFILL_PIECE).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch


def code_tokens(tokenizer, need: int) -> list[int]:
    import argparse as m1
    import inspect as m2
    import json.decoder as m3
    import statistics as m4
    import textwrap as m5

    text = "\n\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4, m5))
    ids = tokenizer.encode_prompt(text, raw=True)
    if len(ids) < need:
        raise SystemExit(f"only {len(ids)} tokens of source text; ask for fewer")
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="a draft model (k = 4): its prompt is prefilled too")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--pieces", default="0,256", help="prefill piece sizes (0: the whole prompt)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call (rows prefilled together)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import specdec
    from specdec.runtime import kv_cache

    from prefill import cpu_info  # noqa: E402  (benchmarks/ is the script's directory)

    spec = {"draft": a.draft, "num_draft_tokens": 4} if a.draft else None
    llm = specdec.LLM(model=a.model, speculative_config=spec, max_model_len=a.tokens + a.max_tokens + 64,
                      max_batch=a.batch)
    ids = code_tokens(llm.tokenizer, a.tokens * a.batch * (a.repeats + 1) + 1)
    pieces = [int(x) for x in a.pieces.split(",")]
    params = specdec.SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    evict = specdec.SamplingParams(temperature=0.0, max_tokens=1)
    times = {p: {"ttft": [], "prompt": [], "decode": []} for p in pieces}
    at = 0
    for rep in range(a.repeats + 1):  # repeat 0 warms up
        windows, firsts = [], set()  # consecutive windows, none sharing a first token with another
        while len(windows) < a.batch:
            while ids[at] in firsts:
                at += 1
            windows.append(ids[at:at + a.tokens])
            firsts.add(ids[at])
            at += a.tokens
        assert len(windows[-1]) == a.tokens, "not enough source text; ask for fewer tokens"
        other = next(t for t in range(1, 100) if all(t != w[0] for w in windows))
        outs = {}
        order = pieces[rep % len(pieces):] + pieces[:rep % len(pieces)]
        for p in order:
            kv_cache.PREFILL_PIECE = p or 10**9
            llm.generate([[other, other + i] for i in range(a.batch)], evict)
            first = []
            t0 = time.perf_counter()
            res = llm.generate(windows, params, on_text=lambda _i, _d: first or first.append(time.perf_counter()))
            assert all(o.cached_tokens == 0 for o in res), [o.cached_tokens for o in res]
            outs[p] = [o.token_ids for o in res]
            if rep:
                times[p]["ttft"].append(first[0] - t0)
                times[p]["prompt"].append(max(o.prefill_s for o in res))
                times[p]["decode"].append(sum(len(o.token_ids) for o in res) / max(o.decode_s for o in res))
        assert all(o == outs[pieces[0]] for o in outs.values()), "output differs between piece sizes"
    cpu, mhz, _ = cpu_info()
    base = pieces[0]
    print(f"{cpu}, {a.threads} threads, {mhz:.0f} MHz; {a.model}" + (f" + draft {a.draft} (k = 4)" if a.draft else "")
          + f"; {a.batch} x " * (a.batch > 1) + f"prompt {a.tokens} tokens of code; median of {a.repeats}")
    print("| piece | time to first token s | prompt s | prompt tok/s | TTFT vs " + (str(base) if base else "whole")
          + " | decode tok/s |")
    print("|---|---|---|---|---|---|")
    res = {}
    for p in pieces:
        t = times[p]
        med = {k: statistics.median(v) for k, v in t.items()}
        ratio = statistics.median(x / y for x, y in zip(t["ttft"], times[base]["ttft"]))
        res[p or "whole"] = {"ttft_s": med["ttft"], "prompt_s": med["prompt"], "decode_tok_s": med["decode"],
                             "ttft_vs_base": ratio}
        print(f"| {p or 'whole'} | {med['ttft']:.3f} | {med['prompt']:.3f} | {a.tokens * a.batch / med['prompt']:.0f} | "
              f"{ratio:.2f}x | {med['decode']:.1f} |")
    print(json.dumps({"benchmark": "ttft", "cpu": cpu, "model": a.model, "draft": a.draft, "tokens": a.tokens,
                      "batch": a.batch, "threads": a.threads, "outputs_equal": True, "results": res}))


if __name__ == "__main__":
    main()
