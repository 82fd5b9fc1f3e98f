"""Pipeline parallel decode speed and memory: one process against N stages on this machine.

    .venv/bin/python benchmarks/pipeline.py [--model smollm2-135m] [--stages 2] [--batch 1 8]
        [--tokens 32] [--repeats 3] [--threads 2] [--no-memory]

Greedy plain decoding through the engine on the same prompts, runs alternating (one process,
then the pipeline, each with --threads torch threads per process: the stages of a forward run one
after another, so on one machine each may use every core) so that machine noise hits both alike;
medians over repeats. Decode tokens/s exclude the prefill. For the pipeline also each stage's
compute per step, and communication per step: rank 0's wall time of a forward minus every
stage's compute (the messages, waiting for them, the command), with the bytes sent each hop,
and a ping: the same messages once round the ring without any compute.
Then peak memory per process (tests/pipeline_probe.py: fresh processes; single, single with the
embedding kept as stored like rank 0's, pipeline). The machine's load average is printed before
and after: this machine's cores may be shared. Prints tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdec.config import SamplingParams
from specdec.distributed import launch
from specdec.loader import build_engine, load_model, load_models

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a bicycle stays upright.",
           "Give three tips for writing clear documentation.",
           "List the planets of the solar system, in order.",
           "What is the difference between a list and a tuple in Python?",
           "Summarise the plot of Romeo and Juliet in two sentences.",
           "Write a haiku about autumn.",
           "How do I reverse a string in JavaScript?"]
PROBE = Path(__file__).resolve().parent.parent / "tests" / "pipeline_probe.py"


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    flags = next((ln for ln in lines if ln.startswith("flags")), "")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    return f"{names[0] if names else 'unknown'} x{len(names)} ({isa})"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def decode(engine, prompts: list[list[int]], n: int) -> tuple[float, int]:
    """(decode tokens/s, decode steps): the first round (prefill + first token) is not timed."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.reserve(len(prompts))
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.active:
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    return sum(len(r.output) - 1 for r in reqs) / dt, steps


def probe(mode: str, model: str) -> dict:
    out = subprocess.run([sys.executable, str(PROBE), mode, model], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load_before = load_average()
    pipe, tok = launch.launch(a.model, a.stages, threads=a.threads)
    single, _ = load_model(a.model)
    prompts = [tok.encode_prompt(p) for p in PROMPTS]
    engines = {name: build_engine(load_models((m, tok)), None, max_model_len=1024, max_batch=max(a.batch))
               for name, m in (("single", single), ("pipeline", pipe))}
    for e in engines.values():  # warm-up
        decode(e, prompts[:max(a.batch)], 4)
    rows, comm = [], {}
    for B in a.batch:
        speeds = {name: [] for name in engines}
        stats = []
        for _ in range(a.repeats):
            for name, e in engines.items():
                if name == "pipeline":
                    pipe.stats(reset=True)
                tok_s, steps = decode(e, (prompts * B)[:B], a.tokens)
                speeds[name].append(tok_s)
                if name == "pipeline":
                    stats.append((pipe.stats(), steps))
        med = {name: statistics.median(v) for name, v in speeds.items()}
        # per forward: communication = rank 0's wall time - every stage's compute
        per_step = []
        for st, _ in stats:
            fw = st[0].forwards
            per_step.append(((st[0].wall_s - sum(s.compute_s for s in st)) / fw,
                             [s.compute_s / fw for s in st], [s.sent_bytes / fw for s in st]))
        c = statistics.median(p[0] for p in per_step)
        compute = [statistics.median(p[1][r] for p in per_step) for r in range(a.stages)]
        sent = [statistics.median(p[2][r] for p in per_step) for r in range(a.stages)]
        ping = statistics.median(pipe.ping((B, 1, pipe.args.dim)) for _ in range(50))
        comm[B] = {"comm_s_per_step": c, "comm_s_per_token": c / B, "ping_s": ping,
                   "compute_s_per_step": compute, "bytes_per_step": sent}
        rows.append((B, med["single"], med["pipeline"], c, ping, compute, sent))
    pstats = pipe.stats()
    pipe.close()
    load_after = load_average()

    print(f"{a.model}: greedy plain decode, {a.tokens} tokens a row, {a.repeats} runs each (median), "
          f"{a.threads} torch threads per process")
    print(f"CPU: {cpu_name()}; load average before {load_before}, after {load_after}")
    print(f"pipeline: {a.stages} stages, layers {pipe.ranges}, gloo over loopback")
    print(f"\n{'batch':>5} {'single tok/s':>13} {'pipeline tok/s':>15} {'ratio':>6} {'comm ms/step':>13} "
          f"{'comm ms/token':>14} {'ping ms':>8} {'compute ms/step per stage':>27} {'bytes/step per hop':>20}")
    for B, s, p, c, ping, comp, sent in rows:
        print(f"{B:>5} {s:>13.1f} {p:>15.1f} {p / s:>6.2f} {c * 1e3:>13.2f} {c / B * 1e3:>14.2f} {ping * 1e3:>8.2f} "
              f"{' + '.join(f'{x * 1e3:.1f}' for x in comp):>27} {' / '.join(f'{x:.0f}' for x in sent):>20}")
    print("(comm: rank 0's wall time of a decode forward minus every stage's compute; ping: the same "
          "messages, command and x [B, 1, dim], once round the ring with no compute)")
    print(f"(bytes per step per hop, rank 0 first: x [B, 1, dim] fp32 out, the final hidden states "
          f"[B, 1, dim] back: dim * 4 = {pipe.args.dim * 4} bytes a token)")
    mem = None
    if not a.no_memory:
        mem = {m: probe(m, a.model) for m in ("single", "rows", "pipeline")}
        print(f"\npeak resident memory per process (MB; 'above' = above the {mem['single']['base_mb']:.0f} MB "
              f"of torch and the kernels that every process has)")
        print(f"{'configuration':<40}{'peak':>14}{'above':>14}{'weights':>14}")
        for m, label in (("single", "one process"), ("rows", "one process, embedding as stored"),
                         ("pipeline", f"pipeline, {a.stages} stages")):
            p = mem[m]
            fmt = lambda xs: " / ".join(f"{x:.0f}" for x in xs)  # noqa: E731
            print(f"{label:<40}{fmt(p['peak_mb']):>14}{fmt(x - p['base_mb'] for x in p['peak_mb']):>14}"
                  f"{fmt(p['weights_mb']):>14}")
    print(json.dumps({
        "benchmark": "pipeline", "model": a.model, "stages": a.stages, "ranges": pipe.ranges,
        "threads": a.threads, "tokens": a.tokens, "cpu": cpu_name(), "load_before": load_before,
        "load_after": load_after,
        "decode_tok_s": {str(B): {"single": s, "pipeline": p} for B, s, p, *_ in rows},
        "communication": {str(B): v for B, v in comm.items()},
        "weights_mb": [s.weights_mb for s in pstats], "memory": mem}))


if __name__ == "__main__":
    main()
