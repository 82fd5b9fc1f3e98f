"""Command line: `specdec generate | serve | models list | models fetch | verify | bench`.

Failure modes, each one line on stderr and no traceback (SPECDEC_DEBUG=1 adds it):
  - bad input (a SpecdecError or an argparse error): names the value and the allowed range, exit 2;
  - Ctrl-C at any point, start-up included (torch is imported inside `main`'s guard): exit 130,
    also where an imported library's bare `except:` swallowed the KeyboardInterrupt (`main`'s
    SIGINT handler records it, and the command is not started or its exit is 130);
  - a closed stdout (`specdec generate ... | head -c 5`): quiet, exit 141 (128 + SIGPIPE);
  - anything else: names the exception, exit 1.
Numbers are parsed leniently here (`_int`, `_float` keep what they cannot parse) so that the
field's own check, written once in specdec.config or where the value is used, names the value
and its range in the same words as the Python API and the server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from specdec.config import DEFAULT_MAX_MODEL_LEN, DRAFT_SAMPLING, DTYPES
from specdec.errors import SpecdecError, check_text
from specdec.errors import lenient_float as _float
from specdec.errors import lenient_int as _int

EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 2, 130, 141
_interrupted = False  # a SIGINT arrived (set by main's handler, even if its exception was swallowed)


def _on_sigint(signum, frame):
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _check_interrupt() -> None:
    """Raise the Ctrl-C that start-up's imports may have swallowed."""
    if _interrupted:
        raise KeyboardInterrupt


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("specdec: error: ...", exit 2) like every other bad input."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"specdec: error: {message} (see: {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in h.lower() or d is None or d is False
                or d is argparse.SUPPRESS):
            return h
        shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
        return f"{h} (default: {shown.replace('%', '%%')})".lstrip()


def _add_model_args(p: argparse.ArgumentParser, context: bool = True) -> None:
    from specdec.runtime.hub import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="registry name, GGUF file or HF directory")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="target weight storage: native runs a GGUF's own quantised blocks with int8 "
                        "activations (as llama.cpp does), fp32 dequantises them, bf16 rounds the "
                        "weights, q4_0 requantises the blocks to Q4_0; each defines the model whose "
                        "distribution is reproduced (default: auto = native for a GGUF, fp32 for an "
                        "HF directory)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=_int, default=None, help="torch CPU threads, >= 1 (default: torch's)")
    if context:
        p.add_argument("--max-model-len", type=_int, default=None,
                       help=f"context length cap, in [2, the model's context] (default: "
                            f"{DEFAULT_MAX_MODEL_LEN}, or the model's context if smaller)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, help="draft model (name, GGUF or HF dir) for speculation")
    p.add_argument("--proposer", default=None,
                   help="draft | ngram | composite (n-gram lookup first, the draft model when it "
                        "finds nothing; without --draft, the draft head) | head (a trained draft head: --head DIR, or the one shipped "
                        "for the model). Default: composite when --draft is given (draft with a fixed "
                        "or auto --draft-tree), head when --head is; no speculation otherwise")
    p.add_argument("--head", default=None, metavar="DIR",
                   help="a draft head trained by `specdec train-head` (implies --proposer head; "
                        "also the second part of --proposer composite without --draft)")
    p.add_argument("--ngram-min", type=_int, default=1, help="shortest suffix n-gram to match, [1, 64]")
    p.add_argument("--ngram-max", type=_int, default=4, help="longest suffix n-gram to match, [1, 64]")
    p.add_argument("--num-draft-tokens", default="auto",
                   help="draft tokens per round k in [0, 32], or 'auto': each round picks k in "
                        "[0, --max-draft-tokens] from measured acceptance and costs")
    p.add_argument("--max-draft-tokens", type=_int, default=8, help="k_max for auto, [0, 32]")
    p.add_argument("--draft-tree", default=None, metavar="W1,W2,...|auto|dynamic[:N]",
                   help="the draft model (or head) drafts a tree: W_d candidates under each node at depth d "
                        "(its top ones), all verified in one forward, losslessly; depth = the "
                        "number of widths, cut to the round's k. auto: each round's shape (a chain "
                        "included) from the measured verify cost and acceptances. dynamic[:N]: each "
                        "row's tree grown where the draft is confident (EAGLE-2), N nodes (default 2k), "
                        "depth k; with --proposer ngram, the trie of what followed several earlier "
                        "matches; with --proposer composite, the union of both. Default: off (a chain)")
    p.add_argument("--draft-sampling", default="probabilistic", choices=DRAFT_SAMPLING,
                   help="draft samples from q (probabilistic) or takes its argmax (one-hot q)")
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                   help="draft weight storage (q4_0: its GGUF blocks requantised to Q4_0, the "
                        "fewest bytes per step); never changes the output distribution, only "
                        "acceptance and speed (default: auto, as --dtype)")


def _add_sampling_args(p: argparse.ArgumentParser, seed_stable: bool = True, constraints: bool = True) -> None:
    p.add_argument("--temperature", type=_float, default=1.0, help="0 = greedy; [0, 2]")
    p.add_argument("--top-k", type=_int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=_float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--min-p", type=_float, default=0.0, help="drop tokens below min_p * max prob, [0, 1]")
    p.add_argument("--repetition-penalty", type=_float, default=1.0,
                   help="divide the logits of tokens seen in prompt or output (HF), (0, 10]")
    p.add_argument("--presence-penalty", type=_float, default=0.0,
                   help="subtract from the logits of tokens in the output (OpenAI), [-2, 2]")
    p.add_argument("--frequency-penalty", type=_float, default=0.0,
                   help="subtract per occurrence in the output (OpenAI), [-2, 2]")
    p.add_argument("--seed", type=_int, default=None,
                   help="random seed in [0, 2**63 - 1] (default: a fresh one each run)")
    if seed_stable:
        p.add_argument("--seed-stable", action=argparse.BooleanOptionalAction, default=None,
                       help="seed-stable sampling: the same --seed gives the same text with "
                            "speculation on or off and at any k (default: on when --seed is given)")
    if constraints:
        _add_constraint_args(p)
    p.add_argument("--max-tokens", type=_int, default=128, help="tokens to generate at most, >= 1")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")


def _add_constraint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="structured output: the text is JSON valid under this schema (a file, or the "
                        "schema itself); '{\"type\": \"object\"}' for any JSON object")
    p.add_argument("--regex", default=None, help="structured output: the text matches this regular expression")
    p.add_argument("--grammar", default=None, metavar="FILE",
                   help="structured output: the text follows this Lark grammar (llguidance's dialect)")


def build_parser() -> argparse.ArgumentParser:
    from specdec.distributed import add_pipeline_args
    from specdec.head import command as train_head_cmd
    from specdec.serve.server import add_serve_args
    from specdec.tools import commands

    ap = _Parser(prog="specdec", description="Lossless speculative decoding", formatter_class=_Help)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(parent, name, help):
        return parent.add_parser(name, help=help, description=help, formatter_class=_Help)

    g = command(sub, "generate", "generate text for one prompt")
    _add_model_args(g)
    _add_spec_args(g)
    _add_sampling_args(g)
    add_pipeline_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--stats", action="store_true", help="print speculative metrics after the text")
    g.add_argument("prompt")
    s = command(sub, "serve", "an OpenAI-compatible server (continuous batching)")
    _add_model_args(s)
    _add_spec_args(s)
    add_serve_args(s)
    m = command(sub, "models", "list or fetch the registry's models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    command(msub, "list", "the registry's models: size, quantisation, fetched or not")
    f = command(msub, "fetch", "download registry models and check their sizes and SHA-256")
    f.add_argument("name", nargs="+", help="one or more registry names (see `models list`)")
    v = command(sub, "verify", "statistical test: is the output still exactly the target's?")
    _add_model_args(v, context=False)  # verify sizes its own context (prefix + n)
    _add_spec_args(v)
    _add_sampling_args(v, seed_stable=False, constraints=False)  # --seed seeds the test's own sampling
    commands.add_verify_args(v)
    t = command(sub, "train-head", "train a draft head for a model on this machine (--proposer head)")
    _add_model_args(t, context=False)
    train_head_cmd.add_args(t)
    b = command(sub, "bench", "tokens/s of speculative settings vs plain decoding (and transformers)")
    _add_model_args(b)
    _add_spec_args(b)
    _add_sampling_args(b)
    commands.add_bench_args(b)
    return ap


def cmd_generate(a) -> int:
    from specdec.api import LLM
    from specdec.tools.commands import sampling_params, spec_config

    check_text("prompt", a.prompt)
    params = sampling_params(a)
    spec = spec_config(a)
    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    progress = (lambda s: print(s, file=sys.stderr, flush=True))
    model = a.model
    if a.pipeline_parallel != 1 or a.pipeline_layers is not None:
        from specdec.distributed import launch
        from specdec.errors import check_int

        check_int("pipeline_parallel", a.pipeline_parallel, 1, 64)
        if a.pipeline_parallel == 1:
            raise SpecdecError("pipeline_layers needs --pipeline-parallel N with N >= 2", "pipeline_layers")
        model = launch.launch(a.model, a.pipeline_parallel, a.dtype, a.device,
                              launch.parse_layers(a.pipeline_layers), a.threads, progress)
    llm = LLM(model, speculative_config=spec, dtype=a.dtype, device=a.device,
              max_model_len=a.max_model_len, max_batch=1, progress=progress)
    first: list[float] = []  # when the first text arrived (time to first token)

    def on_text(_id, delta):
        if not first:
            first.append(time.perf_counter())
        if not a.json:
            print(delta, end="", flush=True)
    t0 = time.perf_counter()
    out = llm.generate([a.prompt], params, raw=a.raw, on_text=on_text)[0]
    ttft = (first[0] if first else time.perf_counter()) - t0
    n, n_prompt = len(out.token_ids), len(out.prompt_token_ids)
    if a.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n},
            "timing": {"load_s": llm.load_s, "prefill_s": out.prefill_s, "ttft_s": ttft,
                       "prompt_tokens_per_s": n_prompt / out.prefill_s if out.prefill_s > 0 else 0.0,
                       "decode_s": out.decode_s,
                       "decode_tokens_per_s": n / out.decode_s if out.decode_s > 0 else 0.0},
            "stats": out.stats,
        }), flush=True)
    else:
        print(flush=True)
        if a.stats:
            print(json.dumps(out.stats), file=sys.stderr)
            print(f"[prompt {n_prompt} tokens in {out.prefill_s:.3f} s ({n_prompt / max(out.prefill_s, 1e-9):.0f} tok/s), "
                  f"time to first token {ttft:.3f} s, load {llm.load_s:.1f} s]", file=sys.stderr)
        print(f"[{n} tokens, {n / max(out.decode_s, 1e-9):.1f} tok/s, finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_models(a) -> int:
    from specdec.runtime import hub

    if a.models_cmd == "list":
        for name, spec in hub.REGISTRY.items():
            state = "fetched" if hub.is_fetched(name) else "not fetched"
            print(f"{name:22s} {spec.size / 1e6:7.0f} MB  {spec.quantisation:10s} {state:12s} {spec.description}")
        return 0
    from rich.console import Console
    from rich.progress import Progress

    for name in a.name:  # every name before any download: the error is then the only line
        if name not in hub.REGISTRY:
            raise SpecdecError(f"unknown model {name!r}; known: {', '.join(hub.REGISTRY)}", "name")
    for name in dict.fromkeys(a.name):
        with Progress(console=Console(stderr=True)) as prog:  # stdout carries only the paths
            task = prog.add_task(f"fetch {name}", total=None)
            path = hub.fetch(name, progress=lambda s: prog.update(task, description=s))
        print(path, flush=True)
    return 0


def _dispatch(a) -> int:
    from specdec.tools import commands  # (torch: most of start-up)

    _check_interrupt()
    if a.cmd == "models":
        return cmd_models(a)
    if a.cmd == "train-head":
        from specdec.head.command import cmd_train_head
        from specdec.loader import check_model_dtype

        check_model_dtype("dtype", a.dtype, a.model, "model")
        return cmd_train_head(a)
    commands.check_common(a)
    if a.cmd == "serve":
        from specdec.serve.server import cmd_serve

        _check_interrupt()
        return cmd_serve(a)
    return {"generate": cmd_generate, "verify": commands.cmd_verify, "bench": commands.cmd_bench}[a.cmd](a)


def _say(line: str) -> None:
    try:
        print(f"specdec: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr gone too: nothing left to tell
        pass


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush does not
    raise a second BrokenPipeError (the Python docs' recipe, signal module, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv=None) -> int:
    debug = os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")
    global _interrupted
    _interrupted = False
    own = threading.current_thread() is threading.main_thread()  # (signal handlers: main thread only)
    previous = signal.signal(signal.SIGINT, _on_sigint) if own else None
    try:
        return _main(argv, debug)
    finally:
        if own and previous is not None:
            signal.signal(signal.SIGINT, previous)


def _main(argv, debug: bool) -> int:
    try:
        a = build_parser().parse_args(argv)
        code = _dispatch(a)
        _check_interrupt()  # swallowed after the last check: the run did not end as asked
        return code
    except SpecdecError as e:
        if debug:
            import traceback
            traceback.print_exc()
        _say(f"error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as e:
        import traceback

        if debug:
            traceback.print_exc()
        msg = " ".join(str(e).split())[:200]
        _say(f"internal error: {type(e).__name__}{': ' + msg if msg else ''} "
             "(set SPECDEC_DEBUG=1 for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
