"""The prepared-weights cache (issue 26, load time and memory): a model mapped from its entry
computes the same bits as one prepared in memory; an entry never outlives what it was built from
(checkpoint, dtype, kernel layout, packing code); a bad entry is rebuilt and an unwritable cache
costs only the speed. Tiny GGUFs and HF directories keep each test near a second; the real
SmolLM2 checks the mapping on the shipped model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import specdec.runtime.weights as W
from specdec.loader import load_model
from specdec.runtime import kernels, prepared
from specdec.runtime.kernels.quant import QuantWeight
from specdec.runtime.model import RowEmbedding
from test_weights import write_tiny_gguf
from tiny_hf import write_tiny_hf

torch.set_num_threads(1)

needs_kernel = pytest.mark.skipif(not kernels.kernel_available(), reason="no C++ kernel here: nothing is cached")


def word_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer of a tiny GGUF (which has none): 64 words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "_gguf_tokenizer", word_tokenizer)
    return tmp_path / "cache"


def entries(cache: Path) -> list[Path]:
    d = cache / "prepared"
    return sorted(d.iterdir()) if d.is_dir() else []


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds t's memory (/proc/self/maps), or None for anonymous memory."""
    p = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= p < hi:
                return parts[5].strip() if len(parts) == 6 else None
    return None


def logits(model, seed: int = 0) -> torch.Tensor:
    """A 3-row batch: a prefill of 7 tokens, then 5 more (a verify-width forward)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, model.args.vocab_size, (3, 12), generator=g)
    cache = model.new_cache(3, 64)
    pos = torch.arange(12).expand(3, 12)
    a = model(toks[:, :7], pos[:, :7], cache)
    return torch.cat([a, model(toks[:, 7:], pos[:, 7:], cache)], 1)


SOURCES = {  # name -> (writer(tmp_path) -> checkpoint path, dtype)
    "native-Q8_0": (lambda p: write_tiny_gguf(p / "m.gguf", qtype=_qt("Q8_0")) and p / "m.gguf", "native"),
    "native-Q4_0": (lambda p: write_tiny_gguf(p / "m.gguf", qtype=_qt("Q4_0")) and p / "m.gguf", "native"),
    "q4_0-from-Q8_0": (lambda p: write_tiny_gguf(p / "m.gguf", qtype=_qt("Q8_0")) and p / "m.gguf", "q4_0"),
    "fp32-hf": (lambda p: write_tiny_hf(p / "hf", vocab=64, dim=64, heads=2, kv_heads=1, inter=64), "fp32"),
    "bf16-hf": (lambda p: write_tiny_hf(p / "hf", vocab=64, dim=64, heads=2, kv_heads=1, inter=64), "bf16"),
}


def _qt(name):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


@needs_kernel
@pytest.mark.parametrize("source", list(SOURCES))
def test_mapped_model_computes_the_same_bits(tmp_path, cache, source):
    write, dtype = SOURCES[source]
    path = str(write(tmp_path))
    ref, _ = load_model(path, dtype, "cpu", cache=False)
    assert entries(cache) == []  # cache=False writes nothing
    first, tok = load_model(path, dtype, "cpu")  # prepares, writes the entry, maps it
    (entry,) = entries(cache)
    second, _ = load_model(path, dtype, "cpu")  # maps the entry
    assert entries(cache) == [entry] and tok is not None
    want = logits(ref)
    for model in (first, second):
        assert torch.equal(logits(model), want)
        w = model.layers[0].wqkv
        assert mapped_file(w.packed[0] if isinstance(w, QuantWeight) else w.packed) == str(entry)
    if dtype in ("native", "q4_0"):  # the embedding kept as stored, its rows read from the mapping
        assert isinstance(second.embed, RowEmbedding)
        assert mapped_file(torch.from_numpy(second.embed.qt.raw)) == str(entry)


@needs_kernel
def test_an_entry_never_outlives_its_source(tmp_path, cache, monkeypatch):
    """A rewritten checkpoint, another dtype, another kernel layout or changed packing code each
    get their own entry; the rewritten checkpoint's model is the new file's."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtype=_qt("Q8_0"))
    base = prepared.entry_path(path, "native", None)
    assert prepared.entry_path(path, "native", None) == base
    assert prepared.entry_path(path, "q4_0", None) != base
    with monkeypatch.context() as m:
        layout = kernels.packed_layout
        m.setattr(kernels, "packed_layout", lambda dtype: "q6k" if layout(dtype) == "q6k2" else "q6k2")
        assert prepared.entry_path(path, "native", None) != base
    other = tmp_path / "packer.py"
    other.write_text("# a changed packer\n")
    with monkeypatch.context() as m:
        m.setattr(prepared, "_PACKERS", prepared._PACKERS + (other,))
        assert prepared.entry_path(path, "native", None) != base
    old, _ = load_model(str(path), "native", "cpu")
    from conftest import random_state, tiny_args

    args = tiny_args("llama", vocab=64, dim=64, heads=2, kv_heads=1, inter=64)
    write_tiny_gguf(path, qtype=_qt("Q8_0"), state=random_state(args, seed=10))
    assert prepared.entry_path(path, "native", None) != base
    new, _ = load_model(str(path), "native", "cpu")
    fresh, _ = load_model(str(path), "native", "cpu", cache=False)
    assert torch.equal(logits(new), logits(fresh)) and not torch.equal(logits(new), logits(old))


@needs_kernel
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_bad_entry_is_rebuilt(tmp_path, cache, caplog, damage):
    path = write_tiny_hf(tmp_path / "hf", vocab=64, dim=64, heads=2, kv_heads=1, inter=64)
    ref, _ = load_model(path, "fp32", "cpu")
    (entry,) = entries(cache)
    data = entry.read_bytes()
    bad = tmp_path / "bad"  # a new file in its place: `ref` still maps the old one, whose pages
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a zip file" * 100)
    bad.replace(entry)  # an entry shrunk in place would fault every process mapping it (SIGBUS)
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.prepared"):
        again, _ = load_model(path, "fp32", "cpu")
    assert "cannot be read" in caplog.text and "rebuilding" in caplog.text
    assert entries(cache) == [entry] and entry.read_bytes() != b"not a zip file" * 100
    assert torch.equal(logits(again), logits(ref))


@needs_kernel
def test_an_unwritable_cache_costs_only_the_speed(tmp_path, cache, caplog):
    path = write_tiny_hf(tmp_path / "hf", vocab=64, dim=64, heads=2, kv_heads=1, inter=64)
    cache.mkdir(parents=True)
    (cache / "prepared").write_text("a file where the directory would go")
    with caplog.at_level(logging.WARNING, logger="specdec.runtime.prepared"):
        model, _ = load_model(path, "fp32", "cpu")
    assert "cannot write prepared weights" in caplog.text
    ref, _ = load_model(path, "fp32", "cpu", cache=False)
    assert torch.equal(logits(model), logits(ref))
    assert not any(p.name.startswith(".") or ".tmp-" in p.name for p in cache.iterdir())


def test_the_torch_fallback_caches_nothing(tmp_path, cache, monkeypatch):
    """Without the kernels the fallback holds dense fp32 weights: nothing to map."""
    monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    path = write_tiny_hf(tmp_path / "hf", vocab=64, dim=64, heads=2, kv_heads=1, inter=64)
    assert prepared.entry_path(Path(path), "fp32", None) is None
    load_model(path, "fp32", "cpu")
    assert entries(cache) == []


def test_a_native_gguf_converts_only_its_tokenizer(tmp_path, cache, monkeypatch):
    """Run at its own quantisation, a GGUF never has its weights converted to fp32."""
    monkeypatch.setattr(W, "read_gguf", lambda *a: pytest.fail("fp32 conversion of a native model"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, qtype=_qt("Q8_0"))
    model, tok = load_model(str(path), "native", "cpu")
    assert tok.encode("w3 w5") == [3, 5]
    assert not (cache / "converted").exists() and len(list((cache / "tokenizers").iterdir())) == 1


@needs_kernel
def test_smollm2_mapped_equals_prepared_in_memory(tmp_path, monkeypatch):
    """The shipped model (Q4_1 layers, a Q8_0 tied head) through the registry, mapped from a fresh
    cache's entry, against the same model prepared in memory."""
    from specdec.runtime.hub import model_path

    gguf = str(model_path("smollm2-135m"))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    ref, tok = load_model(gguf, "native", "cpu", cache=False)
    load_model(gguf, "native", "cpu")
    mapped, tok2 = load_model(gguf, "native", "cpu")
    (entry,) = entries(tmp_path / "cache")
    assert mapped_file(mapped.lm_head.packed[0]) == str(entry)
    ids = torch.tensor([tok.encode_prompt("def fibonacci(n):")])
    assert tok2.encode_prompt("def fibonacci(n):") == ids[0].tolist()
    pos = torch.arange(ids.shape[1])[None]
    assert torch.equal(mapped(ids, pos, mapped.new_cache(1, 128)), ref(ids, pos, ref.new_cache(1, 128)))
