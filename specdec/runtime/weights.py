"""Checkpoint loading: GGUF files and Hugging Face directories, and the conversion cache.

A GGUF is dequantised to fp32 through the `gguf` package, its tensor names are mapped to Hugging
Face names (undoing llama.cpp's q/k row permutation for the llama architecture), its tokenizer is
rebuilt from the metadata (via transformers' GGUF converter), and the result is written once as a
Hugging Face-style directory under `$SPECDEC_CACHE/converted/` (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json). Later loads read that directory, which takes well under a
second for SmolLM2-135M. A GGUF run at its own quantisation needs only its config and tokenizer
converted (`$SPECDEC_CACHE/tokenizers/`: seconds, not the minute and gigabytes of fp32 weights).
Every user-visible failure is a one-line `SpecdecError`.

Nothing non-finite gets past loading: every dequantised or converted tensor is checked finite,
and a block-quantised matrix kept as stored has its fp16 scale fields checked (the codes are
integers, so finite scales mean finite weights). The conversion cache is keyed by the file's
identity (size, mtime_ns and a sampled content hash) and only ever holds complete conversions:
each is built in a temporary directory beside its final place, fsynced, then renamed into place;
a failure of any kind (corrupt tensor, Ctrl-C, full disk) removes the temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from specdec.config import ModelArgs
from specdec.errors import SpecdecError
from specdec.runtime.cache import cache_error, cache_root, fsync
from specdec.runtime.kernels.quant import QUANT_TYPES, QuantTensor

SUPPORTED_ARCHS = ("llama", "qwen2")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
CONVERSION_VERSION = 2  # bump when the converted layout changes (2: finiteness checked, content key)
# A conversion writes its fp32 weights in shards of about this many bytes (a larger tensor is a
# shard of its own), so it holds about one shard at a time, not the whole dequantised model
# (Qwen2.5 1.5B: 6.8 GB of fp32, twice over while one file was serialised).
SHARD_BYTES = 512 << 20

# Byte offsets of the fp16 scale fields (d, and m / dmin where the format has one) in one block:
# everything else in a block is an integer code or an integer sub-scale.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
assert set(SCALE_OFFSETS) == set(QUANT_TYPES)


def count_nonfinite(w) -> int:
    """Non-finite values in a numpy array or torch tensor. A finite sum proves them all finite
    (one pass, no temporary); only a non-finite sum (or an overflowing one) is counted exactly."""
    if isinstance(w, torch.Tensor):
        if not w.is_floating_point() or torch.isfinite(w.sum()):
            return 0
        return int(w.numel() - torch.isfinite(w).sum())
    if w.dtype.kind != "f" or np.isfinite(w.sum()):
        return 0
    return int(w.size - np.count_nonzero(np.isfinite(w)))


def count_bad_scales(qt: QuantTensor) -> int:
    """Non-finite fp16 scale fields (exponent bits 0x7C00 all ones: inf or NaN) in a block-
    quantised matrix, read straight from its bytes: the exponent lies in the high (second,
    little-endian) byte, so one strided uint8 column per field, no dequantisation."""
    blocks = qt.raw.reshape(-1, QUANT_TYPES[qt.qtype].tsize)  # [blocks, bytes per block]
    return sum(int(np.count_nonzero((blocks[:, o + 1] & 0x7C) == 0x7C)) for o in SCALE_OFFSETS[qt.qtype])


def _gguf_name_to_hf(name: str) -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    if not name.startswith("blk."):
        return None  # e.g. rope_freqs: not used for plain RoPE
    _, layer, rest = name.split(".", 2)
    sub = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }.get(rest)
    return None if sub is None else f"model.layers.{layer}.{sub}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k rows (interleaved -> rotate-half RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise SpecdecError(f"model file not found: {path}")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct errors on bad files
        raise SpecdecError(f"cannot read GGUF {path}: corrupt or truncated file ({type(e).__name__}: {e})") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _gguf_args(reader, path: Path) -> tuple[ModelArgs, dict]:
    """(ModelArgs, {gguf tensor name: ReaderTensor}) from a GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SpecdecError(f"unsupported architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHS)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    dim = int(g("embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise SpecdecError(f"GGUF {path} has no token_embd.weight tensor: not a language model")
    vocab = int(tensors["token_embd.weight"].shape[1])
    args = ModelArgs(
        arch=arch, vocab_size=vocab, dim=dim, n_layers=int(g("block_count")), n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=int(g("rope.dimension_count", dim // n_heads)),
        intermediate_size=int(g("feed_forward_length")), rope_theta=float(g("rope.freq_base", 10000.0)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(g("context_length", 2048)), tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )
    return args, tensors


def _gguf_tensors(path: Path, convert, keep=None) -> tuple[ModelArgs, dict]:
    """Map each GGUF tensor to its Hugging Face name through convert(name, tensor, shape [N, K]),
    then undo llama.cpp's q/k row permutation for the llama architecture (rows are independent
    in every block format, so this works on quantised rows too). keep(HF name): which tensors
    to read at all (None: every one); the others are neither converted nor checked."""
    args, tensors = _iter_gguf_tensors(path, convert, keep)
    return args, dict(tensors)


def _iter_gguf_tensors(path: Path, convert, keep=None):
    """_gguf_tensors one tensor at a time: (ModelArgs, an iterator of (HF name, tensor)), each
    converted and checked as the iterator reaches it."""
    args, tensors = _gguf_args(_open_gguf(path), path)
    return args, _each_tensor(path, args, tensors, convert, keep)


def _each_tensor(path: Path, args: ModelArgs, tensors: dict, convert, keep):
    for name, t in tensors.items():
        hf = _gguf_name_to_hf(name)
        if hf is None or (keep is not None and not keep(hf)):
            continue
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise SpecdecError(f"unsupported tensor type {t.tensor_type.name} for {name} in {path}; "
                               f"supported: {', '.join(SUPPORTED_TYPES)}")
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # corrupt scales: reported below
                w = convert(name, t, tuple(int(s) for s in reversed(t.shape)))
        except Exception as e:
            raise SpecdecError(f"cannot read {name} ({t.tensor_type.name}) in {path}: "
                               f"corrupt or truncated file ({e})") from None
        quant = isinstance(w, QuantTensor)
        bad = count_bad_scales(w) if quant else count_nonfinite(w)
        if bad:
            what = "block scales" if quant else "values after dequantisation"
            raise SpecdecError(f"{path}: tensor {name!r} ({t.tensor_type.name}) has {bad} non-finite "
                               f"{what}; the file is corrupt")
        if args.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = args.n_heads if "attn_q" in name else args.n_kv_heads
            w = (replace(w, raw=np.ascontiguousarray(_unpermute(w.raw, heads)))
                 if isinstance(w, QuantTensor) else _unpermute(w, heads))
        yield hf, w


def _dequantised(name, t, shape) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)


def _owned(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # owns its memory


def read_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Dequantise a GGUF into (ModelArgs, fp32 state dict with Hugging Face names)."""
    args, state = _gguf_tensors(path, _dequantised)
    return args, {k: _owned(w) for k, w in state.items()}


def write_shards(out: Path, tensors) -> list[str]:
    """(name, fp32 array) pairs into safetensors files in `out`, about SHARD_BYTES each and
    written as they fill (so about one shard is held at a time): one file is model.safetensors;
    several are model-0000i-of-0000n.safetensors with the index transformers reads
    (model.safetensors.index.json). Returns the file names."""
    from safetensors.torch import save_file

    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        if shard:
            part = out / f"part-{len(parts)}.safetensors.tmp"
            save_file(shard, str(part), metadata={"format": "pt"})
            parts.append((part, list(shard)))
            shard.clear()

    for name, w in tensors:
        t = _owned(w)
        if shard and size + t.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    n = len(parts)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for (part, _), name in zip(parts, names):
        part.rename(out / name)
    if n > 1:
        weight_map = {key: name for (_, held), name in zip(parts, names) for key in held}
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def read_gguf_native(path: Path, keep=None) -> tuple[ModelArgs, dict]:
    """A GGUF's tensors as stored, straight from the file: (ModelArgs, {HF name: QuantTensor for
    the block-quantised matrices the kernel runs (kernels.QUANT_TYPES), fp32 tensor otherwise}).
    keep(HF name): only the tensors it is true for (a pipeline stage's part of the model)."""
    from gguf.quants import dequantize

    def convert(name, t, shape):
        if t.tensor_type.name in QUANT_TYPES and len(shape) == 2:  # [N, bytes per row], file-backed
            return QuantTensor(t.tensor_type.name, np.asarray(t.data).reshape(shape[0], -1), shape)
        return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)

    args, state = _gguf_tensors(Path(path), convert, keep)
    return args, {k: w if isinstance(w, QuantTensor) else torch.from_numpy(np.array(w, dtype=np.float32))
                  for k, w in state.items()}


def _gguf_tokenizer(path: Path, out_dir: Path) -> None:
    """Rebuild the tokenizer (and chat template) from GGUF metadata into out_dir."""
    import logging
    import warnings

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out_dir))


def content_hash(path: Path, whole: int = 8 << 20, samples: int = 64, chunk: int = 64 << 10) -> str:
    """sha256 of a file up to `whole` bytes; of a larger one, its first MiB (header, metadata and
    tensor table) and `samples` chunks spread evenly over the rest (~5 MiB read: a few ms, where
    the whole 1.1 GB Qwen 1.5B would take ~1 s on every load)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= whole:
            h.update(f.read())
            return h.hexdigest()
        h.update(f.read(1 << 20))
        for i in range(1, samples + 1):
            f.seek((size - chunk) * i // samples)
            h.update(f.read(chunk))
    return h.hexdigest()


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError:  # e.g. a cache directory we may not even look into
        return False


def conversion_key(path: Path) -> str:
    """The cache entry name of a GGUF: its stem and a hash of its identity. Size and mtime_ns
    change on every ordinary rewrite; the content hash catches a different file put in place
    with its size and mtime preserved (cp -p, rsync -t, tar)."""
    st = path.stat()
    ident = f"{st.st_size}|{st.st_mtime_ns}|{content_hash(path)}|{CONVERSION_VERSION}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def convert_gguf(path: Path, progress=None, weights: bool = True) -> Path:
    """Convert a GGUF into a cached HF-style directory (once) and return that directory.
    weights False: its config and tokenizer only (the entry of a model run from the GGUF
    itself; a whole conversion, where one exists already, serves as well)."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"model file not found: {path}")
    key = conversion_key(path)
    whole = cache_root() / "converted" / key
    if _is_file(whole / "DONE"):
        return whole  # a read-only cache still serves what it holds
    parent = whole.parent if weights else cache_root() / "tokenizers"
    out = parent / key
    if _is_file(out / "DONE"):
        return out
    from safetensors import SafetensorError

    try:  # the temporary directory is the writability check: before the seconds of reading
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=out.name + ".tmp-"))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache's entry from other users
    except OSError as e:
        raise cache_error(parent, e) from None
    try:
        if progress:
            what = path.name if weights else f"the tokenizer of {path.name}"
            progress(f"converting {what} to {out} (once)")
        if weights:  # dequantised and checked tensor by tensor, as the shards are written
            args, tensors = _iter_gguf_tensors(path, _dequantised)
        else:
            args = _gguf_args(_open_gguf(path), path)[0]
        try:
            if weights:
                write_shards(tmp, tensors)
            (tmp / "config.json").write_text(json.dumps(args.to_hf_config(), indent=1))
            _gguf_tokenizer(path, tmp)
            (tmp / "DONE").write_text(str(path.resolve()))
            fsync(tmp, tree=True)
        except OSError as e:  # named by the entry being written: its temporary is removed
            raise cache_error(out, e) from None
        except SafetensorError as e:  # how safetensors reports a failed write (a full disk)
            raise SpecdecError(f"cannot write the cache at {out} ({e}); free space there or set "
                               "SPECDEC_CACHE to a directory with room") from None
        if out.exists():  # a stale entry without DONE, or one another process has just finished
            if _is_file(out / "DONE"):
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            shutil.rmtree(out)
        os.rename(tmp, out)
        fsync(parent)  # the rename itself
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


class LazyTensors(Mapping):
    """name -> tensor over *.safetensors files, read on access: loading a model never holds the
    whole checkpoint and the packed weights in memory at once. With check_finite, each tensor
    read is checked finite (one sum per tensor: ~0.2 s on a 1 s fp32 load of SmolLM2-135M)."""

    def __init__(self, files: list[Path], check_finite: bool = True):
        from safetensors import safe_open

        self.check_finite = check_finite
        self._where = {}  # name -> file
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    self._where.update(dict.fromkeys(h.keys(), f))
            except Exception as e:
                raise SpecdecError(f"cannot read {f}: corrupt or truncated file ({e})") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        try:
            f = self._where[name]
        except KeyError:
            raise KeyError(name) from None
        try:  # a file opened per tensor: its mapping (pages read so far) goes with it
            with safe_open(str(f), framework="pt") as h:
                t = h.get_tensor(name)
        except Exception as e:
            raise SpecdecError(f"cannot read tensor {name} in {f}: corrupt or truncated file ({e})") from None
        bad = count_nonfinite(t) if self.check_finite else 0
        if bad:
            raise SpecdecError(f"{f}: tensor {name!r} has {bad} non-finite values; the file is corrupt")
        return t

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_config(path: Path) -> ModelArgs:
    """The model's shape from an HF-style directory's config.json."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise SpecdecError(f"model directory {path} has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{cfg_file} is not valid JSON ({e})") from None
    return ModelArgs.from_hf_config(cfg)


def load_hf_dir(path: Path) -> tuple[ModelArgs, Mapping[str, torch.Tensor]]:
    path = Path(path)
    args = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecdecError(f"model directory {path} has no *.safetensors files")
    # a conversion of ours (DONE written last) was checked finite when it was written
    return args, LazyTensors(files, check_finite=not (path / "DONE").is_file())


def resolve_checkpoint(path: Path, progress=None, weights: bool = True) -> Path:
    """A GGUF file or an HF directory -> an HF-style directory we can load quickly (weights
    False: for a GGUF, its config and tokenizer only)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path
    if not path.exists():
        raise SpecdecError(f"model file not found: {path}")
    if path.suffix.lower() != ".gguf":
        raise SpecdecError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face directory")
    return convert_gguf(path, progress, weights)
