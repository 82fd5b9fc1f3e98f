"""The OpenAI request bodies as pydantic models, and their translation into sampling params.

Strict: a field of the wrong type, out of its range, unknown, or not supported here is refused
with a 400 that names it (`BadRequest`, or pydantic's validation error turned into one by
specdec.serve.app), never ignored or clamped. top_k, min_p, repetition_penalty, ignore_eos and
stop_token_ids are extensions (vLLM's names).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.config import MAX_LOGPROBS, SamplingParams
from specdec.errors import SpecdecError

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**63 - 1


class BadRequest(Exception):
    """A 400 for one field: `message` names the value and what is allowed."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise BadRequest(f"stop has {len(stop)} strings; allowed at most {MAX_STOP}", "stop")
        if any(not s for s in stop):
            raise BadRequest("stop strings must be non-empty", "stop")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab:
                raise BadRequest(f"stop_token_ids has {t}; allowed token ids are [0, {vocab})", "stop_token_ids")
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k, 0),
                min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                max_tokens=max_tokens, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos, seed=self.seed, logprobs=logprobs)
        except SpecdecError as e:
            raise BadRequest(str(e), str(e).split("=", 1)[0] if "=" in str(e) else None) from None

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        if self.echo:
            raise BadRequest("echo=true is not supported by this server", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of={self.best_of} is not supported; allowed: equal to n ({self.n})", "best_of")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def check_unsupported(self) -> None:
        if self.response_format is not None and self.response_format.type != "text":
            raise BadRequest(f"response_format type {self.response_format.type!r} is not supported yet; "
                             "allowed: 'text'", "response_format")
        if self.tools or self.tool_choice not in (None, "none"):
            raise BadRequest("tools are not supported by this server", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
