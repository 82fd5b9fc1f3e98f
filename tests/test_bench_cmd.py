"""`specdec bench`: argument errors (one line, exit 2) and a smoke run on tiny random models
written as HF directories, with --compare transformers (so transformers' plain, assisted and
prompt-lookup paths run too): results.json, the three plots and the final JSON line."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main
from tiny_hf import write_tiny_hf


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    kw = dict(vocab=16, dim=32, layers=2, heads=4, kv_heads=2, inter=48, max_seq_len=256)
    target = write_tiny_hf(root / "target", seed=41, scale=1.0, **kw)
    draft = write_tiny_hf(root / "draft", seed=42, scale=1.0, **kw)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n"
                               for p in ["w1 w2 w3 w1 w2 w3 w1", "w4 w5 w6 w7 w4 w5", "w9 w8 w9 w8"]))
    return target, draft, str(prompts)


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "no-such-set"], "unknown prompt set 'no-such-set'"),
    (["--num-draft-tokens", "2,x"], "num_draft_tokens='x'"),
    (["--num-draft-tokens", "2", "40"], "num_draft_tokens=40 is out of range"),
    (["--num-draft-tokens", "4", "4"], "lists 4 twice"),
    (["--num-prompts", "0"], "num_prompts=0 is out of range"),
    (["--model", "/nonexistent/m.gguf", "--prompts", "chat"], "model file not found"),
    (["--model", "no-such-model", "--prompts", "chat"], "unknown model 'no-such-model'"),
    (["--proposer", "draft", "--prompts", "chat"], "needs a draft model"),
])
def test_argument_errors_are_one_line_exit_2(capsys, tmp_path, args, needle):
    rc = main(["bench", "--output", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_bench_smoke_with_transformers(capsys, tmp_path, dirs):
    target, draft, prompts = dirs
    out = tmp_path / "out"
    rc = main(["bench", "--model", target, "--draft", draft, "--proposer", "draft", "--prompts", prompts, "--num-prompts", "2",
               "--max-tokens", "8", "--num-draft-tokens", "2", "auto", "--compare", "transformers",
               "--output", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    last = json.loads(stdout.strip().splitlines()[-1])
    saved = json.loads((out / "results.json").read_text())
    names = [r["config"] for r in saved["rows"]]
    assert names == ["plain", "draft k=2", "draft k=auto", "transformers plain",
                     "transformers assisted k=2", "transformers prompt-lookup k=2"]
    assert [r["config"] for r in last["rows"]] == names
    assert len(saved["runs"]) == 2 * len(names)
    for r in saved["rows"]:
        assert r["tok_s"] > 0 and r["vs_plain"] > 0 and r["vs_transformers_plain"] > 0
        if r["config"].startswith("draft"):  # greedy: speculative output equals plain output
            assert r["greedy_mismatches"] == 0
    assert len(saved["rows"][1]["per_position_acceptance"]) == 2
    assert [(p["ours"], p["theirs"]) for p in last["pairs"]] == [
        ("plain", "transformers plain"), ("draft k=2", "transformers assisted k=2")]
    for f in ("tokens_per_s.png", "acceptance_by_position.png", "speedup_vs_k.png"):
        assert (out / f).stat().st_size > 1000
