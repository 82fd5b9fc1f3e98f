"""Pipeline parallel over torch.distributed: a model's layers split over N processes, one engine.

Rank 0 runs everything that is not a layer: the engine, the proposer (a draft model too), the
token embedding and the output head, and it holds the first range of layers. Ranks 1..N-1 each
hold the next range and that range's KV, and serve rank 0's commands (`serve`). A forward goes
round the ring:

    rank 0: embed, layers [0, l1)  -- x [B, T, dim] -->  rank 1: layers [l1, l2)  --> ...
    rank N-1: layers [.., L), final norm  -- hidden [B, n, dim] -->  rank 0: output head

x is the residual stream after a stage's last layer, that layer's MLP output added: the fp32 add
the next stage's first norm would have done, so every stage computes its layers exactly as one
process does and the logits are bit-identical to a single process (tests/test_pipeline.py). The
head sits on rank 0, so what crosses between processes is dim * 4 bytes a token each hop (only
the positions that need logits on the way back), never V * 4 bytes of logits.

Rank 0's model is a `PipelineTransformer`, with the Transformer's interface (args, device,
forward, new_cache), so the engine, prefill and the tools drive it unchanged. Its caches
(`StageCache`) hold rank 0's layers; the other stages mirror each one (creation, copy_prefix,
release) by command. Cache lengths are host bookkeeping that no forward reads (positions say
where to write and what to see), so they stay on rank 0 with the engine that moves them.

The stages of a forward run one after another: splitting a decode step's rows into micro-batches
would make every stage stream its weights once per micro-batch. Pipeline parallel here buys
memory per process (a model larger than one machine), not speed; docs/distributed.md.

Launch (specdec.distributed.launch): `launch(model, stages)` on rank 0. Without RANK in the environment it starts ranks
1..N-1 itself, on this machine (loopback). With RANK=0, WORLD_SIZE=N, MASTER_ADDR and
MASTER_PORT set, the other ranks are started by hand or by a launcher on their machines:
`python -m specdec.distributed --model M --pipeline-parallel N` with RANK=r.
"""

from __future__ import annotations

import atexit
import itertools
import pickle
import resource
import subprocess
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from specdec.config import ModelArgs
from specdec.errors import SpecdecError, check_int
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.model import Part, Transformer, select_positions

HEADER = 2048  # bytes of a command message: a length, then the pickled command (the rest follows)
READY_TIMEOUT = timedelta(minutes=30)  # for every rank to load its part and report ready
IDLE_TIMEOUT = timedelta(days=365)  # a served pipeline may wait between requests for long


# ---- the split ------------------------------------------------------------------------------

def split_layers(args: ModelArgs, stages: int, layers: list[int] | None = None) -> list[tuple[int, int]]:
    """[first, last) per stage. layers: how many each stage holds (summing to n_layers); by
    default about equal weights per process, rank 0 also holding the embedding (as stored) and
    the output head, counted as 2 V dim parameters against a layer's attention + MLP ones."""
    L = args.n_layers
    check_int("pipeline_parallel", stages, 1, L)
    if layers is None:
        a = args
        per_layer = a.dim * (2 * a.n_heads + 2 * a.n_kv_heads) * a.head_dim + 3 * a.dim * a.intermediate_size
        extra = 2 * a.vocab_size * a.dim / per_layer  # rank 0's embedding + head, in layers
        share = (L + extra) / stages
        bounds = [0]
        for i in range(1, stages):
            bounds.append(min(max(round(i * share - extra), bounds[-1] + 1), L - (stages - i)))
        bounds.append(L)
        layers = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    if len(layers) != stages or any(not isinstance(n, int) or n < 1 for n in layers) or sum(layers) != L:
        raise SpecdecError(f"pipeline_layers={','.join(map(str, layers))} is not a split of the model's "
                           f"{L} layers over {stages} stages; allowed: {stages} counts >= 1 summing to {L}",
                           "pipeline_layers")
    ends = list(itertools.accumulate(layers))
    return [(e - n, e) for n, e in zip(layers, ends)]


def stage_part(ranges: list[tuple[int, int]], rank: int) -> Part:
    """Rank 0: the embedding (block-quantised rows kept as stored), its layers and the head;
    the last rank: its layers and the final norm; any other: its layers only."""
    first, last = ranges[rank]
    return Part(first, last, embed=rank == 0, norm=rank == len(ranges) - 1, head=rank == 0)


# ---- messages --------------------------------------------------------------------------------

@dataclass
class Command:
    """What rank 0 asks of every other stage; it travels down the ring ahead of the activations."""

    op: str  # "forward" | "new_cache" | "copy_prefix" | "ping" | "stats" | "shutdown"
    cache: int = -1  # a StageCache's id
    args: tuple = ()  # new_cache: (batch, max_seq_len, headroom); copy_prefix: (src, dst, n);
    # ping: (shape,); stats: (reset,)
    positions: np.ndarray | None = None  # forward: [B, T] int64
    rows: np.ndarray | None = None  # [B] cache rows, None for 0..B-1
    mask: np.ndarray | None = None  # [B, T, T] bool, None for causal
    back: np.ndarray | None = None  # [B, n]: positions whose final hidden states rank 0 needs; None: all T
    free: tuple = ()  # ids of caches rank 0 has dropped


@dataclass
class StageStats:
    """One rank's counters since the last reset."""

    rank: int
    compute_s: float = 0.0  # its layers (rank 0: also embedding and head)
    forwards: int = 0
    sent_bytes: int = 0  # activations sent
    wall_s: float = 0.0  # rank 0: whole forwards, communication included
    max_rss_mb: float = 0.0  # peak resident memory of the process (max_rss_mb)
    weights_mb: float = 0.0  # the weights its part holds (Transformer.weight_bytes)

    def reset(self) -> "StageStats":
        return StageStats(self.rank, weights_mb=self.weights_mb)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.cpu().numpy()


def _tensor(a: np.ndarray | None, device) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a).to(device)


class Ring:
    """This rank's links: pickled commands over gloo (one message when short), activations over
    the default group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, rank: int, world: int, device: torch.device, cmd_group=None):
        self.rank, self.world, self.device, self.cmd_group = rank, world, device, cmd_group
        self.next, self.prev = (rank + 1) % world, (rank - 1) % world
        self.stats = StageStats(rank)

    def send_command(self, obj, dst: int) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = bytearray(HEADER)
        head[:8] = len(data).to_bytes(8, "little")
        first = data[: HEADER - 8]
        head[8: 8 + len(first)] = first
        dist.send(torch.frombuffer(head, dtype=torch.uint8), dst, group=self.cmd_group)
        if len(data) > len(first):
            rest = torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8)
            dist.send(rest, dst, group=self.cmd_group)

    def recv_command(self, src: int):
        head = torch.empty(HEADER, dtype=torch.uint8)
        dist.recv(head, src, group=self.cmd_group)
        raw = head.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8: 8 + n]
        if n > HEADER - 8:
            rest = torch.empty(n - (HEADER - 8), dtype=torch.uint8)
            dist.recv(rest, src, group=self.cmd_group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def send(self, x: torch.Tensor, dst: int) -> None:
        x = x.contiguous()
        dist.send(x, dst)
        self.stats.sent_bytes += x.numel() * x.element_size()

    def recv(self, shape: tuple, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(x, src)
        return x


def _fold(x: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
    """The residual stream after a stage's last layer: x + d, the add the next norm would do."""
    return x if d is None else x.add_(d)


def max_rss_mb() -> float:
    """This process's peak resident memory: VmHWM, which starts again at exec (ru_maxrss may
    carry over the parent's peak, a fork's, on Linux); ru_maxrss where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- rank 0 ----------------------------------------------------------------------------------

class StageCache(KVCache):
    """Rank 0's KV (its own layers'); every other stage holds its layers' KV under the same id.
    The lengths live here only: no forward reads them."""

    def __init__(self, pipe: "PipelineTransformer", cid: int, n_layers: int, batch_size: int,
                 max_seq_len: int, headroom: int):
        a = pipe.args
        super().__init__(n_layers, batch_size, a.n_kv_heads, a.head_dim, max_seq_len, headroom=headroom,
                         device=pipe.device)
        self.id, self._pipe = cid, pipe
        weakref.finalize(self, pipe._freed.append, cid)  # the others drop theirs with the next command

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._pipe._command(Command("copy_prefix", self.id, (src, dst, n)))
        super().copy_prefix(src, dst, n)


class PipelineTransformer:
    """Rank 0's model: the Transformer interface over the whole pipeline (see the module doc)."""

    def __init__(self, model: Transformer, ring: Ring, ranges: list[tuple[int, int]], procs=()):
        self.model, self.ring, self.ranges = model, ring, ranges
        self.args, self.device, self.weight_dtype = model.args, model.device, model.weight_dtype
        ring.stats.weights_mb = model.weight_bytes() / 2**20
        self._procs = list(procs)  # ranks started here (loopback), waited for on close
        self._ids = itertools.count()
        self._freed: list[int] = []
        self._closed = False
        atexit.register(self.close)

    def _command(self, cmd: Command) -> None:
        assert not self._closed, "the pipeline is closed"
        free = []
        while self._freed:  # pop, not copy-and-clear: a cache may be collected meanwhile
            free.append(self._freed.pop())
        cmd.free = tuple(free)
        self.ring.send_command(cmd, self.ring.next)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None, headroom: int = 33) -> StageCache:
        cid = next(self._ids)
        max_seq_len = max_seq_len or self.args.max_seq_len
        self._command(Command("new_cache", cid, (batch_size, max_seq_len, headroom)))
        return StageCache(self, cid, len(self.model.layers), batch_size, max_seq_len, headroom)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StageCache,
                mask: torch.Tensor | None = None, return_hidden: bool = False,
                rows: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                taps: tuple[int, ...] = ()):
        """Transformer.forward, to the same bits: logits [B, T or n, V] (and hidden [B, T, dim])."""
        if taps:
            raise SpecdecError("a draft head that reads the target's inner layers (taps) does not run on "
                               "pipeline stages; use a head trained with --taps none", "head")
        t0 = time.perf_counter()
        m, ring, st = self.model, self.ring, self.ring.stats
        B, T = tokens.shape
        back = None if return_hidden or logits_at is None else logits_at  # [B, n]: rows needed back
        self._command(Command("forward", cache.id, (), _np(positions), _np(rows), _np(mask), _np(back)))
        t1 = time.perf_counter()
        step = m.plan(positions, rows, mask)
        x, d = m.run_layers(m.embed[tokens], None, step, cache)
        x = _fold(x, d)
        t2 = time.perf_counter()
        ring.send(x, ring.next)
        n = T if back is None else back.shape[1]
        if n == 0:  # a prefill: nothing comes back but the word that the last stage is done
            ring.recv((1,), ring.prev)
            t3 = time.perf_counter()
            logits = m.output(x, logits_at)  # [B, 0, V]
        else:
            h = ring.recv((B, n, self.args.dim), ring.prev)  # final hidden states
            t3 = time.perf_counter()
            logits = m.output(h, logits_at if back is None else None)
        t4 = time.perf_counter()
        st.compute_s += (t2 - t1) + (t4 - t3)
        st.wall_s += t4 - t0
        st.forwards += 1
        return (logits, h) if return_hidden else logits

    __call__ = forward

    def ping(self, shape: tuple) -> float:
        """Seconds for a forward's messages without its compute: the command and an fp32
        tensor of `shape` (a forward's x, [B, T, dim]) once round the ring."""
        t0 = time.perf_counter()
        self._command(Command("ping", args=(shape,)))
        self.ring.send(torch.zeros(shape, device=self.device), self.ring.next)
        self.ring.recv(shape, self.ring.prev)
        return time.perf_counter() - t0

    def stats(self, reset: bool = False) -> list[StageStats]:
        """Every rank's counters (rank 0 first); reset: start them again from zero."""
        self._command(Command("stats", args=(reset,)))
        own = self.ring.stats
        own.max_rss_mb = max_rss_mb()
        out = [StageStats(**vars(own))] + [self.ring.recv_command(r) for r in range(1, self.ring.world)]
        if reset:
            self.ring.stats = own.reset()
        return out

    def close(self) -> None:
        """Stop the other stages and leave the process group (also at exit)."""
        if self._closed:
            return
        try:
            self._command(Command("shutdown"))
        finally:
            self._closed = True
            dist.destroy_process_group()
            _reap(self._procs)


def _reap(procs, timeout: float = 30.0) -> None:
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- ranks 1..N-1 ----------------------------------------------------------------------------

def serve(model: Transformer, ring: Ring) -> None:
    """Run rank 0's commands on this stage's layers until "shutdown"."""
    caches: dict[int, KVCache] = {}
    last = ring.rank == ring.world - 1
    st = ring.stats
    st.weights_mb = model.weight_bytes() / 2**20
    dev = model.device
    while True:
        cmd: Command = ring.recv_command(ring.prev)
        if not last and cmd.op != "stats":
            ring.send_command(cmd, ring.next)  # first: the next stage can wait for its input
        for cid in cmd.free:
            caches.pop(cid, None)
        if cmd.op == "forward":
            B, T = cmd.positions.shape
            x = ring.recv((B, T, model.args.dim), ring.prev)
            t0 = time.perf_counter()
            step = model.plan(_tensor(cmd.positions, dev), _tensor(cmd.rows, dev), _tensor(cmd.mask, dev))
            x, d = model.run_layers(x, None, step, caches[cmd.cache])
            if last:
                hidden = model.final_norm(x, d, step)  # [B, T, dim]
                if cmd.back is not None:
                    hidden = (select_positions(hidden, _tensor(cmd.back, dev)) if cmd.back.shape[1]
                              else torch.zeros(1, device=dev))  # a prefill: only "done"
            else:
                hidden = _fold(x, d)
            st.compute_s += time.perf_counter() - t0
            st.forwards += 1
            ring.send(hidden, 0 if last else ring.next)
        elif cmd.op == "ping":
            ring.send(ring.recv(cmd.args[0], ring.prev), ring.next)
        elif cmd.op == "new_cache":
            caches[cmd.cache] = model.new_cache(*cmd.args)
        elif cmd.op == "copy_prefix":
            caches[cmd.cache].copy_prefix(*cmd.args)
        elif cmd.op == "stats":
            if not last:
                ring.send_command(cmd, ring.next)
            st.max_rss_mb = max_rss_mb()
            ring.send_command(st, 0)
            if cmd.args[0]:
                st = ring.stats = st.reset()
        elif cmd.op == "shutdown":
            return
        else:
            raise AssertionError(f"unknown pipeline command {cmd.op!r}")
