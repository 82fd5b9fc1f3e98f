"""The cache directory ($SPECDEC_CACHE): where it is, a clear error where it cannot be written, and
fsync for the atomic writes every cache entry is made with (a temporary beside its final place,
flushed, then renamed)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from specdec.errors import SpecdecError


def cache_root() -> Path:
    """$SPECDEC_CACHE (unset or empty: ~/.cache/specdec)."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec").expanduser()


def cache_error(path: Path, e: OSError) -> SpecdecError:
    """The one-line error for a cache path that cannot be created or written (permissions, a file
    in the way, a read-only or full disk)."""
    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    todo = "free space there or set SPECDEC_CACHE to a directory with room" if full else \
        "set SPECDEC_CACHE to a writable directory"
    return SpecdecError(f"cannot write the cache at {path} ({e.strerror or type(e).__name__}); {todo}")


def writable_cache_dir(*parts: str) -> Path:
    """cache_root()/parts, created and probed with a temporary file: a SpecdecError up front,
    before any slow work, where the cache cannot be written."""
    d = cache_root().joinpath(*parts)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise cache_error(d, e) from None
    return d


def fsync(path: Path, tree: bool = False) -> None:
    """Flush a file or a directory entry (with tree: also every file under the directory)."""
    for p in ([f for f in path.rglob("*") if f.is_file()] + [path]) if tree else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
