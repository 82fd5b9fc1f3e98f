"""Structured output: which tokens a JSON schema, a regex or a Lark grammar allows next, at every
candidate position of a speculative round.

Built on llguidance (a Rust Earley parser with a token trie; one 3 MB wheel). Three pieces:
- `compile_grammar` turns the user's constraint into llguidance's grammar string, and refuses what
  the library refuses with a one-line SpecdecError naming the field;
- `grammar_tokenizer` gives the library's view of our vocabulary (built once per Tokenizer, ~1 s);
  `tiny_tokenizer` one over a handful of byte strings, for exact-distribution tests;
- `GrammarState`, the LogitsState of one constrained request: `inputs(drafts)` is the mask
  [k + 1, V] of tokens allowed after each draft prefix, found by walking the matcher over the drafts
  and rolling it back; `commit(token)` advances it by committed tokens only.

It knows nothing of sampling, verification or stopping. The sampling chain masks p and q alike, so
every token the engine commits is one the grammar accepts. EOS (any of the tokenizer's end ids) is
allowed exactly where the grammar may end; once the grammar is complete, EOS is the only token
allowed. Ids past the tokenizer's vocabulary (a model's padding rows, GGUF's "[PAD<id>]" entries)
are never allowed.
"""

from __future__ import annotations

import json
import threading
import weakref

import llguidance
import numpy as np
import torch

from specdec.errors import SpecdecError, check_bool, check_text
from specdec.logits_state import LogitsInputs
from specdec.runtime.tokenizer import Tokenizer

_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "Lark grammar",
         "json_object": "JSON object constraint"}
# JSON on one line, laid out as json.dumps lays it out: with free whitespace (the library's default)
# a small model can emit newlines forever inside a valid object. A schema's own "x-guidance" wins.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REASON_LIMIT = 300  # characters of the library's reason kept in a message


# ---- tokenizers ---------------------------------------------------------------------------------
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> LLTokenizer
_tokenizers_lock = threading.Lock()  # two server threads asking at once build it once


def grammar_tokenizer(tok: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tok` (cached per Tokenizer object: building it takes ~1 s on a
    150k vocabulary). vocab_size is the model's V, which may exceed the tokenizer's (padding rows).

    The library reads tokenizer.json itself (as llguidance.hf.from_tokenizer does). GGUF
    conversions pad the token list with "[PAD<id>]" entries; the library would take them for text
    and allow them inside JSON strings, so they are removed and the vocabulary cut to the real one."""
    if tok.vocab_size > vocab_size:
        raise SpecdecError(f"structured output needs the model's vocabulary ({vocab_size}) to cover "
                           f"the tokenizer's ({tok.vocab_size})")
    if not tok.eos_token_ids:
        raise SpecdecError("structured output needs an end-of-sequence token; this tokenizer has none")
    with _tokenizers_lock:
        lt = _tokenizers.get(tok)
        if lt is None:
            hf = tok._tok  # the `tokenizers.Tokenizer` it wraps (there is no public accessor)
            j = json.loads(hf.to_str())
            j["padding"] = j["truncation"] = None  # encode whole texts, as from_tokenizer does
            pads = set(hf.get_vocab(with_added_tokens=True)) - set(tok.real_vocab)
            if pads:
                vocab = j["model"]["vocab"]
                if isinstance(vocab, dict):  # BPE / WordPiece; Unigram's list has no [PAD] entries
                    j["model"]["vocab"] = {t: i for t, i in vocab.items() if t not in pads}
                j["added_tokens"] = [a for a in j["added_tokens"] if a["content"] not in pads]
            lt = llguidance.LLTokenizer(json.dumps(j), n_vocab=tok.vocab_size,
                                        eos_token=sorted(tok.eos_token_ids))
            _tokenizers[tok] = lt
    assert lt.vocab_size == tok.vocab_size, (lt.vocab_size, tok.vocab_size)
    return lt


class _TinyVocab:
    """What llguidance.TokenizerWrapper wraps: each id's bytes, EOS, and an encoder (greedy longest
    match; the library only uses it to tokenize forced text, never for masks)."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens = tokens
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.encode() if isinstance(text, str) else text
        ids, i = [], 0
        while i < len(s):
            fits = [t for t, b in enumerate(self.tokens) if t != self.eos_token_id and b and s.startswith(b, i)]
            if not fits:
                raise ValueError(f"{s[i:]!r} cannot be spelled with the tiny vocabulary")
            best = max(fits, key=lambda t: len(self.tokens[t]))
            ids.append(best)
            i += len(self.tokens[best])
        return ids


def tiny_tokenizer(tokens: list[bytes], eos: int) -> llguidance.LLTokenizer:
    """A tokenizer over a few byte strings (id = index; tokens[eos] is the end token, special)."""
    assert 0 <= eos < len(tokens) and len(set(tokens)) == len(tokens), (tokens, eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TinyVocab(list(tokens), eos)))


# ---- grammars -----------------------------------------------------------------------------------
def _one_line(reason: str) -> str:
    """The library's multi-line diagnostic as one line: caret markers and the source lines they
    point into are dropped, the rest joined."""
    lines = [ln.strip() for ln in reason.splitlines()]
    caret = [bool(ln) and set(ln) <= {"^"} for ln in lines]
    kept = [ln for i, ln in enumerate(lines)
            if ln and not caret[i] and not (i + 1 < len(lines) and caret[i + 1])]
    s = " ".join(kept)
    return s if len(s) <= _REASON_LIMIT else s[:_REASON_LIMIT - 3] + "..."


def _refuse(field: str, reason: str):
    reason = _one_line(reason)
    if field == "regex":  # the position is in the Lark wrapper around the regex, not in the user's text
        reason = reason.split(": ", 1)[1] if reason.startswith("at ") and ": " in reason else reason
    raise SpecdecError(f"{field} is not a valid {_WHAT[field]}: {reason}", field)


def compile_grammar(json_schema=None, regex: str | None = None, grammar: str | None = None,
                    json_object: bool = False, lltok: llguidance.LLTokenizer | None = None) -> str:
    """llguidance's grammar string for exactly one constraint: a JSON schema (dict, bool, or its JSON
    text), a regex (the whole output must match), a Lark grammar, or json_object (any JSON object).
    lltok: also check the grammar against this vocabulary (e.g. a Lark grammar naming a special
    token the tokenizer lacks). A constraint the library refuses raises SpecdecError naming it."""
    check_bool("json_object", json_object)
    given = [f for f, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                            ("json_object", json_object or None)) if v is not None]
    if len(given) != 1:
        head = f"{given[1]} is set with {given[0]}; " if given else ""
        raise SpecdecError(f"{head}structured output takes exactly one of json_schema, regex, grammar, "
                           f"json_object; got {', '.join(given) or 'none'}", given[1] if given else None)
    field = given[0]
    if field == "json_schema":
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"json_schema is not valid JSON: {e}", "json_schema") from None
        if not isinstance(json_schema, (dict, bool)):
            _refuse(field, f"a schema is a JSON object or a boolean, not {type(json_schema).__name__}")
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as e:  # not serialisable to JSON
            _refuse(field, str(e))
    elif field == "json_object":
        g = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    elif field == "regex":
        g = llguidance.LLMatcher.grammar_from_regex(check_text("regex", regex, allow_empty=True))
    else:
        g = llguidance.LLMatcher.grammar_from_lark(check_text("grammar", grammar))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(g, lltok)
    if is_error:
        _refuse(field, messages[0])
    return g


def check_constraint(params) -> None:
    """Refuse a SamplingParams whose json_schema / regex / grammar the library rejects, at the
    boundary (CLI, API, server) before a request is queued: one SpecdecError naming the field."""
    if params.constrained:
        compile_grammar(json_schema=params.json_schema, regex=params.regex, grammar=params.grammar)


class Grammars:
    """An engine's grammar states: llguidance's view of the vocabulary (built on first use, or
    given: a test's tiny one) and each constraint compiled once (a server sees the same few
    schemas again and again)."""

    def __init__(self, tok: Tokenizer | None, vocab_size: int, device, lltok=None):
        self.tok, self.V, self.device, self.lltok = tok, vocab_size, device, lltok
        self._compiled: dict[tuple, str] = {}  # constraint -> compiled grammar

    def state(self, params) -> "GrammarState":
        if self.lltok is None:
            if self.tok is None:
                raise SpecdecError("structured output needs the model's tokenizer; this engine has none")
            self.lltok = grammar_tokenizer(self.tok, self.V)
        key = (json.dumps(params.json_schema, sort_keys=True), params.regex, params.grammar)
        compiled = self._compiled.get(key)
        if compiled is None:
            if len(self._compiled) >= 256:
                self._compiled.clear()
            compiled = self._compiled[key] = compile_grammar(
                json_schema=params.json_schema, regex=params.regex, grammar=params.grammar)
        return GrammarState(self.lltok, compiled, self.V, self.device)


# ---- the logits state ---------------------------------------------------------------------------
class GrammarState:
    """The grammar's LogitsState for one request (see specdec.logits_state).

    `inputs(drafts)` walks the matcher over the drafts, taking the mask before each, and rolls back
    exactly what it consumed (in `finally`: an exception leaves the state as it was). The first
    draft the grammar rejects ends the walk: the positions after it get an all-True mask. They can
    never be reached: the mask before the rejected draft gives it p = 0, so verification rejects
    it first (and a masked q never drafts it). Masks are cached per draft prefix until the next
    commit: the draft loop's last_only calls and the round's verification share them.

    Not thread-safe: one request's state is used by one thread at a time (the engine's)."""

    def __init__(self, lltok: llguidance.LLTokenizer, grammar: str, vocab_size: int, device):
        assert lltok.vocab_size <= vocab_size, (lltok.vocab_size, vocab_size)
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)  # errors are ours to report
        if self.matcher.is_error():
            raise SpecdecError(f"the grammar does not fit this model's vocabulary: "
                               f"{_one_line(self.matcher.get_error())}")
        self.n = lltok.vocab_size  # ids the grammar knows; [n, V) are padding, never allowed
        self.V = vocab_size
        self.device = device
        self.words = (self.n + 31) // 32  # mask size: 32 tokens per little-endian int32 word
        self._masks: dict[tuple[int, ...], np.ndarray] = {}  # draft prefix -> [words] int32
        self.eos = frozenset(lltok.eos_tokens)
        self._eos_words = np.zeros(self.words, dtype=np.int32)  # the mask once EOS is in: EOS only
        for e in self.eos:
            self._eos_words.view(np.uint32)[e >> 5] |= np.uint32(1 << (e & 31))

    @property
    def accepting(self) -> bool:
        """The committed tokens form a complete output: EOS is allowed now."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """The grammar is complete (or EOS was committed): only EOS is allowed now."""
        return self.matcher.is_stopped()

    def _mask_words(self, prefix: tuple[int, ...]) -> np.ndarray:
        """[words] int32: the mask at the matcher's current state, which is after `prefix`."""
        w = self._masks.get(prefix)
        if w is None:
            w = np.empty(self.words, dtype=np.int32)
            self.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
            self._masks[prefix] = w
        return w

    def _allows(self, w: np.ndarray, token: int) -> bool:
        return 0 <= token < self.n and bool((int(w[token >> 5]) >> (token & 31)) & 1)

    def inputs(self, drafts: torch.Tensor, last_only: bool = False) -> LogitsInputs:
        """mask [k + 1, V] bool (drafts [k] int64): row i allows the tokens the grammar accepts
        after drafts[:i]; last_only: only row k, [1, V]."""
        d = drafts.tolist()
        rows = np.empty((1 if last_only else len(d) + 1, self.words), dtype=np.int32)
        filled = consumed = 0  # rows [0, filled) hold masks; the rest are all True
        after_eos = False
        try:
            for i in range(len(d) + 1):
                w = self._eos_words if after_eos else self._mask_words(tuple(d[:i]))
                if not last_only:
                    rows[i], filled = w, i + 1
                elif i == len(d):
                    rows[0], filled = w, 1
                if i == len(d) or not self._allows(w, d[i]):
                    break  # the end, or the first rejected draft
                if d[i] in self.eos:
                    # After EOS only EOS is allowed. The EOS is not consumed: a stopped matcher
                    # takes an EOS without recording it, so rollback(consumed) would overshoot.
                    after_eos = True
                    continue
                ok = self.matcher.consume_token(d[i])
                assert ok, f"draft {d[i]} allowed by the mask was refused: {self.matcher.get_error()}"
                consumed += 1
        finally:
            if consumed:
                assert self.matcher.rollback(consumed), self.matcher.get_error()
        return LogitsInputs(mask=self._to_bool(rows, filled))

    def accepted_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the state is unchanged): the first it
        rejects ends a round's drafts, since verification would reject it anyway (p = 0)."""
        n = consumed = 0
        after_eos = False
        try:
            for t in drafts:
                w = self._eos_words if after_eos else self._mask_words(tuple(drafts[:n]))
                if not self._allows(w, t):
                    break
                n += 1
                if t in self.eos:
                    after_eos = True  # (not consumed: see `inputs`)
                    continue
                ok = self.matcher.consume_token(t)
                assert ok, self.matcher.get_error()
                consumed += 1
        finally:
            if consumed:
                assert self.matcher.rollback(consumed), self.matcher.get_error()
        return n

    def _to_bool(self, rows: np.ndarray, filled: int) -> torch.Tensor:
        """[T, words] int32 -> [T, V] bool: rows [0, filled) are masks (False past the
        tokenizer's vocabulary), the rest all True."""
        out = np.zeros((rows.shape[0], self.V), dtype=np.uint8)
        out[:filled, : self.n] = np.unpackbits(rows[:filled].view(np.uint8), axis=1, count=self.n,
                                               bitorder="little")
        out[filled:] = 1
        mask = torch.from_numpy(out).view(torch.bool)  # 0/1 bytes are valid bools
        return mask.to(self.device)

    def commit(self, token: int) -> None:
        """Consume a committed token (an EOS on a stopped matcher is taken and not recorded)."""
        self._masks.clear()
        ok = self.matcher.consume_token(token)
        assert ok, f"grammar refused committed token {token}: {self.matcher.get_error()}"


def reference_masks(lltok: llguidance.LLTokenizer, grammar: str, vocab_size: int, committed: list[int],
                    drafts: list[int]) -> torch.Tensor:
    """Slow reference for GrammarState.inputs: [k + 1, V] bool, row i from a fresh matcher fed
    committed + drafts[:i] one token at a time (no rollback, no cache), its bitmask unpacked
    bit by bit with torch; rows after the first rejected draft all True."""
    k = len(drafts)
    out = torch.ones(k + 1, vocab_size, dtype=torch.bool)
    shifts = torch.arange(32, dtype=torch.int32)
    for i in range(k + 1):
        m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        for t in committed + drafts[:i]:
            assert m.consume_token(t), m.get_error()
        words = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
        bits = ((words[:, None] >> shifts) & 1).flatten().bool()
        out[i] = False
        out[i, : lltok.vocab_size] = bits[: lltok.vocab_size]
        if i < k and not (0 <= drafts[i] < lltok.vocab_size and out[i, drafts[i]]):
            break
    return out
