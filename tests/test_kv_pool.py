"""The KV pool (issue 24): a request holds memory for its own length, not the whole context, and a
pool sized in tokens is kept by admission, eviction of kept prefixes and preemption by recompute,
never by a crash or a truncation.

- The cache's buffers are reserved, not committed: resident memory follows the tokens written
  (mincore(2)'s page map), and `release` hands pages back without touching other rows.
- An engine with a pool far smaller than rows x context runs more requests than fit at once;
  it preempts (asserted: the test is void if nothing was preempted) and every output equals the
  output that request gets alone without a pool, greedy and seeded sampling, with a draft model
  and without; the KV the rows hold never exceeds the pool.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.proposers import DraftModelProposer
from specdec.runtime import kv_cache
from specdec.runtime.kv_cache import PAGE, KVCache

V, CTX = 64, 128
PROMPTS = [[(7 * i + j) % 50 + 1 for j in range(10 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=0, vocab=V, max_seq_len=CTX), tiny_model(seed=1, vocab=V, max_seq_len=CTX)


def _per_token(c: KVCache) -> int:
    L, _, H, _, D = c.k.shape
    return 2 * L * H * D * c.k.element_size()


@pytest.mark.skipif(kv_cache._mincore is None, reason="needs mincore(2) (Linux)")
def test_cache_memory_follows_the_tokens_written():
    c = KVCache(4, 8, 2, 64, 4096, headroom=33)
    assert c.resident_bytes() == 0  # 8 rows x 4,129 slots reserved, none committed
    c.k[:, 3, :, :100] = 1.0
    c.v[:, 3, :, :100] = 2.0
    per_token, slack = _per_token(c), 2 * 4 * 2 * PAGE  # a partial page per region
    assert 100 * per_token <= c.resident_bytes() <= 100 * per_token + slack
    c.k[:, 5, :, :10] = 3.0
    c.release(3, keep=40)  # whole pages from slot 40 on; row 5 untouched
    assert c.k[0, 3, 1, 39, 0] == 1.0 and c.k[0, 3, 1, 80, 0] == 0.0 and c.v[2, 3, 0, 90, 5] == 0.0
    assert c.k[3, 5, 1, 9, 0] == 3.0
    assert c.resident_bytes() <= 50 * per_token + 2 * slack
    c.release(3)
    c.release(5)
    assert c.resident_bytes() == 0 and c.k[0, 5, 0, 0, 0] == 0.0
    # negative control: writing the whole context commits it all
    c.k[:, 0] = 1.0
    assert c.resident_bytes() >= c.capacity * per_token // 2


def _alone(target, draft, prompt, params):
    prop = DraftModelProposer(draft, V, CTX) if draft is not None else None
    engine = Engine(target, None, prop, num_draft_tokens=3 if draft is not None else 0, max_seq_len=CTX,
                    vocab_size=V)
    return engine.generate([prompt], params)[0]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pool_preempts_and_outputs_are_unchanged(models, speculative, temperature):
    target, draft = models
    draft = draft if speculative else None
    params = [SamplingParams(temperature=temperature, max_tokens=60, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    prop = DraftModelProposer(draft, V, CTX) if draft is not None else None
    pool = CTX + 40  # 8 rows of a 128-token context in 168 tokens of KV
    engine = Engine(target, None, prop, num_draft_tokens=3 if draft is not None else 0, max_seq_len=CTX,
                    vocab_size=V, max_batch=8, kv_pool_tokens=pool)
    engine.reserve(8)
    reqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    i, peak = 2, 0
    while engine.active or engine.preempted or i < len(PROMPTS):
        while i < len(PROMPTS) and engine.can_admit(len(PROMPTS[i])):
            reqs.append(engine.add_request(PROMPTS[i], params[i]))
            i += 1
        engine.step()
        held = sum(engine.cache.lengths[r.row] for r in engine.active)
        held += sum(len(engine.row_tokens[row]) for row in engine.free_rows)
        peak = max(peak, held)
        assert held <= pool
    assert engine.preemptions > 0  # else this test shows nothing
    for r, p, sp in zip(reqs, PROMPTS, params):
        want = _alone(target, draft, p, sp)
        assert r.output == want.output and r.finish_reason == want.finish_reason == "length"
    if speculative:
        assert sum(r.stats.draft_tokens for r in reqs) > 0


def test_pool_generate_and_abort_of_a_preempted_request(models):
    target, _ = models
    engine = Engine(target, None, max_seq_len=CTX, vocab_size=V, max_batch=4, kv_pool_tokens=CTX)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    outs = engine.generate(PROMPTS[:4], params)  # LLM.generate's path: admission by can_admit
    assert [o.output for o in outs] == [_alone(target, None, p, params).output for p in PROMPTS[:4]]
    # abort a preempted request: it ends with "abort" and holds nothing
    engine.reserve(4)
    a = engine.add_request(PROMPTS[0], params)
    b = engine.add_request(PROMPTS[1], params)
    while not engine.preempted:
        engine.step()
    victim = engine.preempted[0]
    assert victim is b
    engine.abort(victim)
    assert victim.finish_reason == "abort" and not engine.preempted
    while not a.finished:
        engine.step()
    assert a.output == _alone(target, None, PROMPTS[0], params).output


def test_pool_bad_size_is_an_error(models):
    target, _ = models
    with pytest.raises(SpecdecError, match=r"kv_cache_tokens=100 .*\[128"):
        Engine(target, None, max_seq_len=CTX, vocab_size=V, kv_pool_tokens=100)
    engine = Engine(target, None, max_seq_len=CTX, vocab_size=V, max_batch=2, kv_pool_tokens=CTX)
    engine.reserve(2)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    assert not engine.can_admit(CTX - 20)  # next to a running request, a long prompt waits
    with pytest.raises(SpecdecError, match="no room in the KV pool"):
        engine.add_request([1] * (CTX - 20), SamplingParams(max_tokens=4))
    assert torch.is_tensor(engine.cache.k)


def test_an_empty_cache_is_allowed():
    """A cache with no rows (or no layers) holds nothing and maps nothing (specdec verify's audit
    builds one)."""
    for shape in ((2, 0, 2, 16), (0, 3, 2, 16)):
        c = KVCache(*shape, max_seq_len=32)
        assert c.k.numel() == 0 and c.resident_bytes() == 0
        c.release(0) if shape[1] else None
