"""`specdec train-head`'s command line: its flags, each checked (name and allowed range) before
anything is loaded, the taps resolved on the model, and the run (specdec.head.train) reported."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

from specdec.config import MAX_SEED
from specdec.errors import SpecdecError, check_float, check_int
from specdec.errors import lenient_float as _float
from specdec.errors import lenient_int as _int
from specdec.head.train import STEP_WEIGHTS, TrainSettings, taps_text, train_head
from specdec.loader import load_model
from specdec.runtime.hub import REGISTRY


def add_args(p: argparse.ArgumentParser) -> None:
    d = TrainSettings(out=Path("."))
    p.add_argument("--out", required=True, metavar="DIR",
                   help="where the head is written (head.safetensors + head.json); DIR/work keeps the "
                        "harvested data and checkpoints, so running the same command again resumes")
    p.add_argument("--minutes", type=_float, default=d.minutes, help="budget for the whole run, (0, 1440]")
    p.add_argument("--seed", type=_int, default=d.seed, help="prompt order, sampling and initialisation")
    p.add_argument("--harvest-tokens", type=_int, default=d.harvest_tokens,
                   help="training tokens the target writes (prompts + answers), >= 1000")
    p.add_argument("--user-requests", type=_int, default=d.user_requests,
                   help="chat prompts the target first writes itself (samples from a user turn's start; "
                        "0: none), >= 0")
    p.add_argument("--harvest-share", type=_float, default=d.harvest_share,
                   help="most of the budget the harvest may take, (0, 1)")
    p.add_argument("--corpus-tokens", type=_int, default=d.corpus_tokens,
                   help="tokens of library text the target reads (teacher forcing, after the harvest), >= 0")
    p.add_argument("--corpus-share", type=_float, default=d.corpus_share,
                   help="most of the budget the teacher forcing may take, [0, 1)")
    p.add_argument("--epochs", type=_float, default=d.epochs, help="passes over the harvested data, > 0")
    p.add_argument("--draft-vocab", type=_int, default=d.draft_vocab,
                   help="tokens the head can draft (the most frequent in the data), [256, V]")
    p.add_argument("--intermediate", type=_int, default=768, help="the head's MLP width, [16, 65536]")
    p.add_argument("--steps", type=_int, default=d.steps, help="draft steps unrolled in training, [1, 5]")
    p.add_argument("--lr", type=_float, default=d.lr, help="peak learning rate (AdamW, cosine decay), (0, 1]")
    p.add_argument("--batch-pairs", type=_int, default=d.tokens_per_batch,
                   help="training pairs per optimizer step, [64, 65536]")
    p.add_argument("--warmup", type=_int, default=d.warmup, help="optimizer steps of linear warm-up, [1, 100000]")
    p.add_argument("--max-new", type=_int, default=d.max_new, help="answer tokens per training prompt, [16, 4096]")
    p.add_argument("--batch", type=_int, default=d.batch, help="harvest rows decoding together, [1, 64]")
    p.add_argument("--init-layer", default="none", metavar="none|last",
                   help="last: the head's layer starts as a copy of the target's last layer "
                        "(needs --intermediate equal to the target's MLP width)")
    p.add_argument("--taps", default="none", metavar="none|auto|I,J,...",
                   help="target layers whose residual streams the head reads beside the final hidden "
                        "state (EAGLE-3's fused features): auto = layers 2, n/2 and n-3 of n; each in [0, n-2]")


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SpecdecError(f"{name}={value!r}; allowed: {', '.join(allowed)}", name)
    return value


def parse_taps(text: str):
    """--taps: "none" -> (), "auto" -> "auto" (resolved on the model), else ascending distinct
    layer indices >= 0."""
    text = str(text).strip().lower()
    if text in ("none", ""):
        return ()
    if text == "auto":
        return "auto"
    try:
        taps = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecdecError(f"taps={text!r} is not none, auto or comma-separated layer indices (e.g. 2,15,27)",
                           "taps") from None
    if any(t < 0 for t in taps) or list(taps) != sorted(set(taps)):
        raise SpecdecError(f"taps={text!r}: layer indices must be >= 0, distinct and ascending", "taps")
    return taps


def resolve_taps(taps, n_layers: int) -> tuple[int, ...]:
    """The layers for a target with n_layers: "auto" is EAGLE-3's low, middle and high layer."""
    if taps == "auto":
        return tuple(sorted({t for t in (2, n_layers // 2, n_layers - 3) if 0 <= t <= n_layers - 2}))
    if taps and taps[-1] > n_layers - 2:
        raise SpecdecError(f"taps={taps_text(taps)}: the model has {n_layers} layers; allowed layer indices "
                           f"[0, {n_layers - 2}] (the last layer's stream is the final hidden state, read anyway)",
                           "taps")
    return tuple(taps)


def settings_from(a) -> TrainSettings:
    """Every flag checked (name and allowed range) before anything is loaded."""
    st = TrainSettings(
        out=Path(a.out).expanduser(),
        minutes=check_float("minutes", a.minutes, 0.0, 1440.0, lo_open=True),
        seed=check_int("seed", a.seed, 0, MAX_SEED),
        harvest_tokens=check_int("harvest_tokens", a.harvest_tokens, 1000, None),
        user_requests=check_int("user_requests", a.user_requests, 0, None),
        harvest_share=check_float("harvest_share", a.harvest_share, 0.0, 1.0, lo_open=True, hi_open=True),
        corpus_tokens=check_int("corpus_tokens", a.corpus_tokens, 0, None),
        corpus_share=check_float("corpus_share", a.corpus_share, 0.0, 1.0, hi_open=True),
        epochs=check_float("epochs", a.epochs, 0.0, 1000.0, lo_open=True),
        draft_vocab=check_int("draft_vocab", a.draft_vocab, 256, None),
        intermediate=check_int("intermediate", a.intermediate, 16, 65536),
        steps=check_int("steps", a.steps, 1, len(STEP_WEIGHTS)),
        max_new=check_int("max_new", a.max_new, 16, 4096),
        batch=check_int("batch", a.batch, 1, 64),
        lr=check_float("lr", a.lr, 0.0, 1.0, lo_open=True),
        tokens_per_batch=check_int("batch_pairs", a.batch_pairs, 64, 65536),
        warmup=check_int("warmup", a.warmup, 1, 100000),
        taps=parse_taps(getattr(a, "taps", "none")),
        init_layer=check_choice("init_layer", getattr(a, "init_layer", "none"), ("none", "last")))
    if st.harvest_share + st.corpus_share >= 1:  # training needs the rest of the budget
        raise SpecdecError(f"corpus_share={st.corpus_share} leaves no time to train after harvest_share="
                           f"{st.harvest_share}; allowed [0, {1 - st.harvest_share:.2f})", "corpus_share")
    return st


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    return h.hexdigest()


def cmd_train_head(a) -> int:
    st = settings_from(a)
    if a.threads is not None:
        torch.set_num_threads(check_int("threads", a.threads, 1, None))
    if (st.out / "work" / "state.json").is_file() and json.loads(
            (st.out / "work" / "state.json").read_text()).get("finished"):
        raise SpecdecError(f"{st.out} already holds a finished head; choose another --out, or delete it", "out")
    try:
        st.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecdecError(f"cannot create --out {st.out}: {e.strerror}", "out") from None
    model, tok = load_model(a.model, a.dtype, a.device)
    st = dataclasses.replace(st, taps=resolve_taps(st.taps, model.args.n_layers))
    if tok is None:
        raise SpecdecError("train-head needs the model's tokenizer", "model")
    if st.init_layer == "last" and st.intermediate != model.args.intermediate_size:
        raise SpecdecError(f"init_layer=last copies the target's last layer, so the head's MLP must be as wide: "
                           f"intermediate={st.intermediate}; allowed: {model.args.intermediate_size}", "intermediate")
    if st.draft_vocab > model.args.vocab_size:
        raise SpecdecError(f"draft_vocab={st.draft_vocab} exceeds the model's vocabulary; allowed: "
                           f"[256, {model.args.vocab_size}]", "draft_vocab")
    if a.model in REGISTRY:
        sha = REGISTRY[a.model].sha256
    else:
        path = Path(a.model).expanduser()  # a GGUF file has a sha256; an HF directory none
        sha = _file_sha256(path) if path.is_file() else ""
    console = Console(stderr=True)
    t0 = time.monotonic()
    cfg = train_head(model, tok, str(a.model), sha, st, console=console)
    for name, r in cfg["held_out"].items():
        if r.get("rounds"):
            per = ", ".join(f"{x:.2f}" for x in r["acceptance_at"])
            console.print(f"held-out {name}: acceptance per draft position [{per}]; tokens per round "
                          + ", ".join(f"k={k}: {v:.2f}" for k, v in r["tokens_per_round"].items())
                          + "; next token in the first draft's top w: "
                          + ", ".join(f"w={w}: {v:.2f}" for w, v in r.get("first_in_top", {}).items()))
    console.print(f"head written to {st.out} ({sum(p.stat().st_size for p in st.out.glob('head.*')) / 1e6:.1f} MB)")
    print(json.dumps({"command": "train-head", "model": str(a.model), "out": str(st.out),
                      "seconds": round(time.monotonic() - t0, 1), **{k: cfg[k] for k in ("train", "held_out")}}))
    sys.stdout.flush()
    return 0
