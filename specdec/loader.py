"""One way to build an engine: models + tokenizer + draft compatibility + context cap + proposer.

Used by the faces (specdec.api, specdec.cli), the tools (bench, verify), the tests and the
benchmarks. A model argument is a registry name, a GGUF file, an HF directory, or an already loaded
(Transformer, Tokenizer) pair (tests pass tiny random models this way). Weight storage `dtype`:
"auto" (the default) runs a GGUF at its own quantisation ("native", as llama.cpp does) and an HF
directory in fp32; see specdec.config.DTYPES for the rest.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import DEFAULT_MAX_DRAFT_TOKENS, DTYPES, ModelArgs, SpeculativeConfig
from specdec.engine import Engine
from specdec.errors import SpecdecError, check_choice, check_int
from specdec.head import load_head, shipped_head
from specdec.proposers import CompositeProposer, DraftModelProposer, NgramProposer
from specdec.proposers.head import HeadProposer
from specdec.runtime import prepared
from specdec.runtime.hub import REGISTRY, model_path, resolve_model
from specdec.runtime.kernels.quant import QuantTensor, requantise
from specdec.runtime.model import Part, Transformer
from specdec.runtime.tokenizer import Tokenizer
from specdec.runtime.weights import load_hf_dir, read_config, read_gguf_native

# GGUF block types with more bits per weight than Q4_0's 4.5 (Q8_0 8.5, Q6_K 6.56, Q5_0 5.5,
# Q4_1 5.0): what dtype q4_0 requantises (~0.8x the time per 0.5B Qwen decode step here)
REQUANTISED = ("Q8_0", "Q6_K", "Q5_0", "Q4_1")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _gguf_path(name: str) -> Path | None:
    """The GGUF file behind a registry name or a .gguf path; None for an HF directory."""
    if name in REGISTRY:
        return model_path(name)
    p = Path(name).expanduser()
    return p if p.suffix.lower() == ".gguf" else None


def load_model(name: str, dtype: str = "auto", device: str | None = None, progress=None,
               part: Part | None = None, cache: bool = True):
    """(Transformer, Tokenizer) from a registry name, a GGUF file or an HF directory; with
    `part`, only that part of the model, reading only its tensors (a pipeline stage; no
    tokenizer, None, for a part without the embedding). cache: on the CPU, map the weights
    prepared by an earlier load (specdec.runtime.prepared), or prepare them and write them there
    for the next; False: prepare them in memory, as before the cache existed."""
    if dtype not in DTYPES:
        raise SpecdecError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise SpecdecError(f"device={device!r}; allowed: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device='cuda' but no CUDA device is available; use --device cpu")
    gguf = _gguf_path(name)
    if dtype == "auto":
        dtype = "native" if gguf is not None else "fp32"
    native = dtype in ("native", "q4_0")  # weights straight from the GGUF file, still quantised
    if native and gguf is None:
        resolve_model(name, progress)  # an unknown name or missing file is its own error
        raise SpecdecError(f"dtype={dtype!r} needs a GGUF model (registry name or .gguf file), got {name!r}")
    # the tokenizer (and for fp32 / bf16 the converted weights) from the checkpoint's directory;
    # a GGUF run natively needs only its tokenizer converted, never its weights
    path = resolve_model(name, progress, weights=not native)
    entry = prepared.entry_path(gguf if native else path, dtype, part) if cache and device == "cpu" else None
    model = prepared.load(entry) if entry is not None else None
    if model is None:
        if progress and entry is not None:
            progress(f"preparing {name} ({dtype}) for this CPU's kernels into {entry} (once)")
        model = _prepare(gguf if native else path, dtype, device, part)
        if entry is not None and prepared.save(entry, model):
            mapped = prepared.load(entry)  # the mapping: each weight held once, from now on
            if mapped is not None:
                model = mapped
                release_freed_memory()  # the packed copy just dropped
    tok = Tokenizer.load(path) if part is None or part.embed else None  # a later stage: ids only
    return model, tok


def release_freed_memory() -> None:
    """Hand memory the process has freed back to the OS where the C library keeps it (glibc's
    heap holds the freed blocks of a dropped in-memory model, ~the model's size, beside the
    mapping that replaced it); elsewhere nothing to do."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _prepare(source: Path, dtype: str, device: str, part: Part | None) -> Transformer:
    """The model read from its checkpoint and packed for the kernels, in memory."""
    if dtype in ("native", "q4_0"):
        args, state = read_gguf_native(source, keep=part.needs if part is not None else None)
        if dtype == "q4_0":
            state = _requantised(state, args.tie_embeddings)
        dtype = "native"
    else:
        args, state = load_hf_dir(source)
    return Transformer(args, state, dtype=dtype, device=device, part=part)


def _requantised(state: dict, tied: bool) -> dict:
    """Every block-quantised matrix the kernel streams (not an untied embedding: only its
    looked-up rows are read; not fp16/fp32 matrices) requantised to Q4_0 where its own type
    has more bits per weight."""
    return {n: requantise(w, "Q4_0") if isinstance(w, QuantTensor) and w.qtype in REQUANTISED
            and (tied or n != "model.embed_tokens.weight") else w for n, w in state.items()}


def check_draft_compatible(target_tok: Tokenizer, draft_tok: Tokenizer, t_name: str, d_name: str) -> int:
    """The shared real vocabulary size; refuse drafts whose tokens differ from the target's."""
    tv, dv = target_tok.real_vocab, draft_tok.real_vocab  # padding entries may differ
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise SpecdecError(
            f"draft {d_name!r} has an incompatible tokenizer: vocabulary of {len(dv)} tokens vs the "
            f"target {t_name!r}'s {len(tv)} ({diff} token/id pairs differ); the draft must use the "
            "target's tokenizer")
    return target_tok.vocab_size


@dataclass
class Models:
    target: object  # Transformer (or anything with its forward / new_cache / args)
    tokenizer: object | None  # Tokenizer (None: token ids only, as in tests on random models)
    draft: object | None  # the draft model, when one was asked for
    vocab: int  # the real vocabulary shared by target and draft
    name: str
    draft_name: str | None
    heads: dict = dataclasses.field(default_factory=dict)  # head directory -> loaded DraftHead

    def context_length(self, max_model_len: int | None = None) -> int:
        """The context a request may reach: the cap asked for, within both models' own."""
        limits = [self.target.args.max_seq_len]
        if self.draft is not None:
            limits.append(self.draft.args.max_seq_len)
        if max_model_len is not None:
            limits.append(max_model_len)
        return min(limits)


def _load(model, dtype, device, progress):
    return model if isinstance(model, tuple) else load_model(model, dtype, device, progress)


def model_args(model, progress=None) -> ModelArgs:
    """The model's shape from its config, before any weight is read (a loaded pair: its own)."""
    if isinstance(model, tuple):
        return model[0].args
    return read_config(resolve_model(model, progress, weights=False))


def check_context(max_model_len: int, ctx: int, with_draft: bool) -> int:
    """max_model_len must fit the models' own context: an error, never a silent cap."""
    check_int("max_model_len", max_model_len, 2, None)
    if max_model_len > ctx:
        whose = "the target's and the draft's" if with_draft else "the model's"
        raise SpecdecError(f"max_model_len={max_model_len} is out of range; allowed [2, {ctx}] ({whose} "
                           "context)", "max_model_len")
    return max_model_len


def load_models(model, draft=None, dtype="auto", draft_dtype="auto", device=None, progress=None,
                max_model_len: int | None = None) -> Models:
    """max_model_len: checked against the models' configs before any weight is read (a bad
    value fails at once, not after a model has been loaded or prepared)."""
    if max_model_len is not None:
        ctx = min(model_args(m, progress).max_seq_len for m in (model, draft) if m is not None)
        check_context(max_model_len, ctx, draft is not None)
    target, tok = _load(model, dtype, device, progress)
    vocab = min(target.args.vocab_size, tok.vocab_size) if tok is not None else target.args.vocab_size
    dm = None
    if draft is not None:
        dm, dtok = _load(draft, draft_dtype, device, progress)
        if tok is not None:
            vocab = min(check_draft_compatible(tok, dtok, str(model), str(draft)), vocab)
        vocab = min(vocab, dm.args.vocab_size)
    return Models(target, tok, dm, vocab, str(model) if isinstance(model, str) else "model",
                  None if draft is None else (str(draft) if isinstance(draft, str) else "draft"))


def make_proposer(spec: SpeculativeConfig, models: Models, max_seq_len: int):
    """A fresh proposer (proposers keep per-request state: one per engine)."""
    if models.draft is None and (spec.proposer == "draft" or spec.draft is not None):
        raise SpecdecError(f"proposer={spec.proposer!r} needs a draft model (--draft MODEL)")
    if spec.proposer == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    # the part that runs a model: the draft head, or the draft model
    if drafts_with_head(spec, models):
        drafter = HeadProposer(head_for(spec, models), models.vocab, max_seq_len, spec.draft_sampling)
    else:
        drafter = DraftModelProposer(models.draft, models.vocab, max_seq_len, spec.draft_sampling)
    if spec.proposer != "composite":
        return drafter
    return CompositeProposer([NgramProposer(spec.ngram_min, spec.ngram_max), drafter])


def drafts_with_head(spec: SpeculativeConfig, models: Models) -> bool:
    """Whether a draft head drafts: proposer "head", or "composite" without a draft model."""
    return spec.proposer == "head" or (spec.proposer == "composite" and models.draft is None)


def head_path(spec: SpeculativeConfig, model: str) -> str:
    """The head a head-drafting spec uses: its own, or the one shipped for `model` (an error
    naming both ways out where none is)."""
    if spec.head is not None:
        return spec.head
    try:
        return shipped_head(model)
    except SpecdecError as e:
        if spec.proposer != "composite":
            raise
        raise SpecdecError(f"proposer='composite' needs a draft model (--draft MODEL) or a draft head "
                           f"(--head DIR): {e}", "draft") from None


def head_for(spec: SpeculativeConfig, models: Models):
    """The head spec asks for (or the target's shipped one), loaded once per Models."""
    path = head_path(spec, models.name)
    if path not in models.heads:
        sha = REGISTRY[models.name].sha256 if models.name in REGISTRY else None
        models.heads[path] = load_head(path, models.target, sha)
    return models.heads[path]


def build_engine(models: Models, spec: SpeculativeConfig | None = None, max_model_len: int | None = None,
                 max_batch: int = 1, k_cost=None) -> Engine:
    """An engine on `models`: plain decoding without `spec` (or with k = 0), else speculative
    with spec's proposer and k (an int, or "auto")."""
    max_len = models.context_length(max_model_len)
    speculative = spec is not None and spec.num_draft_tokens != 0
    proposer = make_proposer(spec, models, max_len) if speculative else None
    return Engine(models.target, models.tokenizer, proposer,
                  num_draft_tokens=spec.num_draft_tokens if speculative else 0,
                  max_batch=max_batch, max_seq_len=max_len, vocab_size=models.vocab,
                  max_draft_tokens=spec.max_draft_tokens if speculative else DEFAULT_MAX_DRAFT_TOKENS,
                  k_cost=k_cost, draft_tree=spec.draft_tree if speculative else None)


def with_models(models: Models, target=None, draft=None) -> Models:
    """The same models with the target and / or draft replaced (a memo or test wrapper)."""
    return dataclasses.replace(models, target=target or models.target, draft=draft or models.draft)


def check_model_dtype(field: str, dtype, model, model_field: str) -> None:
    """dtype (DTYPES) for `model`: native and q4_0 need a GGUF, so an existing Hugging Face
    directory is refused here, naming the flag it came from (--dtype or --draft-dtype)."""
    check_choice(field, dtype, DTYPES)
    if dtype not in ("native", "q4_0") or not isinstance(model, (str, os.PathLike)):
        return
    name = os.fspath(model)
    if name not in REGISTRY and Path(name).suffix.lower() != ".gguf" and Path(name).expanduser().is_dir():
        raise SpecdecError(f"{field}={dtype!r} needs a GGUF file, but {model_field} {name!r} is a Hugging "
                           "Face directory; allowed for it: auto, fp32, bf16", field)
