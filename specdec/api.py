"""Python API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass

import torch

from specdec.config import DTYPES, SamplingParams, SpeculativeConfig
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.hub import DEFAULT_MODEL, REGISTRY, model_path, resolve_model
from specdec.model import Transformer
from specdec.tokenizer import Tokenizer
from specdec.weights import load_hf_dir, read_gguf_native

# GGUF block types with more bits per weight than Q4_0's 4.5 (Q8_0 8.5, Q6_K 6.56, Q5_0 5.5,
# Q4_1 5.0): what dtype q4_0 requantises (~0.8x the time per 0.5B Qwen decode step here)
REQUANTISED = ("Q8_0", "Q6_K", "Q5_0", "Q4_1")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(name: str, dtype: str = "fp32", device: str | None = None, progress=None):
    """(Transformer, Tokenizer) from a registry name, a GGUF file or an HF directory."""
    if dtype not in DTYPES:
        raise SpecdecError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise SpecdecError(f"device={device!r}; allowed: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device='cuda' but no CUDA device is available; use --device cpu")
    path = resolve_model(name, progress)
    if dtype in ("native", "q4_0"):  # weights straight from the GGUF file, still quantised
        gguf = model_path(name) if name in REGISTRY else Path(name).expanduser()
        if gguf.suffix.lower() != ".gguf":
            raise SpecdecError(f"dtype={dtype!r} needs a GGUF model (registry name or .gguf file), got {name!r}")
        args, state = read_gguf_native(gguf)
        if dtype == "q4_0":
            state = _requantised(state, args.tie_embeddings)
        dtype = "native"
    else:
        args, state = load_hf_dir(path)
    tok = Tokenizer.load(path)
    return Transformer(args, state, dtype=dtype, device=device), tok


def _requantised(state: dict, tied: bool) -> dict:
    """Every block-quantised matrix the kernel streams (not an untied embedding: only its
    looked-up rows are read; not fp16/fp32 matrices) requantised to Q4_0 where its own type
    has more bits per weight."""
    from specdec.kernels.quant import QuantTensor, requantise

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
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    prefill_s: float
    decode_s: float


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, speculative_config: dict | SpeculativeConfig | None = None,
                 dtype: str = "fp32", device: str | None = None, max_model_len: int = 4096,
                 max_batch: int = 8, progress=None):
        t0 = time.perf_counter()
        self.model, self.tokenizer = load_model(model, dtype, device, progress)
        self.model_name = model
        self.spec = None
        proposer = None
        vocab = min(self.model.args.vocab_size, self.tokenizer.vocab_size)
        max_len = max_model_len  # the context: also capped by a draft model's own
        if speculative_config is not None:
            spec = speculative_config if isinstance(speculative_config, SpeculativeConfig) \
                else SpeculativeConfig(**speculative_config)
            self.spec = spec
            if spec.num_draft_tokens != 0:  # k = 0 is plain decoding: nothing to load
                from specdec.harness import make_proposer

                draft = None
                if spec.proposer in ("draft", "composite"):
                    draft, dtok = load_model(spec.draft, spec.draft_dtype, device, progress)
                    vocab = check_draft_compatible(self.tokenizer, dtok, model, spec.draft)
                    vocab = min(vocab, draft.args.vocab_size, self.model.args.vocab_size)
                    max_len = min(max_model_len, self.model.args.max_seq_len, draft.args.max_seq_len)
                proposer = make_proposer(spec.proposer, draft, vocab, max_len, spec.draft_sampling,
                                         spec.ngram_min, spec.ngram_max)
        self.engine = Engine(self.model, self.tokenizer, proposer,
                             self.spec.num_draft_tokens if self.spec else 0,
                             max_batch=max_batch, max_seq_len=max_len, vocab_size=vocab,
                             max_draft_tokens=self.spec.max_draft_tokens if self.spec else 0)
        self.load_s = time.perf_counter() - t0

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not prompt:
            raise SpecdecError("prompt is empty; it needs at least 1 character")
        return self.tokenizer.encode_prompt(prompt, raw=raw)

    def generate(self, prompts, sampling_params: SamplingParams | None = None, raw: bool = False,
                 on_text=None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        ids = [self.encode(p, raw) for p in prompts]
        cb = None if on_text is None else (lambda r, delta: on_text(r.id, delta))
        reqs = self.engine.generate(ids, params, on_event=cb)
        return [RequestOutput(prompt_token_ids=r.prompt, text=r.text, token_ids=r.output,
                              finish_reason=r.finish_reason, stats=r.stats.to_dict(),
                              prefill_s=r.prefill_time, decode_s=r.decode_time) for r in reqs]
