"""Starting a pipeline (specdec.distributed.pipeline): rank 0's `launch(model, stages)`, the
rendezvous of the ranks, and `python -m specdec.distributed`, a stage other than rank 0.

Without RANK in the environment, `launch` starts ranks 1..N-1 itself, on this machine
(loopback). With RANK=0, WORLD_SIZE=N, MASTER_ADDR and MASTER_PORT set, the other ranks are
started by hand or by a launcher on their machines: `python -m specdec.distributed --model M
--pipeline-parallel N` with RANK=r.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specdec.distributed import add_pipeline_args
from specdec.distributed.pipeline import (IDLE_TIMEOUT, READY_TIMEOUT, PipelineTransformer, Ring, _reap, serve,
                                          split_layers, stage_part)
from specdec.errors import SpecdecError, check_int
from specdec.loader import default_device, load_model, model_args


# ---- launch ----------------------------------------------------------------------------------

@dataclass
class Rendezvous:
    """Where the ranks meet: MASTER_ADDR:MASTER_PORT (rank 0 hosts the store)."""

    rank: int
    world: int
    addr: str
    port: int
    procs: list = field(default_factory=list)  # ranks rank 0 started on this machine

    @staticmethod
    def from_env(world: int) -> "Rendezvous":
        try:
            rank, size = int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", world))
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError) as e:
            raise SpecdecError(f"pipeline rendezvous: RANK, MASTER_ADDR and MASTER_PORT must be set "
                               f"(integers where they are numbers) ({type(e).__name__}: {e})") from None
        if size != world or not 0 <= rank < world:
            raise SpecdecError(f"WORLD_SIZE={size}, RANK={rank} do not fit pipeline_parallel={world}; "
                               f"allowed: WORLD_SIZE={world}, RANK in [0, {world - 1}]", "pipeline_parallel")
        return Rendezvous(rank, world, addr, port)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_local(world: int, model: str, dtype: str, device: str, layers: list[int] | None,
                 threads: int) -> Rendezvous:
    """Ranks 1..world-1 as subprocesses of this one, meeting on loopback."""
    rv = Rendezvous(0, world, "127.0.0.1", _free_port())
    for r in range(1, world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   MASTER_ADDR=rv.addr, MASTER_PORT=str(rv.port))
        # the stages share these cores and take turns: idle OpenMP threads must sleep, not spin
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        cmd = [sys.executable, "-m", "specdec.distributed", "--model", model, "--dtype", dtype,
               "--device", device, "--threads", str(threads), "--pipeline-parallel", str(world)]
        if layers is not None:
            cmd += ["--pipeline-layers", ",".join(map(str, layers))]
        rv.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    return rv


def _device_for(rank: int, device: str) -> str:
    if device != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(local)
    return f"cuda:{local}"


def _join(rv: Rendezvous, device: str) -> Ring:
    """Wait until every rank has loaded its part (rank 0 watching the ranks it started: one that
    dies fails the launch at once), then form the process group."""
    store = dist.TCPStore(rv.addr, rv.port, rv.world, is_master=rv.rank == 0, timeout=READY_TIMEOUT,
                          wait_for_workers=False)
    store.set(f"ready/{rv.rank}", "1")
    deadline = time.monotonic() + READY_TIMEOUT.total_seconds()
    for r in range(rv.world):
        while not store.check([f"ready/{r}"]):  # (check: no wait, no timeout warnings)
            dead = [p for p in rv.procs if p.poll() is not None]
            if dead:
                _reap(rv.procs, 0)
                raise SpecdecError(f"a pipeline stage exited with code {dead[0].returncode} while "
                                   "loading its layers (its error is above)")
            if time.monotonic() > deadline:
                raise SpecdecError(f"pipeline rank {r} did not report ready within {READY_TIMEOUT}")
            time.sleep(0.1)
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rv.rank, world_size=rv.world,
                            timeout=IDLE_TIMEOUT)
    cmd_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if cuda else None
    return Ring(rv.rank, rv.world, torch.device(device), cmd_group)


def launch(model: str, stages: int, dtype: str = "auto", device: str | None = None,
           layers: list[int] | None = None, threads: int | None = None, progress=None):
    """Rank 0's side: (PipelineTransformer, Tokenizer), or a plain (Transformer, Tokenizer) for
    one stage. Without RANK in the environment the other ranks start here, on loopback, with
    `threads` torch threads each (default: this process's count); with RANK=0 they are started
    elsewhere (module doc). `layers`: how many layers each stage holds (default: split_layers)."""
    if dist.is_initialized():
        raise SpecdecError("a pipeline is already running in this process; close it first")
    args = model_args(model, progress)  # before starting anything: a bad name fails here
    ranges = split_layers(args, stages, layers)
    device = device or default_device()
    if stages == 1:
        return load_model(model, dtype, device, progress)
    if "RANK" in os.environ:
        rv = Rendezvous.from_env(stages)
        if rv.rank != 0:
            raise SpecdecError(f"RANK={rv.rank}: only rank 0 runs the engine; start the other ranks with "
                               "`python -m specdec.distributed`")
    else:
        rv = _spawn_local(stages, model, dtype, device, layers, threads or torch.get_num_threads())
    try:
        device = _device_for(0, device)
        part_model, tok = load_model(model, dtype, device, progress, part=stage_part(ranges, 0))
        ring = _join(rv, device)
    except BaseException:
        for p in rv.procs:
            p.kill()
        _reap(rv.procs)
        raise
    return PipelineTransformer(part_model, ring, ranges, rv.procs), tok


def run_stage(model: str, stages: int, dtype: str = "auto", device: str | None = None,
              layers: list[int] | None = None) -> None:
    """Ranks 1..N-1: load this rank's layers, join, serve until rank 0 closes the pipeline."""
    rv = Rendezvous.from_env(stages)
    if rv.rank == 0:
        raise SpecdecError("RANK=0 runs the engine (specdec generate / serve / bench --pipeline-parallel N)")
    device = _device_for(rv.rank, device or default_device())
    ranges = split_layers(model_args(model), stages, layers)
    part_model, _ = load_model(model, dtype, device, part=stage_part(ranges, rv.rank))
    ring = _join(rv, device)
    try:
        serve(part_model, ring)
    finally:
        dist.destroy_process_group()


# ---- command line ----------------------------------------------------------------------------

def parse_layers(text: str | None) -> list[int] | None:
    """"7,23" -> [7, 23] (each stage's layer count); None stays None (the automatic split)."""
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise SpecdecError(f"pipeline_layers={text!r} is not a comma-separated list of layer counts; "
                           "allowed e.g. 7,23", "pipeline_layers") from None


def main(argv=None) -> int:
    """A stage other than rank 0: `python -m specdec.distributed --model M --pipeline-parallel N`
    with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set."""
    ap = argparse.ArgumentParser(prog="python -m specdec.distributed", description=main.__doc__)
    ap.add_argument("--model", required=True, help="the same model rank 0 runs")
    ap.add_argument("--dtype", default="auto", help="the same dtype rank 0 runs")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_pipeline_args(ap)
    a = ap.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    try:
        run_stage(a.model, check_int("pipeline_parallel", a.pipeline_parallel, 2, None), a.dtype, a.device,
                  parse_layers(a.pipeline_layers))
    except SpecdecError as e:
        print(f"specdec pipeline stage: error: {e}", file=sys.stderr)
        return 2
    return 0
