"""Python API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Everything a caller passes is checked here, before a model is loaded or a request queued, by the
same checks the CLI and the server use (specdec.config); a bad value is one SpecdecError naming
the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from specdec.config import DEFAULT_MAX_MODEL_LEN, MAX_BATCH, SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError, check_bool, check_int, check_text, show
from specdec.grammar import check_constraint
from specdec.loader import build_engine, check_context, check_model_dtype, load_models
from specdec.runtime.hub import DEFAULT_MODEL


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    prefill_s: float
    decode_s: float
    logprobs: list | None = None  # [specdec.request.TokenLogprob] per token, when params.logprobs is set
    cached_tokens: int = 0  # prompt tokens whose KV came from an earlier request (prefix reuse)


def from_fields(cls, value, name: str):
    """An instance of dataclass `cls` from itself or a dict of its fields (validated either way:
    rebuilding re-runs __post_init__, so a field changed after construction is checked too)."""
    if isinstance(value, cls):
        return dataclasses.replace(value)
    if not isinstance(value, Mapping):
        raise SpecdecError(f"{name}={show(value)} is not a {cls.__name__}; allowed: a {cls.__name__}, "
                           "a dict of its fields, or None", name)
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise SpecdecError(f"{name} has an unknown field {show(unknown[0])}; allowed: {', '.join(allowed)}",
                           name)
    return cls(**value)


def context_length(models, max_model_len: int | None) -> int:
    """The context to run at: max_model_len, which must fit the models' own context (an error,
    not a silent cap), or by default DEFAULT_MAX_MODEL_LEN capped at the models' context."""
    ctx = models.context_length()
    if max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, ctx)
    return check_context(max_model_len, ctx, models.draft is not None)


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, speculative_config: dict | SpeculativeConfig | None = None,
                 dtype: str = "auto", device: str | None = None, max_model_len: int | None = None,
                 max_batch: int = 8, progress=None):
        """dtype: "auto" runs a GGUF at its own quantisation and an HF directory in fp32.
        max_model_len: at most the model's context (default: 4096, or the model's if smaller)."""
        t0 = time.perf_counter()
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, (str, tuple)) or not model:
            raise SpecdecError(f"model={show(model)} is not a model; allowed: a registry name, a .gguf "
                               "file or a Hugging Face directory", "model")
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, 2, None)
        check_int("max_batch", max_batch, 1, MAX_BATCH)
        check_model_dtype("dtype", dtype, model, "model")
        spec = None if speculative_config is None else from_fields(
            SpeculativeConfig, speculative_config, "speculative_config")
        # k = 0 is plain decoding: no draft model to load
        draft = spec.draft if spec is not None and spec.num_draft_tokens != 0 and spec.proposer != "ngram" else None
        if spec is not None:
            spec.check_unused()
            if draft is not None:
                check_model_dtype("draft_dtype", spec.draft_dtype, draft, "draft")
        self.spec = spec
        self.models = load_models(model, draft, dtype, spec.draft_dtype if spec else "auto", device, progress,
                                  max_model_len)
        self.model, self.tokenizer = self.models.target, self.models.tokenizer
        self.model_name = model
        self.max_model_len = context_length(self.models, max_model_len)
        self.engine = build_engine(self.models, spec, max_model_len=self.max_model_len, max_batch=max_batch)
        self.load_s = time.perf_counter() - t0

    def encode(self, prompt: str | bytes | list[int], raw: bool = False) -> list[int]:
        """Token ids of one prompt: text (the chat template applied unless raw), UTF-8 bytes, or
        token ids (each in [0, vocabulary))."""
        if isinstance(prompt, bytes):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SpecdecError(f"prompt is not valid UTF-8 (byte 0x{prompt[e.start]:02x} at offset "
                                   f"{e.start}); allowed: UTF-8 text", "prompt") from None
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise SpecdecError("prompt is empty; it needs at least 1 token", "prompt")
            V = self.models.vocab
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                    raise SpecdecError(f"prompt has token id {show(t)}; allowed: integers in [0, {V - 1}]",
                                       "prompt")
            return list(prompt)
        if not isinstance(prompt, str):
            raise SpecdecError(f"prompt={show(prompt)} is not a prompt; allowed: a string, UTF-8 bytes or "
                               "a list of token ids", "prompt")
        return self.tokenizer.encode_prompt(check_text("prompt", prompt), raw=raw)

    def generate(self, prompts, sampling_params: SamplingParams | dict | None = None, raw: bool = False,
                 on_text=None) -> list[RequestOutput]:
        """prompts: one prompt or a list of them (see `encode`); sampling_params: a
        SamplingParams, a dict of its fields, or None for the defaults."""
        if isinstance(prompts, (str, bytes)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise SpecdecError(f"prompts={show(prompts)} is not a prompt or a list of prompts; allowed: "
                               "str, bytes, list[int], or a list of those", "prompts")
        if not prompts:
            raise SpecdecError("prompts is an empty list; it needs at least 1 prompt", "prompts")
        params = SamplingParams() if sampling_params is None else from_fields(
            SamplingParams, sampling_params, "sampling_params")
        params.check_vocab(self.models.vocab)
        check_constraint(params)
        check_bool("raw", raw)
        if on_text is not None and not callable(on_text):
            raise SpecdecError(f"on_text={show(on_text)} is not callable; allowed: a function(id, text) "
                               "or None", "on_text")
        ids = [self.encode(p, raw) for p in prompts]
        cb = None if on_text is None else (lambda r, delta: on_text(r.id, delta))
        reqs = self.engine.generate(ids, params, on_event=cb)
        return [RequestOutput(prompt_token_ids=r.prompt, text=r.text, token_ids=r.output,
                              finish_reason=r.finish_reason, stats=r.stats.to_dict(),
                              prefill_s=r.prefill_time, decode_s=r.decode_time,
                              logprobs=r.logprobs if r.params.logprobs is not None else None,
                              cached_tokens=r.cached_tokens) for r in reqs]
