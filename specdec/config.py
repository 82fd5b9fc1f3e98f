"""Validated configuration dataclasses: model architecture, sampling and speculation settings.

Every user-facing field is checked in `__post_init__` and a bad value raises `SpecdecError`
naming the field, the value and the allowed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import SpecdecError, check_range


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

    def __post_init__(self):
        check_range("temperature", self.temperature, 0.0, 100.0)
        if not isinstance(self.top_k, int):
            raise SpecdecError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        check_range("top_k", self.top_k, 0, None)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, None, lo_open=True)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.max_tokens, int):
            raise SpecdecError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        check_range("max_tokens", self.max_tokens, 1, None)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise SpecdecError("stop strings must be non-empty")
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
                raise SpecdecError(f"logprobs={self.logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
            check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


MAX_DRAFT_TOKENS = 32
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's limit)
DEFAULT_MAX_DRAFT_TOKENS = 8  # k_max of adaptive k: past ~8 the verify cost grows (kernels bench)
DRAFT_SAMPLING = ("probabilistic", "greedy")
# weight storage: fp32, bf16 (rounded), native (the GGUF's own quantised blocks), q4_0 (those
# blocks requantised to Q4_0 where they have more bits: a cheaper, coarser draft)
DTYPES = ("auto", "fp32", "bf16", "native", "q4_0")  # auto: native for a GGUF, else fp32
PROPOSERS = ("draft", "ngram", "composite")


@dataclass
class SpeculativeConfig:
    """Which proposer drafts tokens and how many per round."""

    draft: str | None = None  # model name or path of a draft model
    num_draft_tokens: int | str = "auto"  # k per round, or "auto": adaptive k in [0, max_draft_tokens]
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # k_max for "auto"
    draft_sampling: str = "probabilistic"  # how the draft samples its tokens: q = full or one-hot
    draft_dtype: str = "auto"
    proposer: str | None = None  # draft | ngram | composite (n-gram first, then the draft model);
    # default: "draft" if a draft is given, else "ngram"
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self):
        if self.proposer is None:
            self.proposer = "draft" if self.draft is not None else "ngram"
        if self.proposer not in PROPOSERS:
            raise SpecdecError(f"proposer={self.proposer!r}; allowed: {', '.join(PROPOSERS)}")
        if self.proposer in ("draft", "composite") and self.draft is None:
            raise SpecdecError(f"proposer={self.proposer!r} needs a draft model (--draft MODEL)")
        check_ngram_range(self.ngram_min, self.ngram_max)
        self.num_draft_tokens = parse_num_draft_tokens(self.num_draft_tokens)
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int):
            raise SpecdecError(
                f"max_draft_tokens={self.max_draft_tokens!r} must be an integer in [0, {MAX_DRAFT_TOKENS}]")
        check_range("max_draft_tokens", self.max_draft_tokens, 0, MAX_DRAFT_TOKENS)
        if self.draft_dtype not in DTYPES:
            raise SpecdecError(f"draft_dtype={self.draft_dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise SpecdecError(
                f"draft_sampling={self.draft_sampling!r}; allowed: {', '.join(DRAFT_SAMPLING)}")


def check_ngram_range(n_min: int, n_max: int) -> None:
    if n_min < 1:
        raise SpecdecError(f"ngram_min={n_min} is out of range; allowed [1, ngram_max]")
    if n_max < n_min:
        raise SpecdecError(f"ngram_min={n_min} > ngram_max={n_max}; need 1 <= ngram_min <= ngram_max")
    if n_max > 64:
        raise SpecdecError(f"ngram_max={n_max} is out of range; allowed [ngram_min, 64]")


def parse_num_draft_tokens(value) -> int | str:
    """k as the user wrote it: an integer in [0, MAX_DRAFT_TOKENS], or "auto" (adaptive)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return "auto"
        try:
            value = int(v)
        except ValueError:
            raise SpecdecError(f"num_draft_tokens={value!r} must be 'auto' or an integer in "
                               f"[0, {MAX_DRAFT_TOKENS}]") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecdecError(
            f"num_draft_tokens={value!r} must be 'auto' or an integer in [0, {MAX_DRAFT_TOKENS}]")
    check_range("num_draft_tokens", value, 0, MAX_DRAFT_TOKENS)
    return value
