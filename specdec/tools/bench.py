"""`specdec bench`: how much faster is speculative decoding here, on these prompts?

Configurations: our plain decode, our speculative decode for each k (an int, or "auto"), and
with `--compare transformers` transformers' plain `generate`, its assisted generation with the
same draft and k (`num_assistant_tokens=k`, schedule "constant", confidence threshold 0 so the
draft length really is k) and its prompt lookup (`prompt_lookup_num_tokens=k`). Every
configuration runs on the same prompts, interleaved (for each repeat, for each prompt, every
configuration back to back) so machine noise hits all alike; one warm-up run each first.

Decode tokens/s per run: ours = emitted tokens / decode time (prefill excluded, engine clocks);
transformers = (n - 1) / (t(n) - t(1)), t(m) the same `generate` call for m new tokens, so its
prefill (target and draft) is excluded too. "prompt s": the time to first token's share that
grows with the prompt, the target's prompt processing (ours; the first decode step follows it)
or transformers' whole 1-token `generate`. Reported: medians over runs; ratios are medians of
per-run ratios against the baseline run on the same prompt and repeat. Results go to DIR as
results.json and three PNG plots; the terminal gets a table and, last, one JSON line.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.config import SamplingParams, SpeculativeConfig, tree_text
from specdec.loader import Models, build_engine
from specdec.metrics import SpecStats

PLAIN, HF_PLAIN = "plain", "transformers plain"


@dataclass
class BenchSettings:
    prompts: list[str]
    params: SamplingParams  # max_tokens = tokens per run; ignore_eos is set
    ks: list  # ints and/or "auto"
    proposer: str  # draft | ngram | composite | head
    head: str | None = None  # a trained head's directory (proposer head; None: the shipped one)
    draft_tree: tuple | None = None  # children per depth (proposer draft): drafts are trees
    max_draft_tokens: int = 8
    draft_sampling: str = "probabilistic"
    ngram_min: int = 1
    ngram_max: int = 4
    repeats: int = 1
    raw: bool = False
    max_seq_len: int = 4096
    compare: list[str] = field(default_factory=list)  # ["transformers"]


@dataclass
class Run:
    config: str
    prompt: int
    repeat: int
    tokens: int
    seconds: float
    output: list[int]
    stats: SpecStats | None = None
    prompt_s: float = 0.0  # the target's prompt processing (ours) or a 1-token generate (transformers)
    prompt_tokens: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Ours:
    """One of our engines (plain or speculative), batch 1."""

    def __init__(self, name, engine, k, proposer=None):
        self.name, self.engine, self.k, self.kind = name, engine, k, "specdec"
        self.proposer = proposer  # None: plain decoding

    def run(self, ids, params):
        r = self.engine.generate([ids], params)[0]
        # the draft model's prompt prefill (done with the target's at a fixed k) is charged to
        # decoding, as transformers' assisted generation pays it in its first step
        return len(r.output), r.decode_time + r.draft_prefill_time, r.output, r.stats, r.prefill_time


class Transformers:
    """transformers' generate with the given extra arguments (assisted, prompt lookup)."""

    def __init__(self, name, model, k, counterpart=None, **extra):
        self.name, self.model, self.k, self.extra, self.kind = name, model, k, extra, "transformers"
        self.counterpart = counterpart  # our proposers it is compared with

    def _generate(self, ids, params, n):
        kw = dict(do_sample=False) if params.greedy else dict(
            do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            min_p=params.min_p or None)
        t0 = time.perf_counter()
        out = self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw, **self.extra)
        return time.perf_counter() - t0, out[0, ids.shape[1]:].tolist()

    @torch.inference_mode()
    def run(self, ids, params):
        x = torch.tensor([ids])
        t1, _ = self._generate(x, params, 1)
        tn, out = self._generate(x, params, params.max_tokens)
        return len(out) - 1, max(tn - t1, 1e-9), out, None, t1


def load_transformers(path: Path):
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def build_configs(models: Models, s: BenchSettings, hf_paths: tuple | None = None) -> list:
    """Ours (plain, then one per k) and, given (target dir, draft dir or None), transformers'."""
    configs = [Ours(PLAIN, build_engine(models, None, s.max_seq_len), 0)]
    for k in s.ks:
        spec = SpeculativeConfig(draft=models.draft_name, num_draft_tokens=k, max_draft_tokens=s.max_draft_tokens,
                                 draft_sampling=s.draft_sampling, proposer=s.proposer,
                                 head=s.head, ngram_min=s.ngram_min, ngram_max=s.ngram_max, draft_tree=s.draft_tree)
        name = s.proposer if s.draft_tree is None else f"{s.proposer} tree {tree_text(s.draft_tree)}"
        configs.append(Ours(f"{name} k={k}", build_engine(models, spec, s.max_seq_len), k, s.proposer))
    if hf_paths is not None:
        target = load_transformers(hf_paths[0])
        draft = load_transformers(hf_paths[1]) if hf_paths[1] is not None else None
        configs.append(Transformers(HF_PLAIN, target, 0))
        for k in [k for k in s.ks if isinstance(k, int) and k > 0]:
            if draft is not None:
                configs.append(Transformers(f"transformers assisted k={k}", target, k, ("draft", "composite"),
                                            assistant_model=draft,
                                            num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                            assistant_confidence_threshold=0.0))
            configs.append(Transformers(f"transformers prompt-lookup k={k}", target, k, ("ngram",),
                                        prompt_lookup_num_tokens=k))
    return configs


def run_bench(models: Models, s: BenchSettings, configs: list, progress=None) -> list[Run]:
    params = SamplingParams(**{**s.params.__dict__, "ignore_eos": True, "stop": [], "stop_token_ids": []})
    ids = [models.tokenizer.encode_prompt(p, raw=s.raw) for p in s.prompts]
    warm = SamplingParams(**{**params.__dict__, "max_tokens": 4})
    for c in configs:  # warm-up: kernels, allocator, transformers' caches
        c.run(ids[0][:32], warm)
    runs = []
    for rep in range(s.repeats):
        for i, x in enumerate(ids):
            for c in configs:
                n, sec, out, stats, prompt_s = c.run(x, params)
                runs.append(Run(c.name, i, rep, n, sec, out, stats, prompt_s, len(x)))
                if progress is not None:
                    progress(f"{c.name}, prompt {i + 1}/{len(ids)}, repeat {rep + 1}: {runs[-1].tok_s:.2f} tok/s")
    return runs


def _median_ratio(runs, name, base):
    by = {(r.prompt, r.repeat): r.tok_s for r in runs if r.config == base}
    rs = [r.tok_s / by[(r.prompt, r.repeat)] for r in runs
          if r.config == name and by.get((r.prompt, r.repeat), 0) > 0]
    return statistics.median(rs) if rs else None


def summarise(runs: list[Run], configs: list, params: SamplingParams) -> dict:
    rows = []
    has_hf = any(c.name == HF_PLAIN for c in configs)
    plain_out = {(r.prompt, r.repeat): r.output for r in runs if r.config == PLAIN}
    for c in configs:
        mine = [r for r in runs if r.config == c.name]
        row = {"config": c.name, "engine": c.kind, "k": c.k,
               "tok_s": statistics.median(r.tok_s for r in mine),
               "tokens": sum(r.tokens for r in mine), "seconds": sum(r.seconds for r in mine),
               "prompt_s": statistics.median(r.prompt_s for r in mine),
               "prompt_tokens": statistics.median(r.prompt_tokens for r in mine),
               "vs_plain": _median_ratio(runs, c.name, PLAIN),
               "vs_transformers_plain": _median_ratio(runs, c.name, HF_PLAIN) if has_hf else None}
        if c.kind == "specdec" and c.name != PLAIN:
            st = SpecStats()
            for r in mine:
                st.merge(r.stats)
            row.update({key: v for key, v in st.to_dict().items() if key in (
                "acceptance_rate", "mean_acceptance_length", "per_position_acceptance",
                "draft_cost_ratio", "predicted_speedup")})
            row["mean_k"] = st.draft_tokens / st.rounds if st.rounds else 0.0
            if params.greedy:  # greedy speculative output must equal plain, token for token
                row["greedy_mismatches"] = sum(r.output != plain_out[(r.prompt, r.repeat)] for r in mine)
        rows.append(row)
    pairs = []
    for c in configs:
        if c.name == PLAIN and has_hf:
            pairs.append({"ours": PLAIN, "theirs": HF_PLAIN, "ratio": _median_ratio(runs, PLAIN, HF_PLAIN)})
        elif c.kind == "transformers" and c.k > 0:
            ours = [o for o in configs if o.kind == "specdec" and o.k == c.k and o.proposer in c.counterpart]
            if ours:
                pairs.append({"ours": ours[0].name, "theirs": c.name,
                              "ratio": _median_ratio(runs, ours[0].name, c.name)})
    return {"rows": rows, "pairs": pairs}


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(summary: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("config", "tok/s", "vs plain", "vs tf plain", "accept", "mean len", "c", "predicted",
                "prompt s"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in summary["rows"]:
        t.add_row(r["config"], _fmt(r["tok_s"], ".2f"), _fmt(r["vs_plain"], ".2f") + "x",
                  _fmt(r["vs_transformers_plain"], ".2f") + ("x" if r["vs_transformers_plain"] else ""),
                  _fmt(r.get("acceptance_rate"), ".2f"), _fmt(r.get("mean_acceptance_length"), ".2f"),
                  _fmt(r.get("draft_cost_ratio"), ".2f"),
                  _fmt(r.get("predicted_speedup"), ".2f") + ("x" if r.get("predicted_speedup") else ""),
                  _fmt(r.get("prompt_s"), ".3f"))
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(t)
    for p in summary["pairs"]:
        console.print(f"{p['ours']} vs {p['theirs']}: {_fmt(p['ratio'], '.2f')}x")


def plot(summary: dict, out: Path, title: str) -> list[str]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    files = []
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    bars = ax.barh([r["config"] for r in rows][::-1], [r["tok_s"] for r in rows][::-1],
                   color=["tab:blue" if r["engine"] == "specdec" else "tab:gray" for r in rows][::-1])
    ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax.margins(x=0.12)
    ax.set_xlabel("decode tokens/s (median)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=110)
    files.append("tokens_per_s.png")
    plt.close(fig)

    spec = [r for r in rows if r.get("per_position_acceptance")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in spec:
        acc = r["per_position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["config"])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("accepted / proposed at i")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance rate by draft position", fontsize=9)
    if spec:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=110)
    files.append("acceptance_by_position.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ours = [r for r in rows if r["engine"] == "specdec" and r["config"] != PLAIN]
    fixed = sorted([r for r in ours if isinstance(r["k"], int)], key=lambda r: r["k"])
    if fixed:
        ax.plot([r["k"] for r in fixed], [r["vs_plain"] for r in fixed], "o-", label="measured")
        ax.plot([r["k"] for r in fixed], [r.get("predicted_speedup") or 1.0 for r in fixed], "s--",
                label="cost model (1 - a^(k+1)) / ((1 - a)(kc + 1))")
    for r in ours:
        if r["k"] == "auto":
            ax.plot([r["mean_k"]], [r["vs_plain"]], "*", markersize=12, label=f"auto (mean k {r['mean_k']:.1f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over our plain decode")
    ax.set_title("speedup against k: measured and predicted", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_k.png", dpi=110)
    files.append("speedup_vs_k.png")
    plt.close(fig)
    return files
