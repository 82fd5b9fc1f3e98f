"""`specdec train-head`: harvest the target's hidden states, train a draft head, measure it on
held-out prompts, save it. Resumable: the work directory keeps the harvested shards and the last
checkpoint; a second run with the same --out continues where the first stopped.

Recipe (docs/draft-head.md says what each choice bought):
  1. harvest (specdec.head.data): the target answers training prompts (code from the standard
     library, chat from our templates), greedy or sampled; every position's token and final
     hidden state f_j are kept (fp16);
  2. draft vocabulary: the Vd most frequent tokens of that data (plus EOS);
  3. train: pairs (f_j, x_{j+1}) -> the target's next-token distribution (its own output head on
     f_{j+1}, restricted to the draft vocabulary; soft cross-entropy) + a regression of g on
     f_{j+1}, for `steps` unrolled draft steps (each fed its own predicted feature);
  4. held out (`specdec bench`'s own prompt sets, never trained on): the exact greedy acceptance
     at each draft position, from the target's greedy answers.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from specdec.errors import SpecdecError
from specdec.head import attach
from specdec.head.data import (CORPUS_WINDOW, Sequence, append_shard, corpus_chunks, harvest, load_shards,
                               teacher_force, training_prompts, user_requests)
from specdec.head.model import DraftHead, HeadConfig
from specdec.tools.prompts import CHAT_PROMPTS, humaneval

STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5, 0.4)  # loss weight of each unrolled draft step
REGRESSION = 0.5  # weight of the feature regression beside the distribution's cross-entropy
TOP_W = 4  # held-out: how often the next token is among the first draft's top 1..TOP_W
WINDOW = 384  # positions per training window
REQUESTS_SHARE = 0.25  # most of the harvest's time the target may spend writing its own requests
CHECKPOINT_S = 60.0  # seconds between checkpoints (a stopped run loses at most this much training)
VALIDATION_EVERY = 20  # every 20th harvested answer is kept out of training: each epoch is measured on them


def kept_out(index: int) -> bool:
    """Whether the harvested answer to prompt `index` is a validation answer (never trained on)."""
    return index % VALIDATION_EVERY == VALIDATION_EVERY - 1


@dataclass
class TrainSettings:
    out: Path
    minutes: float = 50.0  # the whole run: harvest, training and held-out measurement
    harvest_share: float = 0.45  # most of the budget spent harvesting
    harvest_tokens: int = 300_000  # harvest until this many tokens (prompts + answers)
    user_requests: int = 1500  # chat prompts the target writes itself first (samples; 0: none)
    corpus_share: float = 0.15  # then teacher forcing on library text, at most this share of the budget
    corpus_tokens: int = 0  # teacher-forced tokens (0: none; docs/draft-head.md: it did not pay here yet)
    epochs: float = 2.0  # passes over the harvested pairs (or until the budget ends)
    draft_vocab: int = 8192
    intermediate: int | None = None  # the head's MLP width (default: the target's)
    steps: int = 1  # unrolled draft steps in training (1: 2.5x the pairs per second; docs/draft-head.md)
    max_new: int = 256  # answer tokens per training prompt
    batch: int = 16  # harvest rows decoding together
    tokens_per_batch: int = 1024  # training batch size in pairs (small: many optimizer steps pay more)
    lr: float = 2e-3
    warmup: int = 30  # optimizer steps of linear warm-up
    seed: int = 0
    taps: tuple[int, ...] = ()  # target layers whose residual streams the head also reads
    init_layer: str = "none"  # "last": the head's layer starts as a copy of the target's last one
    held_out_code: int = 20  # HumanEval prompts for the held-out measurement
    held_out_new: int = 128


# ---- vocabulary and windows -------------------------------------------------------------------
def draft_vocabulary(seqs: list[Sequence], size: int, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The `size` most frequent next tokens of the data (the target's answers counted 4x: they
    are what the head drafts; prompts and teacher-forced text once), plus `always` (EOS), sorted
    ids [Vd]."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in seqs:
        t = torch.tensor(s.tokens[1:])
        counts.index_add_(0, t, torch.ones(len(t), dtype=torch.float64))
        if s.kind.startswith("corpus"):
            continue
        ans = torch.tensor(s.tokens[s.prompt_len:])
        counts.index_add_(0, ans, torch.full((len(ans),), 3.0, dtype=torch.float64))
    for t in always:
        counts[t] = float("inf")
    ids = counts.topk(min(size, vocab_size)).indices
    return ids.sort().values


def windows(seqs: list[Sequence], width: int) -> list[tuple[int, int, int]]:
    """(sequence, first pair, last pair + 1): pairs j need f_j and the target f_{j+1}, so a
    sequence with h hidden rows has pairs 0..h-2."""
    out = []
    for i, s in enumerate(seqs):
        n = len(s.hidden) - 1
        for a in range(0, n, width):
            if min(a + width, n) - a >= 8:
                out.append((i, a, min(a + width, n)))
    return out


def batches(wins, tokens_per_batch: int, rng: random.Random) -> list[list[tuple[int, int, int]]]:
    wins = sorted(wins, key=lambda w: w[2] - w[1])
    out, cur = [], []
    for w in wins:
        if cur and (len(cur) + 1) * (w[2] - w[1]) > tokens_per_batch:
            out.append(cur)
            cur = []
        cur.append(w)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(seqs: list[Sequence], batch, dim: int, width: int | None = None):
    """feats [B, T, width] (the last `width` columns of the harvested features: f_j last),
    tokens x_{j+1} [B, T], targets f_{j+1} [B, T, d], positions, valid."""
    T = max(b - a for _, a, b in batch)
    B = len(batch)
    width = width or dim
    feats, targets = torch.zeros(B, T, width), torch.zeros(B, T, dim)
    tokens = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for r, (i, a, b) in enumerate(batch):
        s, n = seqs[i], b - a
        feats[r, :n] = s.hidden[a:b, -width:].float()
        targets[r, :n] = s.hidden[a + 1: b + 1, -dim:].float()
        tokens[r, :n] = torch.tensor(s.tokens[a + 1: b + 1])
        pos[r] = torch.arange(a, a + T)
        valid[r, :n] = True
    return feats, tokens, targets, pos, valid


def loss_fn(head: DraftHead, feats, tokens, targets, pos, valid, steps: int):
    """(total loss, per-step top-1 agreement with the target on the draft vocabulary)."""
    with torch.no_grad():
        teacher = head.logits(targets).softmax(-1)  # [B, T, Vd]: the target's p on the draft vocabulary
        top = teacher.argmax(-1)
    gs = head.unroll(feats, tokens, pos, steps)
    total, agree = 0.0, []
    for s, g in enumerate(gs):
        m = valid.clone()
        m[:, :s] = False  # step s + 1 at index j reads a step-s prediction from j - 1
        logp = head.logits(g).log_softmax(-1)
        ce = -(teacher * logp).sum(-1)
        reg = F.smooth_l1_loss(g, targets, reduction="none").mean(-1)
        total = total + STEP_WEIGHTS[s] * ((ce + REGRESSION * reg)[m]).mean()
        agree.append(float((logp.argmax(-1) == top)[m].float().mean()))
    return total, agree


# ---- held-out acceptance ----------------------------------------------------------------------
@torch.no_grad()
def acceptance(head: DraftHead, seqs: list[Sequence], k: int = 5) -> dict:
    """Exact greedy acceptance on the target's greedy answers: from every answer position, the
    head drafts k tokens as it would in decoding (true pairs up to there, then its own predicted
    features); accepted = the drafts equal to the target's next tokens, up to the first miss.
    Returns per-position acceptance rates (given the earlier ones accepted), the mean tokens
    per round (accepted + 1) for k = 1..k, and how often the next token is among the first
    draft's top w (w = 1..TOP_W: what a draft tree of w first children can accept, greedy)."""
    acc = torch.zeros(k + 1)  # rounds whose run of accepted drafts is >= s, s = 0..k
    W = min(TOP_W, len(head.vocab))
    in_top = torch.zeros(W)  # rounds whose next token is among the first draft's top w
    rounds = 0
    for s in seqs:
        n = len(s.hidden) - 1  # pairs 0..n-1 with hidden; we need tokens up to j + k + 1
        if n < 2:
            continue
        T = n
        feats = s.hidden[:T, -head.cfg.feature_dim:].float().unsqueeze(0)
        tokens = torch.tensor(s.tokens[1: T + 1]).unsqueeze(0)
        gs = head.unroll(feats, tokens, torch.arange(T).unsqueeze(0), k)
        drafts = torch.stack([head.logits(g[0]).argmax(-1) for g in gs])  # [k, T] draft-vocab index
        drafts = head.vocab[drafts]
        top = head.vocab[head.logits(gs[0][0]).topk(W, -1).indices]  # [T, W] the first draft's
        truth = torch.tensor(s.tokens)
        starts = range(max(s.prompt_len - 1, 0), T - k)  # round starts inside the answer
        for j0 in starts:
            hit = (top[j0] == truth[j0 + 2]).nonzero()
            if len(hit):
                in_top[int(hit[0, 0]):] += 1
            run = 0
            while run < k and int(drafts[run, j0 + run]) == int(truth[j0 + run + 2]):
                run += 1
            acc[: run + 1] += 1
            rounds += 1
    if not rounds:
        return {"rounds": 0}
    at = (acc[1:] / acc[:-1].clamp(min=1)).tolist()  # P(draft s accepted | drafts < s accepted)
    mean = [1 + float(acc[1: kk + 1].sum() / rounds) for kk in range(1, k + 1)]
    return {"rounds": rounds, "acceptance_at": [round(a, 4) for a in at],
            "tokens_per_round": {str(kk): round(m, 3) for kk, m in zip(range(1, k + 1), mean)},
            "first_in_top": {str(w + 1): round(float(in_top[w]) / rounds, 4) for w in range(W)}}


def held_out_sequences(model, tokenizer, st: TrainSettings) -> dict[str, list[Sequence]]:
    sets = {"chat": [("chat", p) for p in CHAT_PROMPTS],
            "code": [("code", p) for p in humaneval(st.held_out_code)]}
    return {name: harvest(model, tokenizer, ps, st.held_out_new, st.batch, st.seed, sampled_share=0.0,
                          taps=st.taps)
            for name, ps in sets.items()}


# ---- the run -------------------------------------------------------------------------------------
def train_head(model, tokenizer, target: str, sha256: str, st: TrainSettings, console=None) -> dict:
    """Harvest, train and measure within st.minutes; returns the saved head's config (a dict)."""
    torch.manual_seed(st.seed)
    t_start = time.monotonic()
    deadline = t_start + 60 * st.minutes
    work = st.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"spent_s": 0.0, "taps": list(st.taps)}
    if state.get("taps", []) != list(st.taps):  # the harvested features are that wide
        raise SpecdecError(f"{st.out} holds data harvested with --taps {taps_text(state.get('taps', []))}; "
                           f"resume it with those, or choose another --out for --taps {taps_text(st.taps)}", "taps")
    deadline -= state["spent_s"]  # a resumed run keeps the first run's budget

    def save_state(**kw):
        state.update(kw, spent_s=state["spent_s"] + time.monotonic() - t_start)
        state_path.write_text(json.dumps(state))
        state["spent_s"] -= time.monotonic() - t_start  # (counted once, at the end)

    console = console or Console(stderr=True)

    def log(line: str) -> None:  # a log file (no live progress bar) gets lines instead
        if not console.is_terminal:
            console.print(f"{time.strftime('%H:%M:%S')} {line}", highlight=False, soft_wrap=True)

    have = load_shards(work)
    done_ids = {i for i, _ in have}
    harvest_end = t_start + 60 * st.minutes * st.harvest_share - state["spent_s"]
    cols = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total}"),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    with Progress(*cols, console=console, transient=False) as progress:
        requests_path = work / "user_requests.json"  # fixed once written: the prompt list must not change
        # no more requests than the harvest can answer, in at most REQUESTS_SHARE of its time
        n_requests = min(st.user_requests, -(-st.harvest_tokens // st.max_new))
        if not requests_path.exists() and not have and n_requests:
            task = progress.add_task("user turns", total=n_requests, info="the target writes chat prompts")
            t0 = time.monotonic()
            requests = user_requests(model, tokenizer, n_requests, st.seed, st.batch,
                                     deadline=t0 + REQUESTS_SHARE * max(harvest_end - t0, 0.0),
                                     on_sequence=lambda _: progress.advance(task), exclude=CHAT_PROMPTS)
            requests_path.write_text(json.dumps(requests, indent=0))
            log(f"user turns: {len(requests)} kept of {n_requests} in {time.monotonic() - t0:.0f} s")
        requests = json.loads(requests_path.read_text()) if requests_path.exists() else []
        prompts = training_prompts(st.seed, requests=requests)
        todo = [(i, p) for i, p in enumerate(prompts) if i not in done_ids]
        if todo and time.monotonic() < harvest_end and not state.get("harvest_done"):
            task = progress.add_task("harvest", total=len(prompts), completed=len(done_ids), info="")
            t0, n_tok = time.monotonic(), 0

            buf: list[tuple[int, Sequence]] = []

            def on_sequence(seq: Sequence) -> None:  # a shard every 32 answers (resumable)
                nonlocal n_tok
                buf.append((todo[seq.index][0], seq))
                n_tok += len(seq.tokens)
                if len(buf) >= 32:
                    flush()
                progress.update(task, advance=1, info=f"{n_tok / (time.monotonic() - t0):.0f} tok/s, "
                                                      f"{n_tok + done_tokens} tokens")

            def flush() -> None:
                if append_shard(work, "data", buf, have):
                    log(f"harvest: {len(have)} answers, {n_tok + done_tokens} tokens, "
                        f"{n_tok / (time.monotonic() - t0):.0f} tok/s")

            done_tokens = sum(len(s.tokens) for _, s in have)
            harvest(model, tokenizer, [p for _, p in todo], st.max_new, st.batch, st.seed + len(done_ids),
                    deadline=harvest_end, token_budget=st.harvest_tokens - done_tokens, on_sequence=on_sequence,
                    taps=st.taps)
            flush()
            save_state(harvest_done=True)
        corpus = load_shards(work, "corpus")
        corpus_end = t_start + 60 * st.minutes * (st.harvest_share + st.corpus_share) - state["spent_s"]
        read = sum(len(s.tokens) for _, s in corpus)
        if st.corpus_tokens > read and time.monotonic() < corpus_end and not state.get("corpus_done"):
            start = 1 + max((i for i, _ in corpus), default=-1)
            window = min(CORPUS_WINDOW, model.args.max_seq_len - 1)
            chunks = itertools.islice(corpus_chunks(tokenizer, st.seed, window), start, None)
            task = progress.add_task("corpus", total=st.corpus_tokens, completed=read, info="")
            t0, n_read = time.monotonic(), 0
            cbuf: list[tuple[int, Sequence]] = []

            def cflush() -> None:
                if append_shard(work, "corpus", cbuf, corpus):
                    log(f"corpus: {read + n_read} tokens, {n_read / (time.monotonic() - t0):.0f} tok/s")

            def on_chunk(seq: Sequence) -> None:
                nonlocal n_read
                cbuf.append((start + seq.index, seq))
                n_read += len(seq.tokens)
                if len(cbuf) >= 64:
                    cflush()
                progress.update(task, completed=read + n_read,
                                info=f"{n_read / (time.monotonic() - t0):.0f} tok/s (teacher forcing)")

            teacher_force(model, chunks, window, deadline=corpus_end, token_budget=st.corpus_tokens - read,
                          on_sequence=on_chunk, taps=st.taps)
            cflush()
            save_state(corpus_done=True)
        # answers the head never trains on, from the training prompts' own mix: the epoch-by-epoch check
        val = [s for i, s in have if kept_out(i)]
        seqs = [s for i, s in have if not kept_out(i)] + [s for _, s in corpus]
        if not seqs:
            raise SpecdecError("no training data: the harvest budget ran out before one answer finished; "
                               "give --minutes more time", "minutes")
        eos = set(tokenizer.eos_token_ids)
        ids = draft_vocabulary(seqs, st.draft_vocab, model.args.vocab_size, eos)
        cfg = HeadConfig.for_target(model.args, target, sha256, len(ids), st.intermediate, st.taps)
        head = DraftHead(cfg)
        head.vocab = ids
        attach(head, model)
        with torch.no_grad():
            head.w_o.copy_(model.norm)
        if st.init_layer == "last":
            init_from_layer(head, model, model.args.n_layers - 1)
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=st.lr, weight_decay=0.0)
        ckpt = work / "checkpoint.pt"
        step, validation = 0, []
        if ckpt.exists():
            saved = torch.load(ckpt, weights_only=False)
            if saved["config"] == cfg.__dict__ | {"train": {}, "held_out": {}}:
                head.load_state_dict(saved["head"])
                opt.load_state_dict(saved["opt"])
                step, validation = saved["step"], saved.get("validation", [])
        coverage = _coverage(seqs, ids)
        # held-out measurement needs a few minutes at the end: train until then
        reserve_s = min(90 + 4 * st.held_out_code, 12 * st.minutes)  # a fifth of a short budget
        train_end = deadline - reserve_s
        rng = random.Random(st.seed)
        wins = windows(seqs, WINDOW)
        n_pairs = sum(b - a for _, a, b in wins)
        est_total = None
        task = progress.add_task("train", total=None, info="steps")
        t0, seen, ema = time.monotonic(), 0, None
        saved_at = t0
        epoch = 0
        head.train()
        total_pairs = st.epochs * n_pairs
        def more() -> bool:  # (past the cosine schedule's end the learning rate is 0: stop there)
            return time.monotonic() < train_end and seen < total_pairs and (est_total is None or step < est_total)

        while more():
            for batch in batches(wins, st.tokens_per_batch, rng):
                if not more():
                    break
                lr = st.lr * min(1.0, (step + 1) / st.warmup)
                if est_total:
                    lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / est_total)))
                for gp in opt.param_groups:
                    gp["lr"] = lr
                feats, tokens, targets, pos, valid = collate(seqs, batch, cfg.dim, cfg.feature_dim)
                loss, agree = loss_fn(head, feats, tokens, targets, pos, valid, st.steps)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                step += 1
                seen += int(valid.sum())
                lv = loss.item()
                ema = lv if ema is None else 0.95 * ema + 0.05 * lv
                rate = seen / (time.monotonic() - t0)
                if est_total is None and step == 20:  # steps that fit the budget, for the cosine decay
                    fit = (train_end - time.monotonic()) * rate
                    est_total = step + int(min(fit, total_pairs - seen) / (seen / step))
                progress.update(task, completed=step, total=est_total,
                                info=f"epoch {epoch}, loss {ema:.3f}, top-1 {agree[0]:.2f}/{agree[-1]:.2f}, "
                                     f"{rate:.0f} pairs/s")
                if step % 50 == 0:
                    log(f"train: step {step}/{est_total}, epoch {epoch}, loss {ema:.3f}, "
                        f"top-1 per step {' '.join(f'{x:.2f}' for x in agree)}, {rate:.0f} pairs/s")
                if time.monotonic() - saved_at > CHECKPOINT_S:
                    saved_at = time.monotonic()
                    torch.save({"config": cfg.__dict__ | {"train": {}, "held_out": {}}, "head": head.state_dict(),
                                "opt": opt.state_dict(), "step": step, "validation": validation}, ckpt)
            epoch += 1
            if val:
                head.eval()
                v = acceptance(head, val)
                head.train()
                v = {"epochs": round(seen / max(n_pairs, 1), 2), "step": step,
                     "loss": None if ema is None else round(ema, 4),
                     "acceptance_at": v.get("acceptance_at"), "tokens_per_round": v.get("tokens_per_round")}
                validation.append(v)
                log(f"validation after {v['epochs']} epochs ({len(val)} answers kept out): acceptance by "
                    f"position {v['acceptance_at']}, tokens per round {v['tokens_per_round']}")
        head.eval()
        task = progress.add_task("held out", total=None, info="the target answers bench prompts")
        held = held_out_sequences(model, tokenizer, st)
        results = {name: acceptance(head, s) for name, s in held.items()}
        progress.update(task, completed=1, total=1, info="")
    forced = any(s.kind.startswith("corpus") for s in seqs)
    cfg.train = {"data": "stdlib code prompts + specdec chat templates"
                         + (" + chat prompts the target wrote" if requests else "") + ", answered by the target"
                         + ("; stdlib modules and the Python reference's prose, teacher-forced" if forced else ""),
                 "user_requests": len(requests), "sequences": len(seqs), "tokens": sum(len(s.tokens) for s in seqs), "pairs": n_pairs,
                 "answered_tokens": sum(len(s.tokens) for _, s in have),
                 "teacher_forced_tokens": sum(len(s.tokens) for s in seqs if s.kind.startswith("corpus")),
                 "epochs": round(seen / max(n_pairs, 1), 2), "steps": step, "seed": st.seed,
                 "minutes": st.minutes, "unrolled_steps": st.steps, "draft_vocab": len(ids),
                 "draft_vocab_coverage": coverage, "window": WINDOW, "lr": st.lr,
                 "batch_pairs": st.tokens_per_batch, "warmup": st.warmup, "init_layer": st.init_layer,
                 "validation_answers": len(val), "validation": validation}
    cfg.held_out = results
    head.cfg = cfg
    head.save(st.out)
    save_state(finished=True)
    return cfg.__dict__


def init_from_layer(head: DraftHead, model, i: int) -> None:
    """Start the head's layer as a copy of target layer i (its attention, MLP and their norms,
    dequantised; biases, which the head has none of, left out; the MLP as wide as the target's),
    and z = rms(embed(x_{j+1})) + rms(u_j) at first: the token and the feature, summed as a
    residual stream holds them."""
    lw = model.layers[i]
    d = head.cfg.dim
    with torch.no_grad():
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            getattr(head, name).weight.copy_(getattr(lw, name).dense)
        head.w_a.copy_(lw.attn_norm)
        head.w_m.copy_(lw.ffn_norm)
        head.fc.weight.copy_(torch.cat([torch.eye(d), torch.eye(d)], 1))


def _coverage(seqs: list[Sequence], ids: torch.Tensor) -> float:
    """Share of answer tokens inside the draft vocabulary."""
    inside = torch.zeros(int(ids.max()) + 1, dtype=torch.bool)
    inside[ids] = True
    ans = [t for s in seqs if not s.kind.startswith("corpus") for t in s.tokens[s.prompt_len:]]
    return round(sum(1 for t in ans if t < len(inside) and inside[t]) / max(len(ans), 1), 4)


def taps_text(taps) -> str:
    return ",".join(str(t) for t in taps) if taps else "none"
