"""`specdec bench` and `specdec verify`: their extra arguments and entry points (cli.py adds the
shared model / speculation / sampling arguments and dispatches here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.progress import Progress

from specdec.config import MAX_DRAFT_TOKENS, SamplingParams
from specdec.errors import SpecdecError
from specdec.loader import load_models
from specdec.runtime.hub import resolve_model
from specdec.tools import bench
from specdec.tools.audit import VerifySettings, format_report, run_verify
from specdec.tools.prompts import load_prompts


def sampling_params(a) -> SamplingParams:
    """The shared sampling flags (cli._add_sampling_args) as SamplingParams."""
    return SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.max_tokens, stop=a.stop)


def _set_option(p: argparse.ArgumentParser, flag: str, **fields) -> None:
    """Adjust an option defined by the shared helpers (e.g. --num-draft-tokens takes a list here)."""
    for act in p._actions:
        if flag in act.option_strings:
            for name, value in fields.items():
                setattr(act, name, value)
            return
    raise AssertionError(flag)


def parse_ks(values) -> list:
    """--num-draft-tokens values ("2 4 6", "2,4,6", "auto") -> [2, 4, 6] / ["auto"]."""
    items = [v for s in ([values] if isinstance(values, (str, int)) else values)
             for v in str(s).replace(",", " ").split()]
    if not items:
        raise SpecdecError(f"num_draft_tokens is empty; give integers in [0, {MAX_DRAFT_TOKENS}] or 'auto'")
    ks = []
    for v in items:
        if v.lower() == "auto":
            k = "auto"
        else:
            try:
                k = int(v)
            except ValueError:
                raise SpecdecError(f"num_draft_tokens={v!r} must be 'auto' or an integer in "
                                   f"[0, {MAX_DRAFT_TOKENS}]") from None
            if not 0 <= k <= MAX_DRAFT_TOKENS:
                raise SpecdecError(f"num_draft_tokens={k} is out of range; allowed [0, {MAX_DRAFT_TOKENS}] or 'auto'")
        if k in ks:
            raise SpecdecError(f"num_draft_tokens lists {k!r} twice")
        ks.append(k)
    return ks


def _setup(a):
    if a.threads is not None:
        if a.threads < 1:
            raise SpecdecError(f"threads={a.threads} is out of range; allowed [1, inf)")
        torch.set_num_threads(a.threads)


def _max_draft(a) -> int:
    return getattr(a, "max_draft_tokens", None) or 8


def add_verify_args(p: argparse.ArgumentParser) -> None:
    _set_option(p, "--num-draft-tokens", type=str, default="4",
                help="draft tokens per round k in [0, 32], or 'auto' (default 4)")
    p.add_argument("--prefix", default=None,
                   help="fixed prefix text, used raw (default: repetitive text for --proposer ngram, "
                        "a code stub otherwise)")
    p.add_argument("--n", type=int, default=3, help="emitted tokens compared (default 3)")
    p.add_argument("--samples", type=int, default=20_000, help="samples N, at most (default 20000)")
    p.add_argument("--max-seconds", type=float, default=300.0,
                   help="stop sampling after this long, at a batch boundary (default 300)")
    p.add_argument("--batch", type=int, default=None, help="rows per engine batch (default: by vocabulary)")
    p.add_argument("--alpha", type=float, default=1e-3, help="pass when p-value > alpha (default 1e-3)")
    p.add_argument("--control", default=None, choices=["redraw-from-p"],
                   help="negative control: a deliberately wrong verifier that must FAIL")
    p.add_argument("--json", action="store_true", help="print only the JSON line")


def cmd_verify(a, models=None) -> int:
    """models: preloaded specdec.loader.Models (tests); otherwise loaded from --model/--draft."""
    _setup(a)
    proposer = a.proposer or ("draft" if a.draft is not None else "ngram")
    k = parse_ks(a.num_draft_tokens)
    if len(k) != 1:
        raise SpecdecError(f"verify takes one num_draft_tokens value, got {a.num_draft_tokens!r}")
    if not 0 < a.alpha < 1:
        raise SpecdecError(f"alpha={a.alpha} is out of range; allowed (0, 1)")
    settings = VerifySettings(
        params=sampling_params(a), proposer=proposer, k=k[0], max_draft_tokens=_max_draft(a),
        draft_sampling=a.draft_sampling, ngram_min=a.ngram_min, ngram_max=a.ngram_max,
        prefix=a.prefix, n=a.n, samples=a.samples, max_seconds=a.max_seconds, batch=a.batch,
        seed=a.seed or 0, alpha=a.alpha, control=a.control)
    if models is None:
        models = load_models(a.model, a.draft if proposer != "ngram" else None, a.dtype, a.draft_dtype,
                             a.device)
    with Progress(transient=True, disable=a.json) as prog:
        task = prog.add_task("sampling", total=settings.samples)
        result = run_verify(models, settings, progress=lambda done, _: prog.update(task, completed=done))
    if not a.json:
        print(f"specdec verify: target {models.name}" + (f", draft {models.draft_name}" if models.draft_name else ""))
        print(format_report(result))
    print(json.dumps(result))
    return 0 if result["verdict"] == "pass" else 1


def add_bench_args(p: argparse.ArgumentParser) -> None:
    _set_option(p, "--num-draft-tokens", type=str, nargs="+", default=["2", "4", "6"],
                help="draft tokens per round k, several values (2 4 6, or 2,4,6) and/or 'auto' "
                     "(default: 2 4 6)")
    _set_option(p, "--temperature", default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--output", default="bench-results", help="directory for results.json and plots")
    p.add_argument("--prompts", default="humaneval", help="humaneval | chat | FILE.jsonl (default humaneval)")
    p.add_argument("--num-prompts", type=int, default=10, help="prompts used (default 10)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default 1)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--compare", default=None, choices=["transformers"],
                   help="also run transformers' generate, assisted generation and prompt lookup")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")


def cmd_bench(a, models=None) -> int:
    """models: preloaded specdec.loader.Models (tests); otherwise loaded from --model/--draft."""
    _setup(a)
    ks = parse_ks(a.num_draft_tokens)
    if a.num_prompts < 1:
        raise SpecdecError(f"num_prompts={a.num_prompts} is out of range; allowed [1, inf)")
    if a.repeats < 1:
        raise SpecdecError(f"repeats={a.repeats} is out of range; allowed [1, inf)")
    prompts = load_prompts(a.prompts, a.num_prompts)
    if not prompts:
        raise SpecdecError(f"prompt set {a.prompts!r} is empty")
    proposer = a.proposer or ("draft" if a.draft is not None else "ngram")
    if proposer in ("draft", "composite") and a.draft is None:
        raise SpecdecError(f"proposer={proposer!r} needs a draft model (--draft MODEL)")
    out = Path(a.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create output directory {out}: {e.strerror}") from None
    settings = bench.BenchSettings(
        prompts=prompts, params=sampling_params(a), ks=ks, proposer=proposer,
        max_draft_tokens=_max_draft(a), draft_sampling=a.draft_sampling, ngram_min=a.ngram_min,
        ngram_max=a.ngram_max, repeats=a.repeats, raw=a.raw, max_seq_len=a.max_model_len,
        compare=[a.compare] if a.compare else [])
    if models is None:
        models = load_models(a.model, a.draft if proposer != "ngram" else None, a.dtype, a.draft_dtype, a.device)
    hf_paths = None
    if a.compare == "transformers":
        if not isinstance(a.model, str):
            raise SpecdecError("--compare transformers needs --model as a name or path")
        hf_paths = (resolve_model(a.model), resolve_model(a.draft) if models.draft is not None else None)
    configs = bench.build_configs(models, settings, hf_paths)
    total = len(configs) * len(prompts) * a.repeats
    log = not a.json and not sys.stderr.isatty()  # a log file gets one line per run instead

    def progress(what):
        prog.update(task, advance=1, description=what)
        if log:
            print(what, file=sys.stderr, flush=True)
    with Progress(disable=a.json or log, transient=True) as prog:
        task = prog.add_task("warm-up", total=total)
        runs = bench.run_bench(models, settings, configs, progress=progress)
    summary = bench.summarise(runs, configs, settings.params)
    title = (f"{models.name}" + (f" <- {models.draft_name}" if models.draft_name else "") +
             f", {len(prompts)} {Path(a.prompts).name} prompts x {a.max_tokens} tokens x {a.repeats}, "
             f"T={a.temperature}, {torch.get_num_threads()} threads")
    files = bench.plot(summary, out, title)
    result = {"benchmark": "specdec bench", "title": title, "model": models.name, "draft": models.draft_name,
              "prompts": a.prompts, "num_prompts": len(prompts), "max_tokens": a.max_tokens,
              "repeats": a.repeats, "temperature": a.temperature, **summary,
              "runs": [{"config": r.config, "prompt": r.prompt, "repeat": r.repeat, "tokens": r.tokens,
                        "seconds": r.seconds} for r in runs]}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    if not a.json:
        bench.print_table(summary, title)
        print(f"results: {out / 'results.json'}; plots: {', '.join(str(out / f) for f in files)}")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {"output": str(out)}))
    return 0
