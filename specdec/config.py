"""Validated configuration dataclasses: model architecture, sampling and speculation settings.

Every user-facing field is checked in `__post_init__` and a bad value raises `SpecdecError`
naming the field, the value and the allowed range.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field

from specdec.errors import (SpecdecError, check_bool, check_choice, check_float, check_int, check_text,
                            show)


@dataclass(frozen=True)
class ModelArgs:
    """Decoder-only transformer shape (Llama family and Qwen2)."""

    arch: str  # "llama" | "qwen2"
    vocab_size: int  # rows of the embedding table (may be padded past the tokenizer's vocabulary)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False

    def to_hf_config(self) -> dict:
        """The equivalent Hugging Face config.json (used for the conversion cache and tests)."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.dim,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.norm_eps,
            max_position_embeddings=self.max_seq_len,
            tie_word_embeddings=self.tie_embeddings,
            hidden_act="silu",
            torch_dtype="float32",
        )
        if self.arch == "qwen2":
            return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **common)
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                    mlp_bias=False, **common)

    @staticmethod
    def from_hf_config(cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type", "")
        if model_type in ("llama", "mistral"):
            arch = "llama"
        elif model_type == "qwen2":
            arch = "qwen2"
        else:
            raise SpecdecError(
                f"unsupported architecture {model_type!r} (config.json model_type); "
                "supported: llama, mistral, qwen2")
        if cfg.get("rope_scaling"):
            raise SpecdecError(f"unsupported rope_scaling {cfg['rope_scaling']!r}; only plain RoPE")
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelArgs(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(rope_theta),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )


MAX_DRAFT_TOKENS = 32
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
MAX_TEMPERATURE = 2.0  # OpenAI's limit; past it the distribution is close to uniform noise
MAX_REPETITION_PENALTY = 10.0
MAX_STOP = 16  # stop strings per request
MAX_SEED = 2**63 - 1  # a seed is an int64 everywhere (torch.Generator, the server, tensors)
MAX_TOKEN_ID = 2**31 - 1
MAX_NGRAM = 64
MAX_BATCH = 256  # rows decoded together (KV rows)
DEFAULT_MAX_MODEL_LEN = 4096  # context cap unless asked (the model's own, if smaller)


@dataclass
class SamplingParams:
    """How to turn the target's logits into the next token.

    The transform chain, applied identically to target p and draft q at every position, is:
    penalties -> temperature -> top-k -> top-p -> min-p. temperature == 0 means greedy (argmax of
    the penalised logits). Repetition penalty counts prompt and output tokens (HF semantics);
    presence and frequency penalties count output tokens only (OpenAI semantics).
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # report the emitted tokens' log-probabilities and this many top ones
    # Seed-stable sampling (docs/lossless.md): position t's token is the argmax of the log-
    # probabilities plus Gumbel noise drawn from (seed, t), so a seed gives the same text with
    # speculation on or off, at any k, alone or batched. None: on when a seed is given.
    seed_stable: bool | None = None
    # Structured output (specdec.grammar, llguidance): at most one of a JSON schema (a dict or its
    # JSON text; {"type": "object"} for any JSON object), a regular expression, or a Lark grammar.
    # Every candidate position's p and q are masked to what the grammar allows there.
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        # each field's type and range, written once: the CLI, the Python API and the server all
        # construct SamplingParams, so they all refuse the same values with the same message
        self.temperature = check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_k = check_int("top_k", self.top_k, 0, None, "; 0 disables it")
        self.top_p = check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.min_p = check_float("min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty, 0.0,
                                              MAX_REPETITION_PENALTY, lo_open=True)
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.max_tokens = check_int("max_tokens", self.max_tokens, 1, None)
        self.stop = check_stop(self.stop)
        self.stop_token_ids = check_token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check_bool("seed_stable", self.seed_stable, optional=True)
        self.json_schema = check_schema(self.json_schema)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                check_text(name, getattr(self, name))
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise SpecdecError(f"{' and '.join(given)} are both set; allowed: at most one of json_schema, "
                               "regex, grammar", given[1])

    @property
    def constrained(self) -> bool:
        """A grammar constrains the output (json_schema, regex or grammar)."""
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    def check_vocab(self, vocab: int) -> None:
        """Token ids past the vocabulary (known only once a model is loaded) are refused too."""
        bad = next((t for t in self.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise SpecdecError(f"stop_token_ids has {bad}; allowed token ids [0, {vocab - 1}]",
                               "stop_token_ids")

    @property
    def stable(self) -> bool:
        """Seed-stable sampling in effect (see `seed_stable`)."""
        return self.seed is not None if self.seed_stable is None else self.seed_stable

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


DEFAULT_MAX_DRAFT_TOKENS = 8  # k_max of adaptive k: past ~8 the verify cost grows (kernels bench)
DRAFT_SAMPLING = ("probabilistic", "greedy")
# weight storage: fp32, bf16 (rounded), native (the GGUF's own quantised blocks), q4_0 (those
# blocks requantised to Q4_0 where they have more bits: a cheaper, coarser draft)
DTYPES = ("auto", "fp32", "bf16", "native", "q4_0")  # auto: native for a GGUF, else fp32
PROPOSERS = ("draft", "ngram", "composite", "head")


@dataclass
class SpeculativeConfig:
    """Which proposer drafts tokens and how many per round."""

    draft: str | None = None  # model name or path of a draft model
    num_draft_tokens: int | str = "auto"  # k per round, or "auto": adaptive k in [0, max_draft_tokens]
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # k_max for "auto"
    draft_sampling: str = "probabilistic"  # how the draft samples its tokens: q = full or one-hot
    draft_dtype: str = "auto"
    proposer: str | None = None  # draft | ngram | composite (n-gram first, then the draft model,
    # or without one the head) | head (a trained draft head); default: "composite" if a draft is
    # given ("draft" with a fixed or auto draft_tree), "head" if a head, else "ngram"
    head: str | None = None  # a trained head's directory (default for proposer "head", and
    # "composite" without a draft: the one shipped for the target, specdec.head.shipped_head)
    ngram_min: int = 1
    ngram_max: int = 4
    draft_tree: str | tuple | None = None  # children per depth ("3,2,1" or (3, 2, 1)): the draft
    # model (or head) drafts a tree of its top candidates, verified losslessly in one forward; "auto": each
    # round's shape (a chain included) chosen from measured costs and acceptances; "dynamic" or
    # "dynamic:N": each row's tree grown by the draft's own confidence (EAGLE-2), N nodes (default
    # 2k); None / "off": a chain. Depth = len(widths), cut to the round's k.

    def __post_init__(self):
        self.draft = _path_or_name("draft", self.draft, "a model; allowed: a registry name, a .gguf "
                                   "file or a Hugging Face directory")
        self.head = _path_or_name("head", self.head, "a head; allowed: the directory `specdec "
                                  "train-head --out` wrote")
        if self.proposer is None:
            self.proposer = self._default_proposer()
        check_choice("proposer", self.proposer, PROPOSERS)
        if self.proposer == "draft" and self.draft is None:
            raise SpecdecError(f"proposer={self.proposer!r} needs a draft model (--draft MODEL)", "draft")
        if self.proposer == "composite" and self.draft is not None and self.head is not None:
            raise SpecdecError(f"head={self.head!r} and draft={self.draft!r}: a composite's second part is the "
                               "draft model or, without one, the head; allowed: one of them", "head")
        check_ngram_range(self.ngram_min, self.ngram_max)
        self.num_draft_tokens = parse_num_draft_tokens(self.num_draft_tokens)
        self.max_draft_tokens = check_int("max_draft_tokens", self.max_draft_tokens, 0, MAX_DRAFT_TOKENS)
        check_choice("draft_dtype", self.draft_dtype, DTYPES)
        check_choice("draft_sampling", self.draft_sampling, DRAFT_SAMPLING)
        self.draft_tree = parse_draft_tree(self.draft_tree)
        dynamic = dynamic_nodes(self.draft_tree, 1) is not None
        if self.draft_tree is not None and self.proposer == "ngram" and not dynamic:
            raise SpecdecError(f"draft_tree={tree_text(self.draft_tree)}: an n-gram tree grows from the earlier "
                               "matches of the context, not a fixed shape; allowed with proposer='ngram': "
                               "'dynamic', 'dynamic:N' or 'off'", "draft_tree")
        if self.draft_tree is not None and self.proposer == "composite" and self.draft is None:
            raise SpecdecError(f"draft_tree={tree_text(self.draft_tree)}: a composite tree needs a draft model; "
                               "the n-gram and head composite drafts chains; allowed: 'off', or --draft MODEL",
                               "draft_tree")
        if self.draft_tree is not None and self.proposer == "composite" and not dynamic:
            raise SpecdecError(f"draft_tree={tree_text(self.draft_tree)}: a composite tree is the union of the "
                               "n-gram trie and the draft model's dynamic tree, not a fixed shape; allowed with "
                               "proposer='composite': 'dynamic', 'dynamic:N' or 'off'", "draft_tree")

    def _default_proposer(self) -> str:
        """With a draft model, the composite (its n-gram lookup is free and, where the text repeats
        itself, accepted far more often than the draft model's guesses: HumanEval on the Qwen pair,
        Zen 4, a server at concurrency 1 spoke 2.16x plain with it against 0.92-1.3x with the
        draft model alone, and chat 1.21x against 1.14x; docs/bench/README.md), or the draft model
        alone where a fixed tree shape or `auto` asks for its own top candidates; else the head,
        or the n-gram lookup."""
        if self.draft is None:
            return "head" if self.head is not None else "ngram"
        tree = parse_draft_tree(self.draft_tree)
        return "composite" if tree is None or dynamic_nodes(tree, 1) is not None else "draft"

    def check_unused(self) -> None:
        """Refuse settings this configuration would ignore (a user who set them expects them to
        matter). Called at the faces (LLM, the CLI), not by internal builders that fill every
        field, such as `specdec bench`, which shares one max_draft_tokens across fixed and auto k."""
        if self.proposer == "ngram":
            if self.draft is not None:
                raise SpecdecError(f"draft={self.draft!r} is not used by proposer='ngram'; allowed: "
                                   "proposer draft or composite with a draft, or no draft", "draft")
            for name, default in (("draft_dtype", "auto"), ("draft_sampling", "probabilistic")):
                if getattr(self, name) != default:
                    raise SpecdecError(f"{name}={getattr(self, name)!r} applies to a draft model, and "
                                       "proposer='ngram' has none; allowed: proposer draft or composite",
                                       name)
        if self.head is not None and self.proposer not in ("head", "composite"):
            raise SpecdecError(f"head={self.head!r} is only used by proposer='head' or 'composite' (without a "
                               f"draft), not {self.proposer!r}", "head")
        if self.proposer == "head" and self.draft is not None:
            raise SpecdecError(f"draft={self.draft!r} is not used by proposer='head'; allowed: proposer "
                               "draft or composite with a draft, or no draft", "draft")
        if self.proposer in ("head", "composite") and self.draft is None and self.draft_dtype != "auto":
            raise SpecdecError(f"draft_dtype={self.draft_dtype!r} applies to a draft model, and "
                               f"proposer={self.proposer!r} without --draft has none", "draft_dtype")
        if self.proposer in ("draft", "head") and (self.ngram_min, self.ngram_max) != (1, 4):
            raise SpecdecError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max} apply to n-gram "
                               "lookup, which proposer='draft' does not use; allowed: proposer ngram or "
                               "composite", "ngram_min")
        if self.num_draft_tokens != "auto" and self.max_draft_tokens != DEFAULT_MAX_DRAFT_TOKENS:
            raise SpecdecError(f"max_draft_tokens={self.max_draft_tokens} is not used with num_draft_tokens="
                               f"{self.num_draft_tokens}; allowed: num_draft_tokens='auto', or "
                               f"max_draft_tokens left at {DEFAULT_MAX_DRAFT_TOKENS}", "max_draft_tokens")


def _path_or_name(field: str, value, what: str):
    """None, or a non-empty string (a path-like becomes its string)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise SpecdecError(f"{field}={show(value)} is not {what}", field)
    return value


def check_ngram_range(n_min, n_max) -> None:
    check_int("ngram_min", n_min, 1, MAX_NGRAM)
    check_int("ngram_max", n_max, 1, MAX_NGRAM)
    if n_max < n_min:
        raise SpecdecError(f"ngram_min={n_min} > ngram_max={n_max}; need 1 <= ngram_min <= ngram_max "
                           f"<= {MAX_NGRAM}", "ngram_min")


def check_stop(stop) -> list[str]:
    """A string or a list of at most MAX_STOP non-empty strings, as a list."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise SpecdecError(f"stop={show(stop)} is not a string or a list of strings; allowed: up to "
                           f"{MAX_STOP} non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise SpecdecError(f"stop has {len(stop)} strings; allowed at most {MAX_STOP}", "stop")
    for s in stop:
        if not s:
            raise SpecdecError("stop has an empty string; allowed: non-empty strings", "stop")
        check_text("stop", s)
    return list(stop)


def check_schema(schema) -> dict | None:
    """A JSON schema as a dict: given as one, or as its JSON text."""
    if schema is None or isinstance(schema, dict):
        return schema
    if isinstance(schema, str):
        import json

        try:
            value = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"json_schema is not valid JSON ({e.msg} at character {e.pos}); allowed: "
                               "a JSON schema object", "json_schema") from None
        if isinstance(value, dict):
            return value
    raise SpecdecError(f"json_schema={show(schema)} is not a JSON schema object; allowed: a dict or its "
                       "JSON text", "json_schema")


def check_token_ids(name: str, ids) -> list[int]:
    """A list of token ids, each an integer >= 0 (the vocabulary bound is checked with the model)."""
    if not isinstance(ids, (list, tuple)):
        raise SpecdecError(f"{name}={show(ids)} is not a list of token ids; allowed: integers >= 0", name)
    return [check_int(name, t, 0, MAX_TOKEN_ID) for t in ids]


MAX_TREE_NODES = 32  # a tree's nodes fit the KV cache's headroom beyond the context
MAX_TREE_WIDTH = 8


def tree_text(tree) -> str:
    """A draft tree as the user writes it: "auto", "dynamic:8" or "3,2,1"."""
    return tree if isinstance(tree, str) else ",".join(map(str, tree))


def parse_draft_tree(value) -> tuple[int, ...] | str | None:
    """Children per depth as the user wrote them: "3,2,1" or (3, 2, 1); "auto": each round's shape
    chosen from measured costs and acceptances (specdec.engine.tree_auto); "dynamic" or
    "dynamic:N": grown by the draft's confidence, N nodes in [1, MAX_TREE_NODES] (kept as
    "dynamic" or "dynamic:N"); None, "" or "off": no tree. Each width in [1, MAX_TREE_WIDTH],
    nodes (3 + 3*2 + 3*2*1 = 15 for "3,2,1") at most MAX_TREE_NODES."""
    allowed = (f"allowed: 'off', 'auto', 'dynamic', 'dynamic:N' (N nodes in [1, {MAX_TREE_NODES}]) or "
               f"children per depth such as '3,2,1' (each in [1, {MAX_TREE_WIDTH}], "
               f"at most {MAX_TREE_NODES} nodes in all)")
    if value is None:
        return None
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "off", "none"):
            return None
        if v == "auto":
            return "auto"
        if v == "dynamic":
            return "dynamic"
        if v.startswith("dynamic:"):
            try:
                n = int(v.split(":", 1)[1])
            except ValueError:
                raise SpecdecError(f"draft_tree={value!r}: the node count is not an integer; {allowed}",
                                   "draft_tree") from None
            if not 1 <= n <= MAX_TREE_NODES:
                raise SpecdecError(f"draft_tree={value!r}: {n} nodes is outside [1, {MAX_TREE_NODES}]; {allowed}",
                                   "draft_tree")
            return f"dynamic:{n}"
        try:
            value = tuple(int(x) for x in v.split(","))
        except ValueError:
            raise SpecdecError(f"draft_tree={value!r} is not a list of widths; {allowed}", "draft_tree") from None
    try:
        widths = tuple(value)
    except TypeError:
        raise SpecdecError(f"draft_tree={show(value)} is not a list of widths; {allowed}", "draft_tree") from None
    if not widths or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or not 1 <= w <= MAX_TREE_WIDTH
                         for w in widths):
        raise SpecdecError(f"draft_tree={show(value)} has a width outside [1, {MAX_TREE_WIDTH}]; {allowed}",
                           "draft_tree")
    nodes, level = 0, 1
    for w in widths:
        level *= int(w)
        nodes += level
    if nodes > MAX_TREE_NODES:
        raise SpecdecError(f"draft_tree={','.join(map(str, widths))} has {nodes} nodes; {allowed}", "draft_tree")
    return tuple(int(w) for w in widths)


def parse_num_draft_tokens(value) -> int | str:
    """k as the user wrote it: an integer in [0, MAX_DRAFT_TOKENS], or "auto" (adaptive)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        try:
            value = int(v)
        except ValueError:
            raise SpecdecError(f"num_draft_tokens={value!r} is not 'auto' or an integer; allowed 'auto' "
                               f"or [0, {MAX_DRAFT_TOKENS}]", "num_draft_tokens") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SpecdecError(f"num_draft_tokens={show(value)} is not 'auto' or an integer; allowed 'auto' "
                           f"or [0, {MAX_DRAFT_TOKENS}]", "num_draft_tokens")
    return check_int("num_draft_tokens", value, 0, MAX_DRAFT_TOKENS)


def dynamic_nodes(tree, k: int) -> int | None:
    """A "dynamic" draft tree's node budget for a round of depth k (None: not dynamic)."""
    if not isinstance(tree, str) or not tree.startswith("dynamic"):
        return None
    return int(tree.split(":", 1)[1]) if ":" in tree else min(MAX_TREE_NODES, 2 * k)
