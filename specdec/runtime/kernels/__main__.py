"""`python -m specdec.runtime.kernels`: build the C++ extensions now and say whether they are usable."""

import logging

from . import build
from .extension import build_dir
from .quant import _qext

logging.basicConfig(level=logging.WARNING, format="%(message)s")
ok = build() is not None
qok = ok and _qext() is not None
print(f"specdec.runtime.kernels: extension {'available' if ok else 'NOT available (torch fallback)'}, "
      f"quantised extension {'available' if qok else 'NOT available (torch fallback)'}"
      f" [cache: {build_dir()}]")

from .fused import build as build_fused  # noqa: E402 -- the per-layer glue, its own extension

print(f"specdec.runtime.kernels: fused glue extension "
      f"{'available' if build_fused() is not None else 'NOT available (torch fallback)'}")
