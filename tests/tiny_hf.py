"""Tiny random models written as Hugging Face directories (config.json, model.safetensors, a
word-level tokenizer.json), so commands can be run on them exactly as a user runs them on a real
checkpoint path (and transformers can load them for --compare transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from conftest import random_state, tiny_args


def write_tiny_hf(path: Path, vocab: int = 16, seed: int = 0, scale: float = 0.2, **kw) -> str:
    """Words w0..w{vocab-1} are tokens 0..vocab-1 (w0 doubles as the unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    args = tiny_args(vocab=vocab, **kw)
    save_file({k: v.contiguous() for k, v in random_state(args, seed, scale).items()},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(args.to_hf_config()))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return str(path)
