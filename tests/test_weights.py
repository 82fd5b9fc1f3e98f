"""GGUF reading (name mapping, q/k un-permutation, dequantisation) and every load error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_state, tiny_args
from specdec.errors import SpecdecError
from specdec.runtime.hub import REGISTRY, resolve_model, verify_file
from specdec.runtime.weights import read_gguf, resolve_checkpoint


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (rotate-half -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", qtype=None, state=None, args=None):
    from gguf import GGUFWriter
    from gguf.quants import quantize

    args = args or tiny_args("llama", vocab=64, dim=64, heads=2, kv_heads=1, inter=64)
    state = state or random_state(args, seed=9)
    w = GGUFWriter(str(path), arch=arch)
    w.add_block_count(args.n_layers)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_freq_base(args.rope_theta)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_context_length(args.max_seq_len)
    w.add_rope_dimension_count(args.head_dim)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    sub = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
           "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"}
    for hf, t in state.items():
        if hf in names:
            g = names[hf]
        else:
            _, _, i, rest = hf.split(".", 3)
            g = f"blk.{i}.{sub[rest]}"
        a = t.numpy().astype(np.float32)
        if g.endswith("attn_q.weight"):
            a = _permute(a, args.n_heads)
        elif g.endswith("attn_k.weight"):
            a = _permute(a, args.n_kv_heads)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(g, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return args, state


def test_gguf_f32_roundtrip_undoes_the_qk_permutation(tmp_path):
    args, state = write_tiny_gguf(tmp_path / "m.gguf")
    got_args, got = read_gguf(tmp_path / "m.gguf")
    assert (got_args.n_layers, got_args.n_heads, got_args.dim) == (args.n_layers, args.n_heads, args.dim)
    assert set(got) == set(state)
    for k in state:
        assert torch.equal(got[k], state[k]), k


def test_gguf_q8_0_dequantises_within_block_precision(tmp_path):
    from gguf import GGMLQuantizationType

    _, state = write_tiny_gguf(tmp_path / "q.gguf", qtype=GGMLQuantizationType.Q8_0)
    _, got = read_gguf(tmp_path / "q.gguf")
    for k in state:  # Q8_0: 8-bit codes with one fp16 scale per 32 values
        assert (got[k] - state[k]).abs().max() <= state[k].abs().max() / 100 + 1e-3, k


def test_unsupported_architecture_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "x.gguf", arch="mamba")
    with pytest.raises(SpecdecError, match="unsupported architecture 'mamba'"):
        read_gguf(tmp_path / "x.gguf")


def test_unsupported_tensor_type_is_named(tmp_path):
    from gguf import GGMLQuantizationType

    write_tiny_gguf(tmp_path / "t.gguf", qtype=GGMLQuantizationType.Q5_1)
    import specdec.runtime.weights as W

    types = tuple(t for t in W.SUPPORTED_TYPES if t != "Q5_1")
    orig = W.SUPPORTED_TYPES
    W.SUPPORTED_TYPES = types
    try:
        with pytest.raises(SpecdecError, match="unsupported tensor type Q5_1"):
            read_gguf(tmp_path / "t.gguf")
    finally:
        W.SUPPORTED_TYPES = orig


def test_truncated_and_missing_files(tmp_path):
    write_tiny_gguf(tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    for cut in (10, len(data) // 3, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(SpecdecError, match="corrupt or truncated"):
            read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(SpecdecError, match="corrupt or truncated"):
        read_gguf(tmp_path / "junk.gguf")
    with pytest.raises(SpecdecError, match="model file not found"):
        resolve_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(SpecdecError, match="unknown model"):
        resolve_model("nope")


def test_checksum_and_size_mismatch(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    with pytest.raises(SpecdecError, match="checksum mismatch"):
        verify_file(f, 3, "0" * 64)
    with pytest.raises(SpecdecError, match="size 3 bytes, expected 4"):
        verify_file(f, 4, "0" * 64)


def test_registry_file_verifies(smollm2_dir):
    from specdec.runtime.hub import model_path

    spec = REGISTRY["smollm2-135m"]
    verify_file(model_path("smollm2-135m"), spec.size, spec.sha256)
