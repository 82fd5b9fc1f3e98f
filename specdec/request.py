"""A request's state as the engine and its proposers see it: committed tokens, sampling params and
dice, logits state, text, finish reason, statistics. Plain data; the engine moves it.

Bookkeeping (the classic off-by-one, docs/pitfalls.md 4): `tokens` is the committed history (prompt +
output). The target's cache holds KV for every committed token but the last: the last committed
token (recovered, bonus, or the last prompt token) gets its KV as the first input of the next
round, so at the start of every round the target's KV length is len(tokens) - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.config import SamplingParams
from specdec.logits_state import LogitsState, NoState
from specdec.metrics import SpecStats


@dataclass
class TokenLogprob:
    """An emitted token's log-probability under the target after the request's transforms, and
    the `top` most likely tokens there as (id, log-probability), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    row: int  # the cache row it holds (target and draft)
    rng: object  # specdec.rejection.TorchRng, or a test's stand-in
    tokens: list[int]  # committed: prompt + output
    output: list[int] = field(default_factory=list)
    logits_state: LogitsState = field(default_factory=NoState)
    grammar: object | None = None  # specdec.grammar.GrammarState when the output is constrained (also
    # inside logits_state): the engine asks it whether the grammar is complete
    detok: object | None = None  # specdec.runtime.tokenizer.IncrementalDetokenizer
    text: str = ""
    streamed: int = 0  # characters of `text` already handed to the caller
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_time: float = 0.0
    draft_prefill_time: float = 0.0  # the draft model's prompt prefill, part of prefill_time
    decode_time: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV was reused from an earlier request (no prefill)
    logprobs: list = field(default_factory=list)  # [TokenLogprob] per output token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
