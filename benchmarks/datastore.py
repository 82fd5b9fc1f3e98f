"""Would a datastore of the target's own answers (retrieval drafting, REST's idea) add to the head?

The target answers N training prompts greedily (specdec.head.data: the head's own prompt list,
never the held-out sets); their tokens are the datastore, an n-gram table (n = 1..8) of each
context's followers. Then, from every round start of the target's greedy answers to the held-out
chat set and 20 HumanEval prompts, three proposers draft 4 tokens each, as decoding would:

  head:      the shipped head (SmolLM2), chained on its own features (`train.acceptance`'s way)
  datastore: the longest datastore suffix match (<= 8 tokens), then its most frequent follower,
             again and again
  context:   the request's own n-gram lookup (`NgramIndex(1, 4)`, what `--proposer ngram` runs)

and the table gives the mean accepted drafts per round start (up to the first miss) for each
alone, for switching policies (the datastore where its match is >= L tokens long and its top
follower has >= s of the followers, else the context lookup where its match is >= 3 long, else
the head at k = 1) against the same switch without the datastore (the baseline), and for an
oracle that always takes the best of the three. A table, one JSON line.

    .venv/bin/python benchmarks/datastore.py [--prompts 2000] [--threads 2] [--cache FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch
from serve import cpu_name

from specdec.config import SamplingParams
from specdec.head import load_head, shipped_head
from specdec.head.data import harvest, training_prompts
from specdec.loader import build_engine, load_models
from specdec.proposers.ngram import NgramIndex
from specdec.tools.prompts import CHAT_PROMPTS, humaneval

K, NMAX = 4, 8


class Datastore:
    """n-gram (n = 1..NMAX) -> Counter of the token that followed, over every answer."""

    def __init__(self, answers: list[list[int]]):
        self.follow = collections.defaultdict(collections.Counter)
        for a in answers:
            for j in range(1, len(a)):
                for n in range(1, min(NMAX, j) + 1):
                    self.follow[tuple(a[j - n:j])][a[j]] += 1

    def draft(self, ctx: list[int], k: int) -> tuple[list[int], int, float]:
        """(up to k tokens, the first step's matched length, its top follower's share)."""
        ctx, out, first = list(ctx), [], (0, 0.0)
        for _ in range(k):
            for n in range(min(NMAX, len(ctx)), 0, -1):
                c = self.follow.get(tuple(ctx[-n:]))
                if c:
                    (t, m), = c.most_common(1)
                    if not out:
                        first = (n, m / sum(c.values()))
                    break
            else:
                break
            out.append(t)
            ctx.append(t)
        return out, *first


def run_length(draft, truth) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def answers(models, n: int, cache: str | None) -> list[list[int]]:
    if cache and os.path.exists(cache):
        return torch.load(cache)
    tok = models.tokenizer
    eng = build_engine(models, None, max_model_len=2048, max_batch=32)
    params = SamplingParams(temperature=0, max_tokens=256)
    prompts = [tok.encode_prompt(p) for _, p in training_prompts(0)[:n]]
    out, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), 32):
        out += [list(r.output) for r in eng.generate(prompts[i:i + 32], params)]
        print(f"  datastore: {len(out)} answers, {sum(map(len, out))} tokens, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    if cache:
        torch.save(out, cache)
    return out


@torch.inference_mode()
def round_starts(head, store: Datastore, seqs) -> list[tuple]:
    """Per round start: (head run, datastore run, its match length, its share, context run, its length)."""
    rows = []
    for s in seqs:
        T = len(s.hidden) - 1
        if T < 2:
            continue
        gs = head.unroll(s.hidden[:T].float().unsqueeze(0), torch.tensor(s.tokens[1:T + 1]).unsqueeze(0),
                         torch.arange(T).unsqueeze(0), K)
        drafts = head.vocab[torch.stack([head.logits(g[0]).argmax(-1) for g in gs])]
        idx = NgramIndex(1, 4)
        for j0 in range(max(s.prompt_len - 1, 0), T - K):
            ctx, truth = s.tokens[:j0 + 2], s.tokens[j0 + 2:j0 + 2 + K]
            dd, dn, share = store.draft(ctx, K)
            idx.extend(ctx)
            cd, cn = idx.match(ctx, K)
            rows.append((run_length([int(drafts[r, j0 + r]) for r in range(K)], truth),
                         run_length(dd, truth), dn, share, run_length(cd, truth), cn))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2000, help="training prompts the datastore answers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=None, help="keep the datastore's answers here (torch.save)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models("smollm2-135m")
    store_answers = answers(models, args.prompts, args.cache)
    store = Datastore(store_answers)
    head = load_head(shipped_head("smollm2-135m"), models.target)
    sets = {"chat": [("chat", p) for p in CHAT_PROMPTS], "code": [("code", p) for p in humaneval(20)]}
    print(f"{cpu_name()}, {args.threads} threads; datastore {len(store_answers)} answers, "
          f"{sum(map(len, store_answers))} tokens; mean accepted drafts per round start (k = {K})")
    print("| held out | round starts | head k=1 | head k=4 | datastore | context | baseline switch "
          "| + datastore (n>=3, s>=0.8) | + datastore (n>=4, s>=0.8) | oracle of 3 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    for name, ps in sets.items():
        rows = round_starts(head, store, harvest(models.target, models.tokenizer, ps, 192, 32, 0,
                                                 sampled_share=0.0))
        mean = lambda f: sum(map(f, rows)) / len(rows)  # noqa: E731
        base = lambda r: r[4] if r[5] >= 3 else min(r[0], 1)  # noqa: E731

        def switch(L, s):
            return mean(lambda r: r[1] if r[2] >= L and r[3] >= s else base(r))
        res = {"round_starts": len(rows), "head_k1": mean(lambda r: min(r[0], 1)), "head_k4": mean(lambda r: r[0]),
               "datastore": mean(lambda r: r[1]), "context": mean(lambda r: r[4]), "baseline_switch": mean(base),
               "with_datastore_3_0.8": switch(3, 0.8), "with_datastore_4_0.8": switch(4, 0.8),
               "oracle": mean(lambda r: max(r[0], r[1], r[4]))}
        out[name] = {k: round(v, 3) for k, v in res.items()}
        print(f"| {name} | " + " | ".join(str(v) for v in out[name].values()) + " |")
    print(json.dumps({"benchmark": "datastore", "cpu": cpu_name(), "threads": args.threads,
                      "datastore_tokens": sum(map(len, store_answers)), "results": out}))


if __name__ == "__main__":
    main()
