"""The OpenAI request bodies as pydantic models, and their translation into sampling params.

Strict: a field of the wrong type, out of its range, unknown, or not supported here is refused
with a 400 that names it (`BadRequest`, or pydantic's validation error turned into one by
specdec.serve.app), never ignored or clamped. The sampling fields are typed `Any` here on purpose:
SamplingParams checks their type and range, the one place each is written, so a request gets the
same message as the CLI and the Python API. top_k, min_p, repetition_penalty, ignore_eos and
stop_token_ids and guided_json / guided_regex / guided_grammar are extensions (vLLM's names), and
seed_stable is ours (see SamplingParams). Chat's response_format json_object and json_schema
constrain the output (specdec.grammar).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.config import MAX_LOGPROBS, MAX_SEED, SamplingParams
from specdec.errors import SpecdecError
from specdec.grammar import check_constraint

MAX_N = 16  # choices per request
# the request fields SamplingParams checks (null: its default)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "seed", "seed_stable")


class BadRequest(Exception):
    """A 400 for one field: `message` names the value and what is allowed."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def _text(value):
    """Strings a request carries are text: a lone surrogate (JSON "\\ud800") cannot be
    tokenised, so it is refused here, as a 400 naming the field."""
    for s in value if isinstance(value, list) else [value]:
        if isinstance(s, str):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"not valid UTF-8 (a lone surrogate at character {e.start}); "
                                 "allowed: UTF-8 text") from None
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # checked by SamplingParams (SAMPLING_FIELDS)
    temperature: Any = None
    top_p: Any = None
    stop: Any = None
    seed: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    # extensions (vLLM's names; top_k -1 is vLLM's "off", taken as 0)
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    seed_stable: Any = None  # ours: the same seed gives the same text at any k (SamplingParams)
    # structured output (vLLM's names): a JSON schema, a regex, a Lark grammar
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None

    def constraint(self) -> dict:
        """SamplingParams' structured-output fields from the request (at most one is allowed)."""
        kw = {"json_schema": self.guided_json, "regex": self.guided_regex, "grammar": self.guided_grammar}
        return {k: v for k, v in kw.items() if v is not None}

    def sampling_params(self, max_tokens: int, logprobs: int | None, vocab: int,
                        choice: int = 0) -> SamplingParams:
        """The request's SamplingParams for choice `choice` (with a seed, choice j samples with
        seed + j: its own dice, reproducible). Every sampling field is checked here."""
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by this server", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        kw = {name: getattr(self, name) for name in SAMPLING_FIELDS if getattr(self, name) is not None}
        if type(self.top_k) is int and self.top_k == -1:
            kw["top_k"] = 0
        try:
            params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kw, **self.constraint())
            params.check_vocab(vocab)
            check_constraint(params)
            if choice and params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + choice) % (MAX_SEED + 1))
        except SpecdecError as e:
            raise BadRequest(str(e), e.field) from None
        return params

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    _prompt_text = field_validator("prompt")(_text)

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

    _valid = field_validator("text")(_text)


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    _valid = field_validator("content")(_text)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def constraint(self) -> dict:
        """response_format json_object / json_schema, or the guided_* extensions (not both)."""
        kw = super().constraint()
        rf = self.response_format
        if rf is None or rf.type == "text":
            return kw
        if kw:
            raise BadRequest(f"response_format {rf.type!r} and {next(iter(kw))} are both set; allowed: one "
                             "constraint", "response_format")
        if rf.type == "json_object":
            return {"json_schema": {"type": "object"}}
        if rf.json_schema is None:
            raise BadRequest("response_format type 'json_schema' needs its json_schema.schema", "response_format")
        return {"json_schema": rf.json_schema.schema_}

    def check_unsupported(self) -> None:
        if self.tools or self.tool_choice not in (None, "none"):
            raise BadRequest("tools are not supported by this server", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
