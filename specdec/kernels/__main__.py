"""`python -m specdec.kernels`: build the C++ extension now and say whether it is usable."""

import logging

from . import _build_dir, build

logging.basicConfig(level=logging.WARNING, format="%(message)s")
ok = build() is not None
print(f"specdec.kernels: extension {'available' if ok else 'NOT available (torch fallback)'}"
      f" [cache: {_build_dir()}]")
