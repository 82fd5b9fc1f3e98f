"""`specdec verify`: argument errors, a passing run and its failing negative control, on tiny
random models written as HF directories (V = 4, so the target's joint has 16 cells at n = 2)."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_model
from engines import make_engine
from specdec.tools.distribution import engine_joint_exact, noncentrality, target_joint_exact
from specdec.cli import main
from specdec.config import SamplingParams
from specdec.tools.audit import control
from tiny_hf import write_tiny_hf

KW = dict(vocab=4, dim=16, layers=1, heads=2, kv_heads=1, inter=16, max_seq_len=64)
# A flat-ish target and a peaked draft: frequent rejections make the control's error large.
TARGET, DRAFT = dict(seed=31, scale=0.5), dict(seed=32, scale=2.0)
N = 4000


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    return write_tiny_hf(root / "target", **TARGET, **KW), write_tiny_hf(root / "draft", **DRAFT, **KW)


def _verify(capsys, *args):
    rc = main(["verify", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _run(capsys, dirs, *extra):
    rc, out, _ = _verify(capsys, "--model", dirs[0], "--draft", dirs[1], "--prefix", "w1 w2 w3",
                         "--num-draft-tokens", "2", "--n", "2", "--samples", str(N), "--temperature", "1",
                         "--seed", "3", *extra)
    return rc, json.loads(out.strip().splitlines()[-1]), out


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/m.gguf"], "model file not found"),
    (["--model", "no-such-model"], "unknown model"),
    (["--num-draft-tokens", "2,4"], "one num_draft_tokens value"),
    (["--num-draft-tokens", "x"], "num_draft_tokens='x'"),
    (["--n", "0"], "n=0 is out of range"),
    (["--samples", "5"], "samples=5 is out of range"),
    (["--temperature", "0", "--control", "redraw-from-p"], "needs temperature > 0"),
])
def test_argument_errors_are_one_line_exit_2(capsys, dirs, args, needle):
    rc, _, err = _verify(capsys, "--model", dirs[0], *args)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_verify_passes_and_reports(capsys, dirs):
    rc, r, out = _run(capsys, dirs)
    assert rc == 0 and r["verdict"] == "pass", out
    assert r["samples"] == N and r["rounds_with_drafts"] > 0 and 0 < r["acceptance_rate"] < 1
    assert r["listed_mass"] > 0.99 and 0 < r["detectable_tv"] < 0.2
    for words in ("drafted in", "chi-square", "p-value", "total-variation", "verdict: PASS"):
        assert words in out


def test_redraw_from_p_control_fails(capsys, dirs):
    """Power first: the control's exact joint (the engine's own code, enumerated) against the
    target's gives the noncentrality lambda at N; lambda >= 200 with ~15 degrees of freedom puts
    the statistic's mean ~ 215 against a 1e-3 critical value of ~ 38, so failing to reject would
    be a > 10-sigma event. Then the command itself must report FAIL with exit code 1."""
    kw = {k: v for k, v in KW.items() if k != "vocab"}
    t, d = tiny_model(vocab=4, **TARGET, **kw), tiny_model(vocab=4, **DRAFT, **kw)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    with control("redraw-from-p"):
        alt = engine_joint_exact(make_engine(t, d, 2), [1, 2, 3], params, n=2)
    assert noncentrality(N, alt, target_joint_exact(t, [1, 2, 3], params, n=2)) >= 200
    rc, r, out = _run(capsys, dirs, "--control", "redraw-from-p")
    assert rc == 1 and r["verdict"] == "fail" and r["p_value"] < 1e-3, out


def test_never_drafting_is_not_a_pass(capsys, dirs):
    """An n-gram proposer on a prefix without repeats (and n = 1: no output to match) drafts
    nothing: the run tested nothing, so it must not pass."""
    rc, out, _ = _verify(capsys, "--model", dirs[0], "--proposer", "ngram", "--prefix", "w1 w2 w3",
                         "--n", "1", "--samples", "200", "--temperature", "1")
    r = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and r["rounds_with_drafts"] == 0 and "never drafted" in r["reason"]


def test_memo_model_answers_like_the_model():
    """MemoModel's logits are the model's (to fp32 rounding of a different batch shape) for the
    prefix, its own prefixes and extensions of it; and the engine driven by memoised target and
    draft emits what the real models make it emit (greedy, plain and speculative)."""
    from specdec.tools.distribution import full_forward_logits
    from specdec.tools.audit import MemoModel

    kw = dict(vocab=16, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=64)
    t, d = tiny_model(seed=5, scale=1.0, **kw), tiny_model(seed=6, scale=1.0, **kw)
    prefix = [1, 2, 3, 4]
    memo = MemoModel(t, prefix, batch=2)
    seqs = [prefix + [5], prefix + [5, 6, 7], prefix, prefix[:2], prefix + [9, 9]]
    assert (memo.next_logits(seqs) - full_forward_logits(t)(seqs)).abs().max() < 1e-4
    params = SamplingParams(temperature=0, max_tokens=10)
    for k in (0, 3):
        real = make_engine(t, d, k).generate([prefix], params)[0].output
        memo_engine = make_engine(MemoModel(t, prefix), MemoModel(d, prefix), k)
        assert memo_engine.generate([prefix], params)[0].output == real
