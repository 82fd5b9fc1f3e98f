"""Python API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError
from specdec.loader import build_engine, load_models
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


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, speculative_config: dict | SpeculativeConfig | None = None,
                 dtype: str = "auto", device: str | None = None, max_model_len: int = 4096,
                 max_batch: int = 8, progress=None):
        """dtype: "auto" runs a GGUF at its own quantisation and an HF directory in fp32."""
        t0 = time.perf_counter()
        spec = speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig(**spec)
        self.spec = spec
        # k = 0 is plain decoding: no draft model to load
        draft = spec.draft if spec is not None and spec.num_draft_tokens != 0 and spec.proposer != "ngram" else None
        self.models = load_models(model, draft, dtype, spec.draft_dtype if spec else "auto", device, progress)
        self.model, self.tokenizer = self.models.target, self.models.tokenizer
        self.model_name = model
        self.engine = build_engine(self.models, spec, max_model_len=max_model_len, max_batch=max_batch)
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
                              prefill_s=r.prefill_time, decode_s=r.decode_time,
                              logprobs=r.logprobs if r.params.logprobs is not None else None,
                              cached_tokens=r.cached_tokens) for r in reqs]
