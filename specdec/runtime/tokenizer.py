"""Tokenizer (from tokenizer.json), chat templates, and an incremental UTF-8-safe detokenizer.

`Tokenizer.load(dir)` reads tokenizer.json with the `tokenizers` library and the chat template and
special tokens from tokenizer_config.json / chat_template.jinja (as transformers writes them). The
engine only sees token ids; text lives here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specdec.errors import SpecdecError

# Tokens that end a turn in the chat formats we ship; stop generation on any that exist.
_PAD = re.compile(r"\[PAD\d+\]")
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class Tokenizer:
    def __init__(self, tok, chat_template: str | None, eos_token: str | None, bos_token: str | None):
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.bos_token = bos_token
        vocab = tok.get_vocab(with_added_tokens=True)
        # The real vocabulary: GGUF conversions pad the token list to the embedding table's size
        # with "[PAD<id>]" entries; those ids are never sampled (docs/pitfalls.md 10).
        self.real_vocab = {t: i for t, i in vocab.items() if not _PAD.fullmatch(t)}
        self.vocab_size = max(self.real_vocab.values()) + 1
        special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        ids = {special[t] for t in END_OF_TURN if t in special}  # "</s>" may be plain text elsewhere
        if eos_token in vocab:
            ids.add(vocab[eos_token])
        self.eos_token_ids = frozenset(ids)

    @staticmethod
    def load(path: Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise SpecdecError(f"model directory {path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(tj))
        cfg = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        return Tokenizer(tok, template, tok_str(cfg.get("eos_token")), tok_str(cfg.get("bos_token")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise SpecdecError("this model has no chat template; pass --raw to use the prompt as is")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise SpecdecError(f"chat template error: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "")

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Chat-formatted token ids for an instruct model, or the raw prompt's ids."""
        if raw or not self.chat_template:
            return self.encode(prompt)
        return self.encode(self.apply_chat_template([{"role": "user", "content": prompt}]),
                           add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character.

    Decodes a short window (prefix_offset..end) and emits only the part past read_offset once it
    no longer ends in U+FFFD (an incomplete multi-byte character), as vLLM and TGI do.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
