"""Shared fixtures: tiny random models (fast, any vocabulary) and the real SmolLM2-135M."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.config import ModelArgs
from specdec.runtime.model import Transformer

torch.set_num_threads(2)


def tiny_args(arch="llama", vocab=64, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=256,
              tie=False) -> ModelArgs:
    return ModelArgs(arch=arch, vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=dim // heads, intermediate_size=inter,
                     rope_theta=10000.0, norm_eps=1e-6, max_seq_len=max_seq_len, tie_embeddings=tie,
                     qkv_bias=arch == "qwen2")


def random_state(args: ModelArgs, seed: int = 0, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face names; `scale` sets how peaked the logits are."""
    g = torch.Generator().manual_seed(seed)
    a = args

    def r(*shape, s=scale):
        return torch.randn(*shape, generator=g) * s

    st = {"model.embed_tokens.weight": r(a.vocab_size, a.dim, s=1.0), "model.norm.weight": 1 + r(a.dim, s=0.1)}
    if not a.tie_embeddings:
        st["lm_head.weight"] = r(a.vocab_size, a.dim)
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        st[p + "input_layernorm.weight"] = 1 + r(a.dim, s=0.1)
        st[p + "post_attention_layernorm.weight"] = 1 + r(a.dim, s=0.1)
        st[p + "self_attn.q_proj.weight"] = r(a.n_heads * a.head_dim, a.dim)
        st[p + "self_attn.k_proj.weight"] = r(a.n_kv_heads * a.head_dim, a.dim)
        st[p + "self_attn.v_proj.weight"] = r(a.n_kv_heads * a.head_dim, a.dim)
        st[p + "self_attn.o_proj.weight"] = r(a.dim, a.n_heads * a.head_dim)
        if a.qkv_bias:
            st[p + "self_attn.q_proj.bias"] = r(a.n_heads * a.head_dim)
            st[p + "self_attn.k_proj.bias"] = r(a.n_kv_heads * a.head_dim)
            st[p + "self_attn.v_proj.bias"] = r(a.n_kv_heads * a.head_dim)
        st[p + "mlp.gate_proj.weight"] = r(a.intermediate_size, a.dim)
        st[p + "mlp.up_proj.weight"] = r(a.intermediate_size, a.dim)
        st[p + "mlp.down_proj.weight"] = r(a.dim, a.intermediate_size)
    return st


def tiny_model(seed=0, **kw) -> Transformer:
    scale = kw.pop("scale", 0.2)
    args = tiny_args(**kw)
    return Transformer(args, random_state(args, seed, scale))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted SmolLM2-135M directory (fetched by `make test` before pytest runs)."""
    from specdec.runtime.hub import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from specdec.runtime.tokenizer import Tokenizer
    from specdec.runtime.weights import load_hf_dir

    args, state = load_hf_dir(smollm2_dir)
    return Transformer(args, state), Tokenizer.load(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """transformers' own GGUF loader (its own dequantisation and name mapping): the reference."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from specdec.runtime.hub import model_path

    hf_logging.set_verbosity_error()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = model_path("smollm2-135m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return m.eval()
