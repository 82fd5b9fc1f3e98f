"""Building the C++ extensions of this folder: CPU check, compile flags, the on-disk build cache,
and the matmul extension itself (built at most once per process, even if it failed)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("specdec.runtime.kernels")

_DIR = Path(__file__).parent
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # linear.cpp, qlinear.cpp

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
    return Path(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")).expanduser() / "ext"


def load_extension(name: str, sources: list[str], verbose: bool = False, cflags: list[str] = CFLAGS):
    """Compile/load one C++ extension from this folder (cached on disk); None on failure."""
    try:  # (cpp_extension needs setuptools and ninja: a missing one is a build failure too)
        from torch.utils import cpp_extension

        # ninja lives next to the interpreter in a venv that was not activated.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        bdir = build_dir() / name
        bdir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(_DIR / s) for s in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
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
