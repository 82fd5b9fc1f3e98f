"""The benchmark scripts run as `python benchmarks/X.py`, which puts benchmarks/ first on sys.path:
a script named like a package a library probes for shadows it there.  (benchmarks/kernels.py did:
transformers imports `kernels` (the hub kernels package) when it finds one, found the script, and
the first GGUF tokenizer conversion of a cold cache died with an ImportError inside
transformers.activations, so `benchmarks/prefill.py` on a fresh machine never started.)"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("module", ["transformers.activations", "transformers.integrations.hub_kernels"])
def test_libraries_import_with_benchmarks_first_on_path(module):
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import {module}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_no_script_named_like_a_probed_package():
    taken = {"kernels", "transformers", "torch", "tokenizers", "safetensors", "gguf", "accelerate", "datasets"}
    names = {p.stem for p in BENCH.glob("*.py")}
    assert not names & taken, f"benchmarks/ scripts shadow packages: {sorted(names & taken)}"
