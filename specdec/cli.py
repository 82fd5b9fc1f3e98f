"""Command line: `specdec generate | serve | models list | models fetch | verify | bench`.

Bad input is one line on stderr naming the value and the allowed range, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from rich.progress import Progress

from specdec.api import LLM
from specdec.config import DTYPES, SpeculativeConfig
from specdec.errors import SpecdecError
from specdec.runtime import hub
from specdec.runtime.hub import DEFAULT_MODEL
from specdec.serve.server import add_serve_args, cmd_serve
from specdec.tools import commands
from specdec.tools.commands import sampling_params


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name, GGUF file or HF directory (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="target weight storage: native runs a GGUF's own quantised blocks with int8 "
                        "activations (as llama.cpp does), fp32 dequantises them, bf16 rounds the "
                        "weights, q4_0 requantises the blocks to Q4_0; each defines the model whose "
                        "distribution is reproduced (default: auto = native for a GGUF, fp32 for an "
                        "HF directory)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--max-model-len", type=int, default=4096, help="context length cap (default: 4096)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, help="draft model (name, GGUF or HF dir) for speculation")
    p.add_argument("--proposer", default=None,
                   help="draft | ngram | composite (n-gram lookup first, the draft model when it "
                        "finds nothing). Default: draft when --draft is given; no speculation otherwise")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix n-gram to match (default 1)")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix n-gram to match (default 4)")
    p.add_argument("--num-draft-tokens", default="auto",
                   help="draft tokens per round k in [0, 32], or 'auto': each round picks k in "
                        "[0, --max-draft-tokens] from measured acceptance and costs (default auto)")
    p.add_argument("--max-draft-tokens", type=int, default=8, help="k_max for auto (default 8)")
    p.add_argument("--draft-sampling", default="probabilistic", choices=["probabilistic", "greedy"],
                   help="draft samples from q (probabilistic) or takes its argmax (one-hot q)")
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                   help="draft weight storage (q4_0: its GGUF blocks requantised to Q4_0, the "
                        "fewest bytes per step); never changes the output distribution, only "
                        "acceptance and speed (default: auto, as --dtype)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob, [0, 1]")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt")
    _add_model_args(g)
    _add_spec_args(g)
    _add_sampling_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--stats", action="store_true", help="print speculative metrics after the text")
    g.add_argument("prompt")
    s = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching)")
    _add_model_args(s)
    _add_spec_args(s)
    add_serve_args(s)
    m = sub.add_parser("models", help="list or fetch the registry's models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list")
    f = msub.add_parser("fetch")
    f.add_argument("name")
    v = sub.add_parser("verify", help="statistical test: is the output still exactly the target's?")
    _add_model_args(v)
    _add_spec_args(v)
    _add_sampling_args(v)
    commands.add_verify_args(v)
    b = sub.add_parser("bench", help="tokens/s of speculative settings vs plain decoding (and transformers)")
    _add_model_args(b)
    _add_spec_args(b)
    _add_sampling_args(b)
    commands.add_bench_args(b)
    return ap


def cmd_generate(a) -> int:
    if a.threads is not None:
        if a.threads < 1:
            raise SpecdecError(f"threads={a.threads} is out of range; allowed [1, inf)")
        torch.set_num_threads(a.threads)
    if a.max_model_len < 2:
        raise SpecdecError(f"max_model_len={a.max_model_len} is out of range; allowed [2, inf)")
    if not a.prompt:
        raise SpecdecError("prompt is empty; it needs at least 1 character")
    params = sampling_params(a)
    spec = None
    if a.draft is not None or a.proposer is not None:
        spec = SpeculativeConfig(draft=a.draft, num_draft_tokens=a.num_draft_tokens,
                                 max_draft_tokens=a.max_draft_tokens,
                                 draft_sampling=a.draft_sampling, draft_dtype=a.draft_dtype,
                                 proposer=a.proposer, ngram_min=a.ngram_min, ngram_max=a.ngram_max)
    progress = (lambda s: print(s, file=sys.stderr, flush=True))
    llm = LLM(a.model, speculative_config=spec, dtype=a.dtype, device=a.device,
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
        }))
    else:
        print()
        if a.stats:
            print(json.dumps(out.stats), file=sys.stderr)
            print(f"[prompt {n_prompt} tokens in {out.prefill_s:.3f} s ({n_prompt / max(out.prefill_s, 1e-9):.0f} tok/s), "
                  f"time to first token {ttft:.3f} s, load {llm.load_s:.1f} s]", file=sys.stderr)
        print(f"[{n} tokens, {n / max(out.decode_s, 1e-9):.1f} tok/s, finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_models(a) -> int:
    if a.models_cmd == "list":
        for name, spec in hub.REGISTRY.items():
            state = "fetched" if hub.is_fetched(name) else "not fetched"
            print(f"{name:22s} {spec.size / 1e6:7.0f} MB  {spec.quantisation:10s} {state:12s} {spec.description}")
        return 0
    with Progress() as prog:
        task = prog.add_task(f"fetch {a.name}", total=None)
        path = hub.fetch(a.name, progress=lambda s: prog.update(task, description=s))
    print(path)
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "models": cmd_models, "serve": cmd_serve,
                "verify": commands.cmd_verify, "bench": commands.cmd_bench}[a.cmd](a)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
