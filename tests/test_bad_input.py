"""Every bad input a user can give gets one clear error (issue 23).

A table of bad inputs to the CLI (run in-process through `specdec.cli.main`, as a user's argv),
the Python API (`LLM`, `SamplingParams`, `SpeculativeConfig`, `VerifySettings`), the server's
request bodies and prompt files. Each case asserts the outcome (exit code 2 with one line on
stderr, or one SpecdecError / BadRequest) and that the message names the field and what is
allowed. Then a hypothesis test throws random values at every SamplingParams and
SpeculativeConfig field: a valid object or one SpecdecError, never another exception. Last, the
CLI's failure modes as a user meets them, in subprocesses: a closed pipe, Ctrl-C at start-up.
Everything runs on tiny random models written as Hugging Face directories (vocabulary 16,
context 256), so no case waits on a real model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec.cli
from specdec.cli import build_parser, main
from specdec.config import MAX_SEED, SamplingParams, SpeculativeConfig
from specdec.errors import SpecdecError
from tiny_hf import write_tiny_hf

V, CTX = 16, 256
KW = dict(vocab=V, dim=32, layers=1, heads=4, kv_heads=2, inter=48, max_seq_len=CTX)
S64 = str(2**64)
SEED_RANGE = f"allowed [0, {MAX_SEED}]"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    files = {
        "T": write_tiny_hf(root / "target", seed=1, **KW),
        "D": write_tiny_hf(root / "draft", seed=2, **KW),
        "OUT": str(root / "out"),
        "MISSING": str(root / "missing.jsonl"),
    }
    contents = {
        "BADJSON": b'{"prompt": "w1 w2"}\n{"prompt": "w3\n',
        "NONSTR": b'{"prompt": 5}\n',
        "NOFIELD": b'["w1 w2"]\n',
        "BADUTF8": b'{"prompt": "w1 \xff"}\n',
        "EMPTY": b'{"prompt": ""}\n',
    }
    for key, data in contents.items():
        (root / f"{key.lower()}.jsonl").write_bytes(data)
        files[key] = str(root / f"{key.lower()}.jsonl")
    return files


G = ["generate", "--model", "{T}", "--raw"]
VF = ["verify", "--model", "{T}"]
B = ["bench", "--model", "{T}", "--output", "{OUT}", "--prompts", "chat", "--max-tokens", "2"]

# (argv, needles): the last stderr line must contain every needle (field, value, allowed range)
CLI_CASES = {
    "temperature nan": (G + ["--temperature", "nan"], ["temperature=nan", "not a finite number", "allowed [0.0, 2.0]"]),
    "temperature inf": (G + ["--temperature", "inf"], ["temperature=inf", "allowed [0.0, 2.0]"]),
    "temperature above 2": (G + ["--temperature", "3"], ["temperature=3.0 is out of range", "allowed [0.0, 2.0]"]),
    "temperature not a number": (G + ["--temperature", "hot"], ["temperature='hot' is not a number", "allowed [0.0, 2.0]"]),
    "top_p nan": (G + ["--top-p", "nan"], ["top_p=nan", "allowed (0.0, 1.0]"]),
    "min_p nan": (G + ["--min-p", "nan"], ["min_p=nan", "allowed [0.0, 1.0]"]),
    "repetition_penalty nan": (G + ["--repetition-penalty", "nan"], ["repetition_penalty=nan", "allowed (0.0, 10.0]"]),
    "presence_penalty inf": (G + ["--presence-penalty", "inf"], ["presence_penalty=inf", "allowed [-2.0, 2.0]"]),
    "frequency_penalty -inf": (G + ["--frequency-penalty=-inf"], ["frequency_penalty=-inf", "allowed [-2.0, 2.0]"]),
    "top_k not an integer": (G + ["--top-k", "1.5"], ["top_k=1.5 is not an integer", "allowed [0, inf)"]),
    "seed past 64 bits": (G + ["--seed", S64], [f"seed={S64} is out of range", SEED_RANGE]),
    "seed negative": (G + ["--seed=-1"], ["seed=-1 is out of range", SEED_RANGE]),
    "max_tokens 0": (G + ["--max-tokens", "0"], ["max_tokens=0 is out of range", "allowed [1, inf)"]),
    "empty stop string": (G + ["--stop", ""], ["stop has an empty string", "allowed: non-empty strings"]),
    "draft under ngram": (G + ["--proposer", "ngram", "--draft", "{D}"],
                          ["draft=", "not used by proposer='ngram'", "allowed: proposer draft or composite"]),
    "k without a proposer": (G + ["--num-draft-tokens", "4"],
                             ["num_draft_tokens='4' needs a proposer", "allowed with --draft MODEL, --head DIR or --proposer"]),
    "draft dtype without a draft": (G + ["--draft-dtype", "q4_0"], ["draft_dtype='q4_0' needs a proposer", "allowed with"]),
    "ngram flags with a draft proposer": (G + ["--draft", "{D}", "--proposer", "draft", "--ngram-max", "6"],
                                          ["ngram_max=6", "allowed: proposer ngram or composite"]),
    "max_draft_tokens with a fixed k": (G + ["--proposer", "ngram", "--num-draft-tokens", "3", "--max-draft-tokens", "5"],
                                        ["max_draft_tokens=5 is not used", "allowed: num_draft_tokens='auto'"]),
    "draft dtype native on an HF draft": (G + ["--draft", "{D}", "--draft-dtype", "native"],
                                          ["draft_dtype='native' needs a GGUF file, but draft", "allowed for it: auto, fp32, bf16"]),
    "dtype native on an HF target": (G + ["--dtype", "native"], ["dtype='native' needs a GGUF file, but model", "allowed for it"]),
    "max_model_len 0": (G + ["--max-model-len", "0"], ["max_model_len=0 is out of range", "allowed [2, inf)"]),
    "max_model_len past the model's": (G + ["--max-model-len", "100000"],
                                       ["max_model_len=100000 is out of range", f"allowed [2, {CTX}]"]),
    "threads 0": (G + ["--threads", "0"], ["threads=0 is out of range", "allowed [1, inf)"]),
    "prompt not UTF-8": (["generate", "--model", "{T}", "--raw", "w1 \udcff"],
                         ["prompt is not valid UTF-8", "byte 0xff", "allowed: UTF-8 text"]),
    "prompt empty": (["generate", "--model", "{T}", "--raw", ""], ["prompt is empty", "at least 1 character"]),
    "composite without a draft or a head": (G + ["--proposer", "composite"],
                                            ["proposer='composite' needs a draft model (--draft MODEL) or a draft head",
                                             "no head is shipped for model"]),
    "composite with a draft and a head": (G + ["--proposer", "composite", "--draft", "{D}", "--head", "{OUT}"],
                                          ["head=", "allowed: one of them"]),
    "proposer unknown": (G + ["--proposer", "bogus"], ["proposer='bogus'", "allowed: draft, ngram, composite"]),
    "k past 32": (G + ["--proposer", "ngram", "--num-draft-tokens", "33"], ["num_draft_tokens=33", "allowed [0, 32]"]),
    "ngram_min 0": (G + ["--proposer", "ngram", "--ngram-min", "0"], ["ngram_min=0", "allowed [1, 64]"]),
    "dtype unknown (argparse)": (G + ["--dtype", "q3"], ["--dtype", "invalid choice: 'q3'", "auto"]),
    "verify max_seconds -1": (VF + ["--max-seconds=-1"], ["max_seconds=-1.0 is out of range", "allowed (0.0, inf)"]),
    "verify batch 0": (VF + ["--batch", "0"], ["batch=0 is out of range", "allowed [1, inf)"]),
    "verify alpha nan": (VF + ["--alpha", "nan"], ["alpha=nan", "allowed (0.0, 1.0)"]),
    "verify seed past 64 bits": (VF + ["--seed", S64], [f"seed={S64}", SEED_RANGE]),
    "verify draft under ngram": (VF + ["--proposer", "ngram", "--draft", "{D}"], ["draft=", "allowed: proposer draft"]),
    "verify max_model_len (unused there)": (VF + ["--max-model-len", "64"], ["unrecognized arguments: --max-model-len"]),
    "bench prompts file missing": (B[:-4] + ["--prompts", "{MISSING}"], ["prompts file", "does not exist", "allowed:"]),
    "bench malformed JSONL": (B[:-4] + ["--prompts", "{BADJSON}"], ["badjson.jsonl:2: not valid JSON", "allowed: one"]),
    "bench non-string prompt": (B[:-4] + ["--prompts", "{NONSTR}"], ["nonstr.jsonl:1: prompt=5 is not a string", "allowed"]),
    "bench line without a prompt": (B[:-4] + ["--prompts", "{NOFIELD}"], ["nofield.jsonl:1:", "needs a \"prompt\" field"]),
    "bench file not UTF-8": (B[:-4] + ["--prompts", "{BADUTF8}"], ["badutf8.jsonl:1: not valid UTF-8", "byte 0xff"]),
    "bench empty prompt": (B[:-4] + ["--prompts", "{EMPTY}"], ["empty.jsonl:1: prompt is empty"]),
    "bench unknown prompt set": (B[:-4] + ["--prompts", "nope"], ["unknown prompt set 'nope'", "allowed: humaneval, chat"]),
    "bench repeats 0": (B + ["--repeats", "0"], ["repeats=0 is out of range", "allowed [1, inf)"]),
    "bench max_draft_tokens with fixed ks": (B + ["--num-draft-tokens", "2", "--max-draft-tokens", "4"],
                                             ["max_draft_tokens=4 is not used", "allowed"]),
    "bench max_model_len past the model's": (B + ["--max-model-len", "100000"], ["max_model_len=100000", f"allowed [2, {CTX}]"]),
    "models fetch unknown": (["models", "fetch", "no-such-model"], ["unknown model 'no-such-model'", "known:"]),
    "models fetch one unknown of two": (["models", "fetch", "smollm2-135m", "nope"], ["unknown model 'nope'", "known:"]),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input_is_one_line_exit_2(case, paths, capsys):
    argv, needles = CLI_CASES[case]
    if argv[0] == "generate" and not case.startswith("prompt "):
        argv = argv + ["w1 w2"]  # the prompt
    try:
        rc = main([a.format(**paths) if "{" in a else a for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("specdec: error:") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---- the Python API ---------------------------------------------------------------------------

# (what to call, field named, allowed-range text)
API_CASES = {
    "SamplingParams top_k=True": (lambda p: SamplingParams(top_k=True), "top_k=True", "allowed [0, inf)"),
    "SamplingParams stop_token_ids=[-1]": (lambda p: SamplingParams(stop_token_ids=[-1]), "stop_token_ids=-1", "allowed [0,"),
    "SamplingParams stop_token_ids a string": (lambda p: SamplingParams(stop_token_ids="1,2"), "stop_token_ids=", "allowed: integers"),
    "SamplingParams seed 2**64": (lambda p: SamplingParams(seed=2**64), "seed=", SEED_RANGE),
    "SamplingParams seed float": (lambda p: SamplingParams(seed=1.0), "seed=1.0 is not an integer", SEED_RANGE),
    "SamplingParams seed_stable not a bool": (lambda p: SamplingParams(seed_stable="yes"), "seed_stable='yes'",
                                              "allowed True, False or None"),
    "SamplingParams ignore_eos=1": (lambda p: SamplingParams(ignore_eos=1), "ignore_eos=1", "allowed True or False"),
    "SamplingParams stop not strings": (lambda p: SamplingParams(stop=[1]), "stop=[1]", "allowed: up to 16"),
    "SamplingParams 17 stop strings": (lambda p: SamplingParams(stop=["x"] * 17), "stop has 17", "allowed at most 16"),
    "SamplingParams logprobs 21": (lambda p: SamplingParams(logprobs=21), "logprobs=21", "allowed [0, 20]"),
    "SamplingParams temperature string": (lambda p: SamplingParams(temperature="0.5"), "temperature='0.5'", "allowed [0.0, 2.0]"),
    "SamplingParams temperature huge int": (lambda p: SamplingParams(temperature=10**400), "temperature=", "allowed [0.0, 2.0]"),
    "SamplingParams max_tokens bool": (lambda p: SamplingParams(max_tokens=True), "max_tokens=True", "allowed [1, inf)"),
    "SamplingParams min_p None": (lambda p: SamplingParams(min_p=None), "min_p=None", "allowed [0.0, 1.0]"),
    "SpeculativeConfig k 33": (lambda p: SpeculativeConfig(proposer="ngram", num_draft_tokens=33), "num_draft_tokens=33", "allowed [0, 32]"),
    "SpeculativeConfig k True": (lambda p: SpeculativeConfig(proposer="ngram", num_draft_tokens=True), "num_draft_tokens=True", "[0, 32]"),
    "SpeculativeConfig max_draft float": (lambda p: SpeculativeConfig(proposer="ngram", max_draft_tokens=2.0),
                                          "max_draft_tokens=2.0", "allowed [0, 32]"),
    "SpeculativeConfig ngram_max string": (lambda p: SpeculativeConfig(proposer="ngram", ngram_max="4"), "ngram_max='4'", "allowed [1, 64]"),
    "SpeculativeConfig draft_dtype": (lambda p: SpeculativeConfig(draft="x", draft_dtype=5), "draft_dtype=5", "allowed: auto, fp32"),
    "SpeculativeConfig draft_sampling None": (lambda p: SpeculativeConfig(draft="x", draft_sampling=None), "draft_sampling=None",
                                              "allowed: probabilistic, greedy"),
    "SpeculativeConfig draft not a str": (lambda p: SpeculativeConfig(draft=5), "draft=5", "allowed: a registry name"),
    "LLM max_model_len=0": (lambda p: _llm(p, max_model_len=0), "max_model_len=0", "allowed [2, inf)"),
    "LLM max_batch=0": (lambda p: _llm(p, max_batch=0), "max_batch=0", "allowed [1, 256]"),
    "LLM max_batch=True": (lambda p: _llm(p, max_batch=True), "max_batch=True", "allowed [1, 256]"),
    "LLM model not a str": (lambda p: _llm(p, model=5), "model=5", "allowed: a registry name"),
    "LLM dtype unknown": (lambda p: _llm(p, dtype="q3"), "dtype='q3'", "allowed: auto, fp32, bf16, native, q4_0"),
    "LLM speculative_config not a dict": (lambda p: _llm(p, speculative_config=5), "speculative_config=5",
                                          "allowed: a SpeculativeConfig, a dict"),
    "LLM speculative_config unknown key": (lambda p: _llm(p, speculative_config={"drafts": "x"}),
                                           "speculative_config has an unknown field 'drafts'", "allowed: draft,"),
    "LLM draft under ngram": (lambda p: _llm(p, speculative_config={"proposer": "ngram", "draft": p["D"]}),
                              "draft=", "allowed: proposer draft or composite"),
    "LLM draft_dtype native on an HF draft": (lambda p: _llm(p, speculative_config={"draft": p["D"], "draft_dtype": "native"}),
                                              "draft_dtype='native' needs a GGUF file, but draft", "allowed for it"),
    "LLM max_model_len past the model's": (lambda p: _llm(p, max_model_len=100000), "max_model_len=100000",
                                           f"allowed [2, {CTX}]"),
    "generate sampling_params dict with a bad value": (lambda p: _gen(p, "w1", {"temperature": "hot"}),
                                                       "temperature='hot'", "allowed [0.0, 2.0]"),
    "generate sampling_params dict with an unknown key": (lambda p: _gen(p, "w1", {"temp": 1}),
                                                          "sampling_params has an unknown field 'temp'", "allowed: temperature"),
    "generate sampling_params not params": (lambda p: _gen(p, "w1", 5), "sampling_params=5", "allowed: a SamplingParams"),
    "generate params changed after construction": (lambda p: _gen(p, "w1", _mutated()), "top_p=nan", "allowed (0.0, 1.0]"),
    "generate prompt bytes not UTF-8": (lambda p: _gen(p, b"w1 \xff"), "prompt is not valid UTF-8", "allowed: UTF-8 text"),
    "generate prompt str not UTF-8": (lambda p: _gen(p, "w1 \udcff"), "prompt is not valid UTF-8", "allowed: UTF-8 text"),
    "generate token id past the vocabulary": (lambda p: _gen(p, [[1, V]]), f"prompt has token id {V}", f"allowed: integers in [0, {V - 1}]"),
    "generate stop id past the vocabulary": (lambda p: _gen(p, "w1", SamplingParams(stop_token_ids=[V])),
                                             f"stop_token_ids has {V}", f"allowed token ids [0, {V - 1}]"),
    "generate prompts not prompts": (lambda p: _gen(p, 5), "prompts=5", "allowed: str, bytes"),
    "generate no prompts": (lambda p: _gen(p, []), "prompts is an empty list", "at least 1 prompt"),
    "VerifySettings max_seconds -1": (lambda p: _verify_settings(max_seconds=-1), "max_seconds=-1", "allowed (0.0, inf)"),
    "VerifySettings batch 0": (lambda p: _verify_settings(batch=0), "batch=0", "allowed [1, inf)"),
    "VerifySettings n 9": (lambda p: _verify_settings(n=9), "n=9", "allowed [1, 8]"),
    "load_prompts missing file": (lambda p: _prompts(p["MISSING"]), "prompts file", "does not exist"),
}

_LLM = {}


def _llm(p, **kw):
    from specdec.api import LLM

    return LLM(kw.pop("model", p["T"]), **kw)


def _gen(p, prompts, params=None):
    if "llm" not in _LLM:
        _LLM["llm"] = _llm(p, max_batch=2)
    return _LLM["llm"].generate(prompts, params, raw=True)


def _mutated():
    params = SamplingParams()
    params.top_p = float("nan")  # dataclasses are mutable: generate re-checks what it is given
    return params


def _verify_settings(**kw):
    from specdec.tools.audit import VerifySettings

    return VerifySettings(params=SamplingParams(), proposer="ngram", **kw)


def _prompts(name):
    from specdec.tools.prompts import load_prompts

    return load_prompts(name)


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_input_is_one_specdec_error(case, paths):
    call, field, allowed = API_CASES[case]
    with pytest.raises(SpecdecError) as e:
        call(paths)
    msg = str(e.value)
    assert "\n" not in msg and field in msg and allowed in msg, msg


@pytest.mark.parametrize("body, param, allowed", [
    ({"temperature": float("nan")}, "temperature", "allowed [0.0, 2.0]"),
    ({"temperature": "hot"}, "temperature", "allowed [0.0, 2.0]"),
    ({"seed": 2**64}, "seed", SEED_RANGE),
    ({"top_k": True}, "top_k", "allowed [0, inf)"),
    ({"stop_token_ids": [V]}, "stop_token_ids", f"allowed token ids [0, {V - 1}]"),
    ({"seed_stable": "yes"}, "seed_stable", "allowed True, False or None"),
])
def test_server_request_bad_sampling_field_names_it(body, param, allowed):
    """The server's bodies get the very SamplingParams checks: the same message, the field as
    the error's param."""
    from specdec.serve.protocol import BadRequest, CompletionRequest

    with pytest.raises(BadRequest) as e:
        CompletionRequest(prompt="w1", **body).sampling_params(8, None, V)
    assert e.value.param == param and allowed in e.value.message, e.value.message


def test_server_request_text_must_be_utf8():
    """A JSON "\\ud800" decodes to a lone surrogate, which the tokenizer cannot take (a 500
    before): the body is refused, naming the field."""
    from pydantic import ValidationError

    from specdec.serve.protocol import ChatCompletionRequest, CompletionRequest

    for make, field in ((lambda: CompletionRequest(prompt=["ok", "w1 \ud800"]), "prompt"),
                        (lambda: ChatCompletionRequest(messages=[{"role": "user", "content": "\udcff"}]), "content")):
        with pytest.raises(ValidationError) as e:
            make()
        err = e.value.errors()[0]
        assert field in err["loc"] and "allowed: UTF-8 text" in err["msg"], err


def test_server_request_passes_seed_stable_and_vllm_top_k_off():
    from specdec.serve.protocol import CompletionRequest

    p = CompletionRequest(prompt="w1", seed=7, seed_stable=False, top_k=-1, n=2).sampling_params(8, None, V)
    assert p.seed_stable is False and p.top_k == 0 and p.seed == 7
    p1 = CompletionRequest(prompt="w1", seed=MAX_SEED, n=2).sampling_params(8, None, V, choice=1)
    assert p1.seed == 0 and p1.seed_stable is None  # choice j: seed + j, within the one seed range


def test_cli_seed_stable_flag_reaches_sampling_params():
    from specdec.tools.commands import sampling_params

    parse = build_parser().parse_args
    assert sampling_params(parse(["generate", "--seed", "3", "--seed-stable", "x"])).seed_stable is True
    assert sampling_params(parse(["bench", "--no-seed-stable"])).seed_stable is False
    assert sampling_params(parse(["generate", "x"])).seed_stable is None


def test_help_shows_defaults():
    ap = build_parser()
    sub = ap._subparsers._group_actions[0]
    text = " ".join(sub.choices["generate"].format_help().split())
    for shown in ("k_max for auto, [0, 32] (default: 8)", "(default: probabilistic)", "(default: 1.0)",
                  "(default: 128)", "(default: auto)", "(default: on when --seed is given)"):
        assert shown in text, shown
    assert "(default: 2 4 6)" in " ".join(sub.choices["bench"].format_help().split())


def test_models_fetch_progress_goes_to_stderr(monkeypatch, capsys, tmp_path):
    """stdout carries only the fetched path, so `path=$(specdec models fetch NAME)` works."""
    from specdec.runtime import hub

    def fake_fetch(name, progress=print):
        for s in ("downloading", "checking"):
            progress(s)
        return tmp_path / "m.gguf"

    monkeypatch.setattr(hub, "fetch", fake_fetch)
    assert main(["models", "fetch", "smollm2-135m"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'm.gguf'}\n"


def test_models_fetch_several_names_checks_all_first(monkeypatch, capsys, tmp_path):
    """`models fetch A B` prints one path per model, in order, once each; an unknown name among
    them is refused before anything is downloaded."""
    from specdec.runtime import hub

    fetched = []

    def fake_fetch(name, progress=print):
        fetched.append(name)
        return tmp_path / f"{name}.gguf"

    monkeypatch.setattr(hub, "fetch", fake_fetch)
    names = list(hub.REGISTRY)[:2]
    assert main(["models", "fetch", *names, names[0]]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / f"{n}.gguf") for n in names]
    assert fetched == names
    fetched.clear()
    assert main(["models", "fetch", names[0], "no-such-model"]) != 0
    assert fetched == []


# ---- random values at every field --------------------------------------------------------------

ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
    st.text(max_size=6), st.sampled_from(["auto", "ngram", "draft", "q4_0", "greedy", "", "\udcff", "1"]),
    st.lists(st.one_of(st.integers(-3, 2**40), st.text(max_size=3), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.tuples(st.integers()),
)


def _fields(cls):
    return [f.name for f in dataclasses.fields(cls)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_values_give_a_valid_object_or_one_specdec_error(data):
    """One to three fields at a time, any value: construction either succeeds with every field
    normalised (finite floats, true ints, lists) or raises SpecdecError; a TypeError, an
    OverflowError or an AssertionError here would be a traceback for a user."""
    for cls in (SamplingParams, SpeculativeConfig):
        names = data.draw(st.lists(st.sampled_from(_fields(cls)), min_size=1, max_size=3, unique=True))
        kw = {n: data.draw(ANYTHING, label=f"{cls.__name__}.{n}") for n in names}
        try:
            obj = cls(**kw)
            if cls is SpeculativeConfig:
                obj.check_unused()
        except SpecdecError as e:
            assert "\n" not in str(e) and e.field is not None
            continue
        if cls is SamplingParams:
            for n in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
                v = getattr(obj, n)
                assert type(v) is float and math.isfinite(v), (n, v)
            assert all(type(t) is int and t >= 0 for t in obj.stop_token_ids)
            assert all(isinstance(s, str) and s for s in obj.stop)
            assert obj.seed is None or 0 <= obj.seed <= MAX_SEED
            assert obj.seed_stable in (None, True, False)
            assert dataclasses.replace(obj) == obj  # re-checking a valid object changes nothing
        else:
            assert obj.num_draft_tokens == "auto" or type(obj.num_draft_tokens) is int
            assert type(obj.max_draft_tokens) is int and type(obj.ngram_min) is int


# ---- failure modes of the command itself -------------------------------------------------------

def test_internal_error_is_one_line_exit_1_and_debug_shows_the_traceback(monkeypatch, capsys, paths):
    import specdec.cli as cli

    def boom(a):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cli, "cmd_generate", boom)
    assert main(["generate", "--model", paths["T"], "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: disk on fire" in err and "SPECDEC_DEBUG=1" in err
    monkeypatch.setenv("SPECDEC_DEBUG", "1")
    assert main(["generate", "--model", paths["T"], "x"]) == 1
    assert "Traceback" in capsys.readouterr().err

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.delenv("SPECDEC_DEBUG")
    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert main(["generate", "--model", paths["T"], "x"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def _spawn(paths, stdout, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SPECDEC_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "--model", paths["T"], "--raw",
                             "--threads", "1", *extra, "w1 w2 w3"],
                            stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)


def test_closed_pipe_is_quiet(paths):
    """`specdec generate ... | head -c 5`: the reader has gone before the first token is written;
    the command ends quietly with 141 (128 + SIGPIPE), no traceback, and no second error from
    the interpreter's final flush of stdout."""
    r, w = os.pipe()
    os.close(r)  # a reader that has already closed: the first write meets EPIPE
    proc = _spawn(paths, w, "--max-tokens", "50", "--temperature", "0")
    os.close(w)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


def test_ctrl_c_swallowed_during_start_up_still_exits_130(monkeypatch, capsys):
    """A Ctrl-C whose KeyboardInterrupt a library's bare `except:` swallowed while start-up was
    importing it (seen once in the whole suite: the subprocess test below then ran to the end and
    exited 0) still ends the command with 130 and one line; the caller's SIGINT handler is back
    afterwards."""
    def swallowing(a):
        try:
            signal.raise_signal(signal.SIGINT)
        except:  # noqa: E722  (what such a library does)
            pass
        return 0

    monkeypatch.setattr(specdec.cli, "_dispatch", swallowing)
    before = signal.getsignal(signal.SIGINT)
    assert main(["models", "list"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before
    monkeypatch.setattr(specdec.cli, "_dispatch", lambda a: 0)
    assert main(["models", "list"]) == 0  # (the record is per run)


def test_ctrl_c_during_start_up_is_one_line_exit_130(paths):
    """SIGINT while the command is still importing torch (its start-up: before any model is
    loaded) ends it with 130 and one line, no traceback. We wait until torch's shared library is
    mapped into the process, so the signal lands inside start-up, after Python itself started."""
    proc = _spawn(paths, subprocess.DEVNULL, "--max-tokens", "5")
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            with open(maps) as f:
                if "libtorch" in f.read():
                    break
        except OSError:
            break  # no /proc: fall back to a fixed wait
        time.sleep(0.01)
    else:
        pytest.fail("the command ended before it could be interrupted")
    if not os.path.exists(maps):
        time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "specdec: interrupted", err
