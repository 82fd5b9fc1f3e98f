"""`specdec bench` and `specdec verify`: their extra arguments and entry points (cli.py adds the
shared model / speculation / sampling arguments and dispatches here)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from specdec.config import (DEFAULT_MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SamplingParams, parse_draft_tree,
                            SpeculativeConfig, parse_num_draft_tokens)
from specdec.api import context_length
from specdec.errors import SpecdecError, check_int
from specdec.errors import lenient_float as _float
from specdec.errors import lenient_int as _int
from specdec.grammar import check_constraint
from specdec.loader import check_model_dtype, head_path, load_models
from specdec.runtime.hub import resolve_model
from specdec.tools import bench
from specdec.tools.audit import VerifySettings, format_report, run_verify
from specdec.tools.prompts import load_prompts


def sampling_params(a, seed=True) -> SamplingParams:
    """The shared sampling flags (cli._add_sampling_args) as SamplingParams (seed=False: without
    the seed, for verify, whose --seed seeds its own sampler)."""
    params = SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.seed if seed else None, max_tokens=a.max_tokens,
        stop=a.stop, seed_stable=getattr(a, "seed_stable", None),
        json_schema=_file_or_text("json_schema", getattr(a, "json_schema", None), inline_if="{"),
        regex=getattr(a, "regex", None), grammar=_file_or_text("grammar", getattr(a, "grammar", None)))
    check_constraint(params)
    return params


def _file_or_text(name: str, value: str | None, inline_if: str | None = None) -> str | None:
    """A flag that takes a file (or, when it starts with `inline_if`, the text itself)."""
    if value is None or (inline_if and value.lstrip().startswith(inline_if)):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise SpecdecError(f"{name}={value!r}: no such file; allowed: a readable file"
                           + (" or the JSON text itself" if inline_if else ""), name)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"{name}={value!r} cannot be read ({e}); allowed: a UTF-8 text file", name) from None


# the speculation flags and their SpeculativeConfig fields (cli._add_spec_args)
SPEC_FLAGS = ("num_draft_tokens", "max_draft_tokens", "draft_sampling", "draft_dtype", "ngram_min", "ngram_max")


def _spec_from_flags(a, proposer: str | None, k) -> SpeculativeConfig:
    spec = SpeculativeConfig(draft=a.draft, num_draft_tokens=k, max_draft_tokens=a.max_draft_tokens,
                             draft_sampling=a.draft_sampling, draft_dtype=a.draft_dtype, proposer=proposer,
                             ngram_min=a.ngram_min, ngram_max=a.ngram_max, head=a.head,
                             draft_tree=getattr(a, "draft_tree", None))
    spec.check_unused()
    if spec.draft is None and spec.proposer in ("head", "composite"):
        head_path(spec, str(a.model))  # a head must exist before a model is loaded for it
    if spec.proposer not in ("ngram", "head"):
        check_model_dtype("draft_dtype", spec.draft_dtype, spec.draft, "draft")
    return spec


def spec_config(a) -> SpeculativeConfig | None:
    """generate's and serve's speculation flags: None (plain decoding) when neither --draft nor
    --proposer is given, and then any other speculation flag would be ignored, so it is refused."""
    if a.draft is None and a.proposer is None and a.head is None:
        defaults = SpeculativeConfig.__dataclass_fields__
        for name in SPEC_FLAGS:
            value = getattr(a, name)
            if (parse_num_draft_tokens(value) != "auto" if name == "num_draft_tokens"
                    else value != defaults[name].default):
                flag = "--" + name.replace("_", "-")
                raise SpecdecError(f"{name}={value!r} needs a proposer ({flag} would be ignored); allowed "
                                   "with --draft MODEL, --head DIR or --proposer ngram|composite|head", name)
        return None
    return _spec_from_flags(a, a.proposer, a.num_draft_tokens)


def check_common(a) -> None:
    """The model, machine and speculation flags every model command shares, checked before
    anything is loaded."""
    if a.threads is not None:
        check_int("threads", a.threads, 1, None)
    if getattr(a, "max_model_len", None) is not None:
        check_int("max_model_len", a.max_model_len, 2, None)
    check_model_dtype("dtype", a.dtype, a.model, "model")
    if a.cmd in ("generate", "serve"):
        spec_config(a)
        return
    ks = parse_ks(a.num_draft_tokens)  # verify and bench always speculate (ngram without a draft)
    _spec_from_flags(a, a.proposer, "auto" if "auto" in ks else ks[0])


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
        raise SpecdecError(f"num_draft_tokens is empty; allowed: integers in [0, {MAX_DRAFT_TOKENS}] or 'auto'",
                           "num_draft_tokens")
    ks = []
    for v in items:
        if v.lower() == "auto":
            k = "auto"
        else:
            k = parse_num_draft_tokens(v)
        if k in ks:
            raise SpecdecError(f"num_draft_tokens lists {k!r} twice; allowed: distinct values",
                               "num_draft_tokens")
        ks.append(k)
    return ks


def _setup(a):
    if a.threads is not None:
        torch.set_num_threads(check_int("threads", a.threads, 1, None))


def _max_draft(a) -> int:
    m = getattr(a, "max_draft_tokens", None)
    return DEFAULT_MAX_DRAFT_TOKENS if m is None else check_int("max_draft_tokens", m, 0, MAX_DRAFT_TOKENS)


def add_verify_args(p: argparse.ArgumentParser) -> None:
    _set_option(p, "--num-draft-tokens", type=str, default="4",
                help="draft tokens per round k in [0, 32], or 'auto' (default 4)")
    p.add_argument("--prefix", default=None,
                   help="fixed prefix text, used raw (default: repetitive text for --proposer ngram, "
                        "a code stub otherwise)")
    p.add_argument("--n", type=_int, default=3, help="emitted tokens compared, [1, 8] (default 3)")
    p.add_argument("--samples", type=_int, default=20_000, help="samples N, at most, >= 100 (default 20000)")
    p.add_argument("--max-seconds", type=_float, default=300.0,
                   help="stop sampling after this long, at a batch boundary, > 0 (default 300)")
    p.add_argument("--batch", type=_int, default=None, help="rows per engine batch, >= 1 (default: by vocabulary)")
    p.add_argument("--alpha", type=_float, default=1e-3, help="pass when p-value > alpha, (0, 1) (default 1e-3)")
    p.add_argument("--control", default=None, choices=["redraw-from-p"],
                   help="negative control: a deliberately wrong verifier that must FAIL")
    p.add_argument("--json", action="store_true", help="print only the JSON line")


def cmd_verify(a, models=None) -> int:
    """models: preloaded specdec.loader.Models (tests); otherwise loaded from --model/--draft."""
    _setup(a)
    proposer = _spec_from_flags(a, a.proposer, "auto").proposer
    if parse_draft_tree(getattr(a, "draft_tree", None)) is not None:
        raise SpecdecError("verify does not audit draft trees yet (its memoised target scores chains); "
                           "tests/test_tree_engine.py checks tree sampling through the engine", "draft_tree")
    k = parse_ks(a.num_draft_tokens)
    if len(k) != 1:
        raise SpecdecError(f"verify takes one num_draft_tokens value, got {a.num_draft_tokens!r}; allowed: "
                           f"one integer in [0, {MAX_DRAFT_TOKENS}] or 'auto'", "num_draft_tokens")
    settings = VerifySettings(
        params=sampling_params(a, seed=False), proposer=proposer, k=k[0], max_draft_tokens=_max_draft(a),
        draft_sampling=a.draft_sampling, ngram_min=a.ngram_min, ngram_max=a.ngram_max, head=a.head,
        prefix=a.prefix, n=a.n, samples=a.samples, max_seconds=a.max_seconds, batch=a.batch,
        seed=0 if a.seed is None else a.seed, alpha=a.alpha, control=a.control)
    if models is None:
        models = load_models(a.model, a.draft if proposer in ("draft", "composite") else None, a.dtype,
                             a.draft_dtype, a.device)
    with Progress(console=Console(stderr=True), transient=True, disable=a.json) as prog:
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
    _set_option(p, "--temperature", default=0.0, help="0 = greedy; [0, 2] (default 0)")
    p.add_argument("--output", default="bench-results",
                   help="directory for results.json and plots (default bench-results)")
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval | chat | copy | FILE.jsonl, one {\"prompt\": \"...\"} per line (default humaneval)")
    p.add_argument("--num-prompts", type=_int, default=10, help="prompts used, >= 1 (default 10)")
    p.add_argument("--repeats", type=_int, default=1, help="passes over the prompts, >= 1 (default 1)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--compare", default=None, choices=["transformers"],
                   help="also run transformers' generate, assisted generation and prompt lookup")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")


def cmd_bench(a, models=None) -> int:
    """models: preloaded specdec.loader.Models (tests); otherwise loaded from --model/--draft."""
    _setup(a)
    ks = parse_ks(a.num_draft_tokens)
    check_int("num_prompts", a.num_prompts, 1, None)
    check_int("repeats", a.repeats, 1, None)
    params = sampling_params(a)
    proposer = _spec_from_flags(a, a.proposer, "auto" if "auto" in ks else ks[0]).proposer
    prompts = load_prompts(a.prompts, a.num_prompts)
    if not prompts:
        raise SpecdecError(f"prompt set {a.prompts!r} is empty; it needs at least 1 prompt", "prompts")
    out = Path(a.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create output directory {out}: {e.strerror}") from None
    settings = bench.BenchSettings(
        prompts=prompts, params=params, ks=ks, proposer=proposer,
        max_draft_tokens=_max_draft(a), draft_sampling=a.draft_sampling, ngram_min=a.ngram_min,
        ngram_max=a.ngram_max, head=a.head, repeats=a.repeats, raw=a.raw, compare=[a.compare] if a.compare else [],
        draft_tree=parse_draft_tree(getattr(a, "draft_tree", None)))
    if models is None:
        models = load_models(a.model, a.draft if proposer in ("draft", "composite") else None, a.dtype,
                             a.draft_dtype, a.device, max_model_len=a.max_model_len)
    settings.max_seq_len = context_length(models, a.max_model_len)
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
    with Progress(console=Console(stderr=True), disable=a.json or log, transient=True) as prog:
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
