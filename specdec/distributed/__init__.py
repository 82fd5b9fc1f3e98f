"""Running one model over several processes (pipeline parallel: pipeline.py, docs/distributed.md).

The command-line flags live here, apart from pipeline.py, so that building the CLI's parser does
not import torch.distributed."""

from __future__ import annotations

import argparse

from specdec.errors import lenient_int


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline-parallel", type=lenient_int, default=1, metavar="N",
                   help="split the target's layers over N processes (torch.distributed: gloo on CPU, "
                        "NCCL on CUDA); started here on loopback, or across machines with RANK, "
                        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (docs/distributed.md)")
    p.add_argument("--pipeline-layers", default=None, metavar="N,N,...",
                   help="layers per stage, rank 0 first (default: about equal memory per process)")
