"""Building the C++ extensions of this folder: CPU check, compile flags, the on-disk build cache,
and the matmul extension itself (built at most once per process, even if it failed).

Each build lives in `$SPECDEC_CACHE/ext/<name>-<key>`, the key a hash of the sources, the flags,
the torch install and the Python version, and compiles copies of the sources staged in that
directory: two checkouts with different sources (or flags, or venvs) build in different
directories, and two with the same ones share a build whose ninja command lines do not depend on
where either checkout lives, so neither ever rebuilds the other's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("specdec.runtime.kernels")

_DIR = Path(__file__).parent
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # linear.cpp, qlinear.cpp
LDFLAGS = ["-fopenmp"]

_linear = None
_linear_tried = False


def cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return {"avx2", "fma"} <= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    # Not Linux: torch's dispatch level AVX2 or above implies AVX2+FMA.
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build_dir() -> Path:
    """The folder holding every extension's build directories, symlinks resolved: ninja's build
    file records absolute paths, so one build reached by two paths would be rebuilt by each."""
    return (Path(os.environ.get("SPECDEC_CACHE") or "~/.cache/specdec").expanduser() / "ext").resolve()


def build_key(sources: list[Path], cflags: list[str], ldflags: list[str] = LDFLAGS) -> str:
    """A hash of what a build depends on besides the system: the sources' names and bytes, the
    flags, the compiler asked for, and the torch and Python it links against."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.name.encode() + b"\0" + s.read_bytes() + b"\0")
    h.update(repr((cflags, ldflags, os.environ.get("CXX"), torch.__version__,
                   os.path.dirname(torch.__file__), sys.version)).encode())
    return h.hexdigest()[:16]


def _stage(src: Path, bdir: Path) -> Path:
    """src copied into bdir (atomically, and only once: ninja rebuilds on a newer mtime)."""
    dst = bdir / src.name
    data = src.read_bytes()
    if not dst.is_file() or dst.read_bytes() != data:
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return dst


def load_extension(name: str, sources: list[str], verbose: bool = False, cflags: list[str] = CFLAGS):
    """Compile/load one C++ extension from this folder (cached on disk); None on failure."""
    srcs = [_DIR / s for s in sources]
    bdir = build_dir() / f"{name}-{build_key(srcs, cflags)}"
    try:
        bdir.mkdir(parents=True, exist_ok=True)
        staged = [_stage(s, bdir) for s in srcs]
    except OSError as e:
        log.warning("specdec.runtime.kernels: cannot write the build cache at %s (%s); set SPECDEC_CACHE "
                    "to a writable directory; using the torch fallback", bdir, e.strerror)
        return None
    try:  # (cpp_extension needs setuptools and ninja: a missing one is a build failure too)
        from torch.utils import cpp_extension

        # ninja lives next to the interpreter in a venv that was not activated.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        # torch guards a build with a "lock" file that a killed build (Ctrl-C during the first
        # minute) leaves behind, and every later process then waits for it forever. Builders
        # here take an flock first, which the kernel releases when its holder dies; whoever
        # holds it knows a "lock" file is stale.
        try:
            held = open(bdir / ".build-flock", "a")
        except OSError:  # a read-only cache: its builds were made elsewhere, nothing to guard
            held = contextlib.nullcontext()
        with held:
            if not isinstance(held, contextlib.nullcontext):
                fcntl.flock(held, fcntl.LOCK_EX)
                (bdir / "lock").unlink(missing_ok=True)
            return cpp_extension.load(
                name=name,
                sources=[str(s) for s in staged],
                extra_cflags=list(cflags),  # copies: torch appends its own flags to these lists
                extra_ldflags=list(LDFLAGS),
                build_directory=str(bdir),
                verbose=verbose,
            )
    except Exception as e:  # noqa: BLE001 -- any build failure means "fall back"
        lines = str(e).strip().splitlines()
        log.warning("specdec.runtime.kernels: %s build failed, using the torch fallback: %s",
                    name, lines[-1] if lines else type(e).__name__)
        return None


def linear_extension(verbose: bool = False):
    """The fp32/bf16 matmul extension (linear.cpp), or None where it cannot build or run."""
    global _linear, _linear_tried
    if _linear is None and not _linear_tried:
        _linear_tried = True
        if not cpu_has_avx2_fma():
            log.warning("specdec.runtime.kernels: CPU lacks AVX2+FMA; using the torch fallback")
        else:
            _linear = load_extension("specdec_linear", ["linear.cpp"], verbose)
    return _linear
