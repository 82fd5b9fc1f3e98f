"""Peak memory of one fresh process (or pipeline) that loads a model and decodes a few steps.

    python tests/pipeline_probe.py single|rows|pipeline MODEL [STAGES]

single: one process, the model as `specdec generate` loads it; rows: one process with the
embedding kept as stored (Part.embed_rows, the default for a block-quantised one); pipeline: STAGES
processes (rank 0 here, the rest started by specdec.distributed.launch.launch). Prints one JSON
line: {"base_mb": peak RSS after the imports and the kernel builds, "peak_mb": [peak RSS per
process, rank 0 first], "weights_mb": [weights each holds]}. Run by tests/test_pipeline.py and
benchmarks/pipeline.py: a fresh process per measurement, since a peak never goes down.
"""

from __future__ import annotations

import json
import sys

import torch

from specdec.distributed import launch, pipeline
from specdec.loader import load_model, model_args
from specdec.runtime import kernels
from specdec.runtime.kernels import fused
from specdec.runtime.model import Part


def decode(model, steps: int = 4) -> None:
    cache = model.new_cache(1, 256)
    model.forward(torch.arange(16).view(1, 16), torch.arange(16).view(1, 16), cache)
    for i in range(steps):
        model.forward(torch.tensor([[7]]), torch.tensor([[16 + i]]), cache)


def main(mode: str, name: str, stages: int = 2) -> None:
    torch.set_num_threads(1)
    kernels.build()
    fused.build()
    base = pipeline.max_rss_mb()
    if mode == "pipeline":
        model, _ = launch.launch(name, stages, threads=1)
        decode(model)
        stats = model.stats()
        model.close()
        peaks, weights = [s.max_rss_mb for s in stats], [s.weights_mb for s in stats]
    else:
        part = Part(0, model_args(name).n_layers, embed_rows=True) if mode == "rows" else None
        model, _ = load_model(name, part=part)
        decode(model)
        peaks, weights = [pipeline.max_rss_mb()], [model.weight_bytes() / 2**20]
    print(json.dumps({"mode": mode, "model": name, "base_mb": base, "peak_mb": peaks,
                      "weights_mb": weights}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
