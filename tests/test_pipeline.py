"""Pipeline parallel (specdec.distributed.pipeline): the layers over several processes, the same bits.

Every stage runs its layers with the code one process runs (Transformer.run_layers), and the
residual stream crosses between processes as it is (fp32, the last layer's MLP output added:
the IEEE add the next norm would have done). So there is no tolerance anywhere here: logits are
compared with torch.equal, and greedy output token for token. The stages are real processes
talking gloo over loopback (2 for SmolLM2, 3 for a tiny Qwen2 with biases and an untied head),
one torch thread each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.distributed import launch, pipeline
from specdec.errors import SpecdecError
from specdec.loader import build_engine, load_model, load_models, model_args
from specdec.runtime.kv_cache import ragged_block
from specdec.runtime.model import RowEmbedding
from tiny_hf import write_tiny_hf

PROBE = Path(__file__).with_name("pipeline_probe.py")
PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "List the planets of the solar system, in order.",
           "Repeat after me: the cat sat on the mat, the cat sat on the mat."]


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # rank 0; every other stage runs 1 thread too (2 cores here)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="class")
def smollm2_pair(one_thread):
    """(pipeline over 2 processes, the same model in this one, tokenizer); the default dtype
    (auto: the GGUF's own blocks), as `specdec generate` loads it."""
    pipe, tok = launch.launch("smollm2-135m", 2, threads=1)
    try:
        ref, _ = load_model("smollm2-135m")
        yield pipe, ref, tok
    finally:
        pipe.close()


def _same_forwards(pipe, ref, seqs: list[list[int]], V: int) -> None:
    """Prefill (ragged rows, no logits), decode steps, a verify-shaped forward over
    [last, d_1..d_4] with hidden states, logits at chosen positions on permuted rows, a tree
    mask, and a copied prefix: each gives the same bits from both models."""
    g = torch.Generator().manual_seed(0)
    B = len(seqs)
    cp, cr = pipe.new_cache(B + 1, 256), ref.new_cache(B + 1, 256)

    def both(*a, **kw):
        out_p, out_r = pipe.forward(*a, cp, **kw), ref.forward(*a, cr, **kw)
        for x, y in zip(*((o,) if isinstance(o, torch.Tensor) else o for o in (out_p, out_r))):
            assert x.shape == y.shape and torch.equal(x, y)
        return out_r

    tok, pos = ragged_block([s[:-1] for s in seqs], [0] * B, cp.capacity)
    both(tok, pos, logits_at=torch.zeros(B, 0, dtype=torch.long))  # prefill: no logits at all
    L = torch.tensor([len(s) - 1 for s in seqs])
    both(torch.tensor([[s[-1]] for s in seqs]), L.view(B, 1))  # a decode step
    for i in range(1, 4):
        both(torch.randint(0, V, (B, 1), generator=g), (L + i).view(B, 1))
    start = (L + 4).view(B, 1)
    feed = torch.randint(0, V, (B, 5), generator=g)
    both(feed, start + torch.arange(5), return_hidden=True)  # verify, k = 4, hidden states
    rows = torch.arange(B).flip(0)
    both(feed, start.flip(0) + torch.arange(5), rows=rows, logits_at=torch.tensor([[4, 0]] * B))
    tree = torch.tril(torch.ones(5, 5, dtype=torch.bool)).clone()
    tree[3, 1:3] = False  # a branch: position 3 sees the history, 0 and itself
    both(feed, start + torch.arange(5), mask=tree.expand(B, 5, 5))
    cp.copy_prefix(0, B, int(L[0]))
    cr.copy_prefix(0, B, int(L[0]))
    both(feed[:1], L[0] + torch.arange(5).view(1, 5), rows=torch.tensor([B]))  # the copied row


def test_split_layers_balances_memory_and_checks_a_given_split():
    """Rank 0 also holds the embedding and the head (2 V dim parameters: 16 of SmolLM2's 3.5M-
    parameter layers), so it gets fewer layers; a given split must cover the layers exactly."""
    args = model_args("smollm2-135m")
    assert pipeline.split_layers(args, 2) == [(0, 7), (7, 30)]
    assert pipeline.split_layers(args, 1) == [(0, 30)]
    assert pipeline.split_layers(args, 4, [1, 9, 10, 10]) == [(0, 1), (1, 10), (10, 20), (20, 30)]
    assert [b - a for a, b in pipeline.split_layers(args, 30)] == [1] * 30
    for stages, layers in [(2, [15, 14]), (2, [0, 30]), (3, [10, 20]), (31, None), (0, None)]:
        with pytest.raises(SpecdecError, match="pipeline_(layers|parallel)="):
            pipeline.split_layers(args, stages, layers)
    assert launch.parse_layers("7,23") == [7, 23] and launch.parse_layers(None) is None
    with pytest.raises(SpecdecError, match="pipeline_layers='7;23'"):
        launch.parse_layers("7;23")


def test_stage_parts_read_only_their_tensors():
    parts = [pipeline.stage_part([(0, 7), (7, 20), (20, 30)], r) for r in range(3)]
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.layers.6.mlp.up_proj.weight", "model.layers.7.input_layernorm.weight",
             "model.layers.29.self_attn.q_proj.bias"]
    assert [[p.needs(n) for n in names] for p in parts] == [
        [True, True, False, True, False, False],
        [False, False, False, False, True, False],
        [False, False, True, False, False, True]]
    assert parts[0].embed_rows and pipeline.stage_part([(0, 30)], 0).embed_rows


def test_tiny_qwen2_over_three_stages_fp32(tmp_path, one_thread):
    """Three processes (a middle stage that only relays), fp32 from a Hugging Face directory,
    q/k/v biases, an untied head."""
    path = write_tiny_hf(tmp_path / "tiny", vocab=96, arch="qwen2", dim=64, layers=5, heads=4,
                         kv_heads=2, inter=80)
    pipe, _ = launch.launch(path, 3, dtype="fp32", layers=[1, 2, 2], threads=1)
    try:
        ref, _ = load_model(path, "fp32", "cpu")
        assert pipe.ranges == [(0, 1), (1, 3), (3, 5)]
        g = torch.Generator().manual_seed(1)
        _same_forwards(pipe, ref, [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 30)], 96)
    finally:
        pipe.close()


class TestSmolLM2:
    """Two processes (7 + 23 layers) against SmolLM2 in this one; the pipeline is closed after
    the class, so that the other tests can start their own (one per process at a time)."""

    def test_row_embedding_is_the_dequantised_table(self, smollm2_pair):
        """Rank 0 keeps the embedding as stored and dequantises the rows it looks up: every
        row of SmolLM2's Q8_0 table gives the bits of the whole table's dequantisation."""
        pipe, ref, _ = smollm2_pair
        emb = pipe.model.embed
        assert isinstance(emb, RowEmbedding)
        ids = torch.arange(ref.args.vocab_size).view(64, -1)
        assert torch.equal(emb[ids], ref.embed[ids])

    def test_smollm2_logits_bit_identical_to_one_process(self, smollm2_pair):
        pipe, ref, tok = smollm2_pair
        assert pipe.ranges == [(0, 7), (7, 30)] and len(pipe.model.layers) == 7
        _same_forwards(pipe, ref, [tok.encode_prompt(p) for p in PROMPTS], ref.args.vocab_size)

    def test_greedy_speculative_equals_plain_through_the_engine(self, smollm2_pair):
        """The real engine on the pipeline: plain greedy output equals one process's, and
        greedy speculative decoding on the pipeline (n-gram drafts at k = 4; SmolLM2 itself as
        the draft model on rank 0 at k = 3, everything accepted, alone and in the composite)
        equals plain, batched, token for token."""
        pipe, ref, tok = smollm2_pair
        ids = [tok.encode_prompt(p) for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

        def run(target, spec=None, draft=None):
            models = load_models((target, tok), None if draft is None else (draft, tok))
            engine = build_engine(models, spec, max_model_len=256, max_batch=3)
            return [r.output for r in engine.generate(ids, params)]

        plain = run(ref)
        assert run(pipe) == plain
        assert run(pipe, SpeculativeConfig(proposer="ngram", num_draft_tokens=4)) == plain
        assert run(pipe, SpeculativeConfig(draft="smollm2-135m", proposer="draft", num_draft_tokens=3), draft=ref) == plain
        assert run(pipe, SpeculativeConfig(draft="smollm2-135m", num_draft_tokens=3), draft=ref) == plain  # composite
        stats = pipe.stats()
        assert [s.rank for s in stats] == [0, 1] and all(s.forwards > 0 for s in stats)


def _probe(mode: str, model: str) -> dict:
    out = subprocess.run([sys.executable, str(PROBE), mode, model], capture_output=True, text=True,
                         timeout=900, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _check_memory(model: str) -> None:
    """Fresh processes (a peak never goes down): one loading the model, and a 2-stage
    pipeline, each measured on a warm prepared-weights cache (a first run fills it: every load
    after the first maps the weights instead of reading the GGUF). Each stage holds about its
    share of the weights (rank 0: the embedding kept as stored, the head and its layers), and its
    peak resident memory above the imports (torch and the kernels, the same in every process) is
    at most its share of the single process's plus a tenth (the tokenizer on rank 0, message
    buffers)."""
    for mode in ("single", "pipeline"):  # fill the cache: whole model and each stage's part
        _probe(mode, model)
    single, pipe = _probe("single", model), _probe("pipeline", model)
    above = lambda p: [m - p["base_mb"] for m in p["peak_mb"]]  # noqa: E731
    print(json.dumps({"single": single, "pipeline": pipe}))
    total = sum(pipe["weights_mb"])
    assert all(w <= 0.6 * total for w in pipe["weights_mb"]), pipe
    for w, m in zip(pipe["weights_mb"], above(pipe)):
        assert m <= (w / total + 0.1) * above(single)[0], (single, pipe)


def test_smollm2_peak_memory_per_process_about_half():
    _check_memory("smollm2-135m")


@pytest.mark.slow
def test_qwen_1_5b_logits_greedy_and_memory(one_thread):
    """The same on Qwen2.5-Coder 1.5B (28 layers: 9 on rank 0, 19 on rank 1)."""
    pipe, tok = launch.launch("qwen2.5-coder-1.5b", 2, threads=1)
    try:
        ref, _ = load_model("qwen2.5-coder-1.5b")
        assert pipe.ranges == [(0, 9), (9, 28)]
        _same_forwards(pipe, ref, [tok.encode_prompt(p) for p in PROMPTS[:2]], ref.args.vocab_size)
        ids = [tok.encode_prompt(p) for p in PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        plain = [r.output for r in build_engine(load_models((ref, tok)), None, 256, 3).generate(ids, params)]
        spec = SpeculativeConfig(proposer="ngram", num_draft_tokens=4)
        engine = build_engine(load_models((pipe, tok)), spec, 256, 3)
        assert [r.output for r in engine.generate(ids, params)] == plain
    finally:
        pipe.close()
    del ref
    _check_memory("qwen2.5-coder-1.5b")


def test_a_stage_that_fails_to_load_fails_the_launch(tmp_path, one_thread):
    """A stage that dies while loading (here: a NaN in a tensor only rank 1 reads) fails the
    launch at once, naming what happened, not after the rendezvous timeout."""
    from safetensors.torch import load_file, save_file

    path = Path(write_tiny_hf(tmp_path / "tiny", vocab=32, layers=2))
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(SpecdecError, match="a pipeline stage exited with code 2"):
        launch.launch(str(path), 2, dtype="fp32", layers=[1, 1], threads=1)
