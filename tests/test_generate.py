"""Plain greedy generation against transformers' generate, and the CLI's contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.engine import Engine

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Tell me a short story about a robot.",
    "What is 17 times 23?",
    "def quicksort(arr):",
    "Give me a haiku about autumn.",
    "Why is the sky blue?",
]


def test_greedy_equals_transformers_generate(smollm2, smollm2_hf):
    """10 chat prompts x up to 64 tokens (both stop at EOS): our greedy tokens equal
    transformers' greedy generate token for token, EOS included."""
    model, tok = smollm2
    engine = Engine(model, tok, max_seq_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for prompt in PROMPTS:
        ids = tok.encode_prompt(prompt)
        ours = engine.generate([ids], params)[0].output
        with torch.no_grad():
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64,
                                      do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert ours == ref, prompt


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-0.5"], "temperature=-0.5"),
    (["--top-p", "0"], "top_p=0.0"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--top-k", "-1"], "top_k=-1"),
    (["--min-p", "1.2"], "min_p=1.2"),
    (["--max-tokens", "0"], "max_tokens=0"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--model", "/nonexistent/model.gguf"], "model file not found"),
    (["--max-model-len", "16"], "prompt has"),
    (["--proposer", "ngram", "--num-draft-tokens", "banana"], "num_draft_tokens='banana'"),
    (["--proposer", "ngram", "--num-draft-tokens", "40"], "num_draft_tokens=40"),
    (["--proposer", "ngram", "--max-draft-tokens", "-2"], "max_draft_tokens=-2"),
    (["--proposer", "bogus"], "proposer='bogus'"),
    (["--proposer", "ngram", "--ngram-min", "5", "--ngram-max", "2"], "ngram_min=5 > ngram_max=2"),
])
def test_cli_bad_input_is_one_line_exit_2(args, needle, smollm2_dir):
    r = run_cli("generate", *args, "Write a long essay about the history of the printing press.")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert needle in lines[-1] and lines[-1].startswith("specdec: error:"), r.stderr


def test_cli_empty_prompt_and_truncated_file(tmp_path, smollm2_dir):
    r = run_cli("generate", "")
    assert r.returncode == 2 and "prompt is empty" in r.stderr and "Traceback" not in r.stderr
    from specdec.runtime.hub import model_path

    bad = tmp_path / "cut.gguf"
    bad.write_bytes(model_path("smollm2-135m").read_bytes()[:1_000_000])
    r = run_cli("generate", "--model", str(bad), "hi")
    assert r.returncode == 2 and "corrupt or truncated" in r.stderr and "Traceback" not in r.stderr


def test_cli_json_output(smollm2_dir):
    r = run_cli("generate", "--temperature", "0", "--max-tokens", "8", "--json", "--threads", "2", "Say hi")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason", "usage", "timing", "stats"}
    assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 8
    assert set(out["timing"]) == {"load_s", "prefill_s", "ttft_s", "prompt_tokens_per_s", "decode_s",
                                  "decode_tokens_per_s"}
    t = out["timing"]
    # the first token follows the prompt's processing, and the prompt rate is the prompt over it
    assert 0 < t["prefill_s"] <= t["ttft_s"]
    assert t["prompt_tokens_per_s"] == pytest.approx(out["usage"]["prompt_tokens"] / t["prefill_s"])
    assert out["finish_reason"] in ("stop", "length")


def test_cli_stats_report_prompt_processing_and_ttft(smollm2_dir):
    r = run_cli("generate", "--temperature", "0", "--max-tokens", "4", "--stats", "--threads", "2", "Say hi")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("[prompt "))
    assert " tokens in " in line and "tok/s), time to first token " in line and ", load " in line


def test_same_seed_same_text(smollm2):
    model, tok = smollm2
    engine = Engine(model, tok)
    ids = tok.encode_prompt("Tell me a joke.")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234)
    a = engine.generate([ids], params)[0].output
    b = engine.generate([ids], params)[0].output
    c = engine.generate([ids], SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=99))[0].output
    assert a == b
    assert a != c  # a different seed gives different text (with overwhelming probability)


STATS_KEYS = {"rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length",
              "per_position_acceptance", "draft_cost_ratio", "predicted_speedup", "chosen_k_histogram",
              "proposers"}


@pytest.mark.parametrize("spec_args", [["--draft", "smollm2-135m", "--num-draft-tokens", "3"],
                                       ["--proposer", "ngram", "--num-draft-tokens", "3"],
                                       ["--proposer", "ngram"]])  # default: --num-draft-tokens auto
def test_cli_speculative_json_stats(spec_args, smollm2_dir):
    r = run_cli("generate", *spec_args, "--temperature", "0", "--max-tokens", "16", "--json", "--threads", "2",
                "Repeat after me: one two three, one two three, one two three")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["stats"]) == STATS_KEYS
    s = out["stats"]
    assert 0 <= s["acceptance_rate"] <= 1 and s["accepted_tokens"] <= s["draft_tokens"]
    if s["rounds"]:
        assert s["mean_acceptance_length"] == pytest.approx(s["accepted_tokens"] / s["rounds"] + 1)
    # per-proposer metrics add up to the totals; the chosen-k histogram covers every round
    per = s["proposers"]
    assert set(per) <= {"draft", "ngram"}
    if "--draft" in spec_args:  # the default with a draft model is the composite: the lookup drafts the repeats
        assert per.get("ngram", {}).get("proposals", 0) > 0, per
    assert sum(p["tokens_proposed"] for p in per.values()) == s["draft_tokens"]
    assert sum(p["tokens_accepted"] for p in per.values()) == s["accepted_tokens"]
    assert sum(p["proposals"] for p in per.values()) == s["rounds"]
    assert sum(s["chosen_k_histogram"].values()) >= s["rounds"]
    if "3" in spec_args:
        assert set(s["chosen_k_histogram"]) <= {"0", "1", "2", "3"}


def test_api_speculative_config_matches_plain(smollm2_dir):
    import specdec

    params = specdec.SamplingParams(temperature=0, max_tokens=12)
    plain = specdec.LLM("smollm2-135m", max_model_len=512).generate(["Name a fruit."], params)[0]
    spec = specdec.LLM("smollm2-135m", speculative_config={"draft": "smollm2-135m", "num_draft_tokens": 3},
                       max_model_len=512).generate(["Name a fruit."], params)[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.stats["rounds"] > 0


@pytest.mark.parametrize("cfg, needle", [
    ({"draft": "smollm2-135m", "num_draft_tokens": -1}, "num_draft_tokens=-1"),
    ({"draft": "smollm2-135m", "num_draft_tokens": 33}, "num_draft_tokens=33"),
    ({"draft": "smollm2-135m", "num_draft_tokens": "sometimes"}, "num_draft_tokens='sometimes'"),
    ({"draft": "smollm2-135m", "max_draft_tokens": -1}, "max_draft_tokens=-1"),
    ({"draft": "smollm2-135m", "max_draft_tokens": 33}, "max_draft_tokens=33"),
    ({"draft": "smollm2-135m", "draft_sampling": "sometimes"}, "draft_sampling='sometimes'"),
    ({"draft": "smollm2-135m", "draft_dtype": "q3"}, "draft_dtype='q3'; allowed: auto, fp32, bf16, native, q4_0"),
    ({"proposer": "magic"}, "proposer='magic'"),
    ({"proposer": "ngram", "ngram_min": 4, "ngram_max": 2}, "ngram_min=4 > ngram_max=2"),
])
def test_speculative_config_errors(cfg, needle):
    from specdec.config import SpeculativeConfig
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig(**cfg)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("top_p", float("nan")), ("min_p", float("nan")),
    ("repetition_penalty", float("nan")), ("presence_penalty", float("nan")),
    ("frequency_penalty", float("nan")), ("temperature", "0.5"), ("top_k", True), ("min_p", None),
])
def test_sampling_params_refuse_nan_and_non_numbers(field, value):
    """NaN fails every comparison, so a range check alone lets it through (it once reached an
    assertion, a torch error or a silent no-op); a string or a bool is not a number either.
    Each is refused naming the field and the allowed range."""
    with pytest.raises(SpecdecError, match=rf"^{field}=.* allowed [\[(]"):
        SamplingParams(**{field: value})
