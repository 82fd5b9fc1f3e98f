"""Structured output: what a JSON schema costs plain decoding, and what speculation gains under it.

JSON extraction prompts (a passage and a schema for the facts in it: copy-heavy, and the grammar
forces the keys and punctuation), greedy, interleaved per prompt: unconstrained plain decoding,
constrained plain decoding, and constrained speculative decoding with each proposer (n-gram; for
the Qwen pair also the 0.5B draft at q4_0 and the composite). Decode tokens/s exclude the prompt
(and a draft's prompt prefill is counted), speedups are per-prompt ratios, median over prompts.
Every constrained speculative output must equal the constrained plain output token for token.
The per-token cost of the mask itself (GrammarState over the real vocabulary) is timed apart.

    .venv/bin/python benchmarks/structured.py [--pair smollm2|qwen] [--max-tokens 160] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from serve import cpu_name  # (benchmarks/serve.py: the CPU named in every log)

PAIRS = {"smollm2": ("smollm2-135m", None), "qwen": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "born", "field", "awards"],
          "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "field": {"type": "string"},
                         "awards": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["order_id", "customer", "items", "total"],
         "properties": {"order_id": {"type": "string"}, "customer": {"type": "string"},
                        "items": {"type": "array", "maxItems": 4, "items": {
                            "type": "object", "additionalProperties": False, "required": ["product", "qty"],
                            "properties": {"product": {"type": "string"}, "qty": {"type": "integer"}}}},
                        "total": {"type": "number"}}}
EVENT = {"type": "object", "additionalProperties": False, "required": ["title", "date", "city", "speakers"],
         "properties": {"title": {"type": "string"}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                        "city": {"type": "string"}, "speakers": {"type": "array", "items": {"type": "string"}}}}
PROMPTS = [
    ("Marie Curie was born in 1867 in Warsaw. She worked in physics and chemistry and received the "
     "Nobel Prize in Physics (1903) and the Nobel Prize in Chemistry (1911), as well as the Davy Medal.", PERSON),
    ("Order A-1042 was placed by Jonas Berg: 2 x USB-C cable, 1 x Travel adapter, 3 x AA battery pack. "
     "The total charged was 47.85 euros.", ORDER),
    ("The Northern Compilers Meetup takes place on 2027-03-14 in Tromso. Talks will be given by Ingrid "
     "Lund, Ahmed Karimi and Sofia Rossi.", EVENT),
    ("Alan Turing, born 1912 in London, worked in mathematics and computer science. He was appointed "
     "OBE in 1946 and elected a Fellow of the Royal Society in 1951.", PERSON),
]


def mask_ms(tok, V: int, schema: dict, text: str) -> float:
    """Median ms per token of the grammar state alone (mask + commit) along a real JSON output."""
    from specdec import grammar

    lltok = grammar.grammar_tokenizer(tok, V)
    st = grammar.GrammarState(lltok, grammar.compile_grammar(json_schema=schema), V, "cpu")
    times = []
    for t in tok.encode(text, add_special_tokens=False):
        t0 = time.perf_counter()
        st.inputs(torch.zeros(0, dtype=torch.long))
        st.commit(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", choices=list(PAIRS), default="qwen")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    from specdec.config import SamplingParams, SpeculativeConfig
    from specdec.loader import build_engine, load_models

    target, draft = PAIRS[a.pair]
    models = load_models(target, draft, "native", "q4_0" if draft else "auto", "cpu")
    tok = models.tokenizer

    def eng(proposer=None, k=0):
        spec = None if proposer is None else SpeculativeConfig(draft=models.draft_name if proposer != "ngram" else None,
                                                               proposer=proposer, num_draft_tokens=k)
        return build_engine(models, spec, max_model_len=2048)

    engines = {"plain": eng(), "plain (schema)": eng(), "ngram auto (schema)": eng("ngram", "auto")}
    if draft:
        engines["draft k=4 (schema)"] = eng("draft", 4)
        engines["composite auto (schema)"] = eng("composite", "auto")
    warm = tok.encode_prompt("Hello")
    for e in engines.values():
        e.generate([warm], SamplingParams(temperature=0, max_tokens=4))
    tps = {n: [] for n in engines}
    mismatches, invalid, unfinished = 0, 0, 0
    for i, (passage, schema) in enumerate(PROMPTS):
        ids = tok.encode_prompt(f"Extract the facts from this text as JSON.\n\n{passage}")
        base = None
        for name, e in engines.items():
            constrained = "schema" in name
            params = SamplingParams(temperature=0, max_tokens=a.max_tokens, json_schema=schema if constrained else None)
            r = e.generate([ids], params)[0]
            tps[name].append(len(r.output) / (r.decode_time + r.draft_prefill_time))
            if name == "plain (schema)":
                base = r.output
                if r.finish_reason != "stop":
                    unfinished += 1  # cut by max_tokens: not yet a whole JSON value
                else:
                    try:
                        json.loads(tok.decode(r.output))
                    except ValueError:
                        invalid += 1
            elif constrained and r.output != base:
                mismatches += 1
        print(f"  prompt {i + 1}/{len(PROMPTS)}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in tps.items()),
              flush=True)
    ms = mask_ms(tok, models.vocab, PERSON, json.dumps({"name": "Marie Curie", "born": 1867, "field": "physics",
                                                         "awards": ["Nobel Prize in Physics"]}))
    rows = []
    for name, v in tps.items():
        ref = tps["plain (schema)"] if "schema" in name else tps["plain"]
        rows.append({"config": name, "tok_s": statistics.median(v),
                     "vs_plain": statistics.median([x / b for x, b in zip(v, tps["plain"])]),
                     "vs_constrained_plain": statistics.median([x / b for x, b in zip(v, ref)])})
    print(f"\n{target}" + (f" <- {draft} (q4_0)" if draft else "") + f", native, greedy, {len(PROMPTS)} JSON "
          f"extraction prompts x up to {a.max_tokens} tokens, {a.threads} threads, CPU: {cpu_name()}")
    print(f"  {'config':<26}{'tok/s':>8}{'vs plain':>10}{'vs plain (schema)':>19}")
    for r in rows:
        print(f"  {r['config']:<26}{r['tok_s']:>8.1f}{r['vs_plain']:>9.2f}x{r['vs_constrained_plain']:>18.2f}x")
    best = max((r for r in rows if r["config"] not in ("plain", "plain (schema)")), key=lambda r: r["vs_constrained_plain"])
    constrained_cost = next(r for r in rows if r["config"] == "plain (schema)")["vs_plain"]
    print(f"  mask + commit per token: {ms:.3f} ms; constrained plain / plain: {constrained_cost:.2f}; best "
          f"speculative / constrained plain: {best['vs_constrained_plain']:.2f} ({best['config']}); "
          f"speculative outputs differing from constrained plain: {mismatches}; invalid JSON: {invalid} "
          f"(cut by max_tokens: {unfinished})")
    goals = {"constrained_plain_within_10pct": constrained_cost >= 0.9,
             "speculative_ge_1.5x_constrained_plain": best["vs_constrained_plain"] >= 1.5}
    print(json.dumps({"benchmark": "structured", "cpu": cpu_name(), "target": target, "draft": draft,
                      "threads": a.threads, "max_tokens": a.max_tokens, "mask_ms_per_token": ms,
                      "mismatches": mismatches, "invalid_json": invalid, "unfinished": unfinished, "rows": rows, "goals": goals}))


if __name__ == "__main__":
    main()
