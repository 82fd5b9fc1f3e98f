"""What a server needs of the engine, on tiny random models: prefix reuse (a free row keeps its
KV; siblings copy it), chunked prefill, and log-probabilities equal to plain decoding's.

Every check compares against a fresh engine that computes everything itself: reuse must change
how much is computed, never what comes out (the kernels give a position the same bits in any
batch or block, so equality is exact).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.proposers import DraftModelProposer

V, CTX = 64, 256
SHARED = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
A, B = SHARED + [1, 1, 2], SHARED + [7, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


class Counting:
    """The model, counting the tokens it is fed."""

    def __init__(self, model):
        self.model, self.fed = model, 0
        self.args, self.device, self.new_cache = model.args, model.device, model.new_cache

    def forward(self, tokens, *a, **kw):
        self.fed += tokens.numel()
        return self.model.forward(tokens, *a, **kw)

    __call__ = forward


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=V, max_seq_len=CTX)


def plain(model, prompt, params=GREEDY):
    return Engine(model, None, max_seq_len=CTX, vocab_size=V).generate([prompt], params)[0]


def test_free_row_keeps_its_prefix(target):
    m = Counting(target)
    engine = Engine(m, None, max_seq_len=CTX, vocab_size=V, max_batch=2)
    first = engine.generate([A], GREEDY)[0]
    fed = m.fed
    second = engine.generate([B], GREEDY)[0]
    assert second.cached_tokens == len(SHARED)
    assert second.output == plain(target, B).output and first.output == plain(target, A).output
    # the second prompt fed only its own 2 tokens (its first round feeds the last one)
    assert m.fed - fed == (len(B) - 1 - len(SHARED)) + second.stats.target_forwards
    # negative control: an unrelated prompt reuses nothing
    other = engine.generate([[1, 2, 3, 4]], GREEDY)[0]
    assert other.cached_tokens == 0


def test_siblings_copy_the_leaders_prefill(target):
    m = Counting(target)
    engine = Engine(m, None, max_seq_len=CTX, vocab_size=V, max_batch=4)
    reqs = engine.generate([A, A, A, B], GREEDY)
    assert [r.cached_tokens for r in reqs] == [0, len(A) - 1, len(A) - 1, len(SHARED)]
    # one prefill forward for A's tokens only: the rest were copied
    assert all(r.output == plain(target, A).output for r in reqs[:3])
    assert reqs[3].output == plain(target, B).output


def test_chunked_prefill_interleaves_and_matches(target):
    long_prompt = (SHARED * 4)[:100]
    engine = Engine(target, None, max_seq_len=CTX, vocab_size=V, max_batch=2, prefill_chunk=16)
    engine.reserve(2)
    short = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40))
    engine.step()
    longr = engine.add_request(long_prompt, GREEDY)
    decoded_while_prefilling = 0
    while engine.cache.lengths[longr.row] < len(long_prompt) - 1:
        before = len(short.output)
        engine.step()
        decoded_while_prefilling += len(short.output) - before
    assert decoded_while_prefilling >= 100 // 16 - 1  # the short row never waited a whole prompt
    engine.run()
    assert longr.output == plain(target, long_prompt).output
    assert short.output == plain(target, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=40)).output


def test_draft_model_reuses_its_prefix_too(target):
    draft = tiny_model(seed=3, vocab=V, dim=32, layers=1, max_seq_len=CTX)
    engine = Engine(target, None, DraftModelProposer(draft, V, CTX), num_draft_tokens=3,
                    max_seq_len=CTX, vocab_size=V, max_batch=1)
    engine.generate([A], GREEDY)
    r = engine.add_request(B, GREEDY)
    assert engine.proposer.cache.lengths[r.row] == len(SHARED)
    engine.run()
    assert r.output == plain(target, B).output and r.stats.rounds > 0 and r.stats.draft_tokens > 0


@pytest.mark.parametrize("draft_seed", [None, 7])  # the target itself (all accepted), a random model
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=5),
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, frequency_penalty=0.5, repetition_penalty=1.3),
])
def test_logprobs_equal_plain_and_reference(target, params, draft_seed):
    base = plain(target, A, params)
    draft = target if draft_seed is None else tiny_model(seed=draft_seed, vocab=V, dim=32, layers=1, max_seq_len=CTX)
    engine = Engine(target, None, DraftModelProposer(draft, V, CTX), num_draft_tokens=4,
                    max_seq_len=CTX, vocab_size=V)
    spec = engine.generate([A], params)[0]
    assert spec.stats.draft_tokens > 0 and spec.output == base.output
    assert [(t.token, t.logprob, t.top) for t in spec.logprobs] == \
        [(t.token, t.logprob, t.top) for t in base.logprobs]
    assert len(base.logprobs) == len(base.output) and all(len(t.top) == params.logprobs for t in base.logprobs)
    # the slow reference: one causal forward over the whole text, the chain at each position
    from specdec import sampling
    seq = A + base.output
    logits = target.forward(torch.tensor([seq]), torch.arange(len(seq))[None], target.new_cache(1, CTX))[0]
    for j, t in enumerate(base.output):
        hist = seq[: len(A) + j]
        counts = torch.zeros(V)
        for x in base.output[:j]:
            counts[x] += 1
        seen = torch.zeros(V, dtype=torch.bool)
        seen[torch.tensor(hist)] = True
        ref = sampling.logprobs(logits[len(A) + j - 1][None, :V], params, counts[None], seen[None])[0]
        assert base.logprobs[j].token == t
        assert abs(base.logprobs[j].logprob - ref[t].item()) < 1e-5
        assert base.logprobs[j].top[0][0] == int(ref.argmax())


def test_logprobs_refused_out_of_range():
    with pytest.raises(ValueError, match=r"logprobs=21 is out of range; allowed \[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match=r"logprobs=True is not an integer; allowed \[0, 20\]"):
        SamplingParams(logprobs=True)


@pytest.mark.parametrize("stable", [False, True])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_a_seed_reproduces_whatever_else_runs(target, proposer, stable):
    """A seeded request's dice depend on its own rounds only: alone, or in a batch whose other
    rows draft more or fewer tokens (an n-gram's misses, rows cut short by max_tokens), it
    samples the same tokens. Standard rejection sampling (seed_stable=False) at a fixed k, and
    seed-stable sampling (the default with a seed; any k: tests/test_seeds.py)."""
    from specdec.proposers import NgramProposer

    def engine():
        prop = DraftModelProposer(tiny_model(seed=3, vocab=V, dim=32, layers=1, max_seq_len=CTX), V, CTX) \
            if proposer == "draft" else NgramProposer(1, 3)
        return Engine(target, None, prop, num_draft_tokens=4, max_seq_len=CTX, vocab_size=V, max_batch=4)

    mine = SamplingParams(temperature=1.0, max_tokens=40, seed=42, seed_stable=stable)
    alone = engine().generate([A], mine)[0]
    others = [SamplingParams(temperature=0.8, max_tokens=n, seed=s) for n, s in [(2, 1), (5, 2), (40, 3)]]
    crowd = engine().generate([A, B, [1, 2, 3] * 5, SHARED], [mine] + others)
    assert crowd[0].output == alone.output and alone.stats.draft_tokens > 0
    # negative control: another seed gives another sample
    assert engine().generate([A], SamplingParams(temperature=1.0, max_tokens=40, seed=43, seed_stable=stable)
                             )[0].output != alone.output


class Shapes(Counting):
    """The model, recording the [rows, width] of every forward it runs."""

    def __init__(self, model):
        super().__init__(model)
        self.shapes = []

    def forward(self, tokens, *a, **kw):
        self.shapes.append(tuple(tokens.shape))
        return super().forward(tokens, *a, **kw)


def test_a_long_draft_catch_up_is_prefilled_in_pieces(target, monkeypatch):
    """The composite does not prefill its draft model with the prompt (the n-gram lookup may
    draft every round), so the draft catches up the whole prompt when it first drafts: in
    forwards of at most PREFILL_PIECE tokens, not one forward as wide as the prompt, and the
    output is still plain's. Negative control: with pieces larger than the prompt the same
    catch-up is one wide forward."""
    from specdec.proposers.composite import CompositeProposer
    from specdec.proposers.ngram import NgramProposer
    from specdec.runtime import kv_cache

    prompt = torch.randint(0, V, (100,), generator=torch.Generator().manual_seed(4)).tolist()

    def run(piece):
        monkeypatch.setattr(kv_cache, "PREFILL_PIECE", piece)
        draft = Shapes(tiny_model(seed=3, vocab=V, dim=32, layers=1, max_seq_len=CTX))
        proposer = CompositeProposer([NgramProposer(4, 4), DraftModelProposer(draft, V, CTX)])
        engine = Engine(target, None, proposer, num_draft_tokens=3, max_seq_len=CTX, vocab_size=V, max_batch=1)
        r = engine.generate([prompt], GREEDY)[0]
        assert r.output == plain(target, prompt).output
        assert r.stats.to_dict()["proposers"]["draft"]["proposals"] > 0  # the draft model drafted
        return [t for _, t in draft.shapes]

    widths = run(16)
    assert widths[:6] == [16] * 6 and max(widths) <= 16
    assert max(run(1000)) >= len(prompt) - 1


def test_prefill_pieces_of_several_prompts_are_not_padded_to_each_other(target):
    """Three prompts prefilled together in pieces: every forward is [rows, window] with
    rows x window <= the piece (no row padded to another row's longer share), and the KV equals
    each prompt prefilled alone in one forward. Negative control: a prompt changed at one token
    changes its own KV from there and nobody else's."""
    from types import SimpleNamespace

    from specdec.runtime import kv_cache

    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (90, 90, 41)]

    def together(ps, piece):
        m = Shapes(target)
        cache = target.new_cache(len(ps), CTX)
        reqs = [SimpleNamespace(row=b, tokens=p) for b, p in enumerate(ps)]
        assert kv_cache.prefill(m, cache, reqs, piece=piece) == reqs
        assert [cache.lengths[b] for b in range(len(ps))] == [len(p) - 1 for p in ps]
        return cache, m.shapes

    cache, shapes = together(prompts, 30)
    assert len(shapes) > 3 and all(b * t <= 30 for b, t in shapes) and shapes[0] == (3, 10)
    for b, p in enumerate(prompts):
        alone, _ = together([p], 10**9)
        n = len(p) - 1
        assert torch.equal(cache.k[:, b, :, :n], alone.k[:, 0, :, :n])
        assert torch.equal(cache.v[:, b, :, :n], alone.v[:, 0, :, :n])
    changed = [list(p) for p in prompts]
    changed[1][50] = (changed[1][50] + 1) % V
    other, _ = together(changed, 30)
    assert torch.equal(other.k[:, [0, 2]], cache.k[:, [0, 2]])
    assert torch.equal(other.k[:, 1, :, :50], cache.k[:, 1, :, :50])
    assert not torch.equal(other.k[:, 1, :, 50:89], cache.k[:, 1, :, 50:89])
