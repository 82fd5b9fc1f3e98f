"""The prepared-weights cache: a model's weights in the layout its kernels stream, written once and
memory-mapped on every later load.

Preparing a model (GGUF blocks repacked into panel records, fp32 matrices into panels, a draft
requantised to Q4_0) takes seconds to minutes, and done in memory it holds the checkpoint's tensors
beside the packed ones. The first load writes what it prepared to `$SPECDEC_CACHE/prepared/`
(torch's zip format: a temporary file, fsynced, renamed into place); every later load maps that
file (`torch.load(mmap=True)`: private file-backed pages, shared with the page cache and with every
other process that maps the same entry) instead of reading the checkpoint, so each weight is held
once and a load costs little more than opening a file. An embedding kept as stored is mapped too:
only the rows a prompt looks up are ever read.

An entry's name hashes everything its bytes depend on: the checkpoint's identity (a GGUF's
conversion key: size, mtime and sampled content; an HF directory's file names, sizes and mtimes),
the dtype, the part of the model, the kernel layout (specdec.runtime.kernels.packed_layout), the
gguf package's version (it requantises) and the source of the packing code, so a changed file,
CPU or packer never meets a stale entry. An entry that cannot be read is removed and rebuilt; a
cache that cannot be written costs the speed (a warning), never the load. Entries are never
rewritten in place (a new file is renamed over the old), so a process that maps an entry keeps
valid pages while another rebuilds it: a mapped file shrunk in place would fault on access.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from specdec.runtime import kernels
from specdec.runtime.kernels import quant
from specdec.runtime.model import Part, Transformer
from specdec.runtime.cache import cache_root, fsync
from specdec.runtime.weights import conversion_key

log = logging.getLogger(__name__)

VERSION = 1  # bump when an entry's structure changes
_PACKERS = (Path(kernels.__file__), Path(quant.__file__))  # their source is part of every key


def _dir_identity(path: Path) -> str:
    """An HF directory's identity: each file's name, size and mtime_ns."""
    parts = []
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        st = f.stat()
        parts.append(f"{f.name}|{st.st_size}|{st.st_mtime_ns}")
    return ";".join(parts)


def entry_path(source: Path, dtype: str, part: Part | None) -> Path | None:
    """Where the prepared weights of `source` (a GGUF file or an HF directory) at `dtype`
    ("native", "q4_0", "fp32", "bf16") live; None where this machine's kernels would not pack
    them (the torch fallback), so there is nothing to cache."""
    layout = kernels.packed_layout("native" if dtype in ("native", "q4_0") else dtype)
    if layout is None:
        return None
    source = Path(source).resolve()
    ident = conversion_key(source) if source.is_file() else _dir_identity(source)
    h = hashlib.sha256()
    for piece in (ident, dtype, json.dumps(asdict(part)) if part else "whole", layout, str(VERSION),
                  importlib.metadata.version("gguf")):
        h.update(piece.encode() + b"\0")
    for f in _PACKERS:
        h.update(f.read_bytes())
    return cache_root() / "prepared" / f"{source.stem}-{dtype}-{h.hexdigest()[:16]}.pt"


def load(entry: Path) -> Transformer | None:
    """The model in `entry`, its weights mapped from the file; None when there is no entry. An
    entry that cannot be read (truncated, or written by another torch) is removed, to be rebuilt."""
    if not entry.is_file():
        return None
    try:
        return Transformer.from_export(torch.load(entry, mmap=True, weights_only=True))
    except Exception as e:  # torch reports a bad zip or pickle with several exception types
        log.warning("prepared weights %s cannot be read (%s: %s); rebuilding them", entry, type(e).__name__, e)
        entry.unlink(missing_ok=True)
        return None


def save(entry: Path, model: Transformer) -> bool:
    """Write `model`'s prepared weights to `entry` (atomically: a temporary file renamed into
    place). False, with a warning, where there is nothing to save or the cache cannot be written."""
    state = model.export()
    if state is None:
        return False
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.name + ".tmp-")
        os.close(fd)
        torch.save(state, tmp)
        fsync(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache's entry from other users
        os.replace(tmp, entry)
        fsync(entry.parent)
        return True
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        log.warning("cannot write prepared weights to %s (%s); later loads will prepare them again",
                    entry, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
