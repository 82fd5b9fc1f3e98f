"""The round's contract on tiny random models: per-position logits state, the target's hidden
states handed to a proposer that asks, the row results of a step, and Engine.abort."""

from __future__ import annotations

import torch

from conftest import tiny_model
from engines import make_engine
from specdec.config import SamplingParams
from specdec.engine import Engine
from specdec.logits_state import NoState, PenaltyState
from specdec.proposers import DraftModelProposer
from specdec.round import RowResult

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_penalty_inputs_equal_committing_the_drafts_one_by_one():
    """inputs(drafts)[i] is the state after committing drafts[:i] (the slow reference), so the
    target's p and the draft's q at position i see the same prefix; inputs() changes nothing.
    Negative control: a state that saw no drafts (one update per round, docs/pitfalls.md 7)
    differs at every position after a draft."""
    V, drafts = 16, torch.tensor([5, 5, 7, 2])
    state = PenaltyState(V, PROMPT, "cpu")
    state.commit(7)
    got = state.inputs(drafts)
    assert got.counts.shape == (5, V) and got.seen.shape == (5, V)
    for i in range(len(drafts) + 1):
        ref = PenaltyState(V, PROMPT, "cpu")
        for t in [7] + drafts[:i].tolist():
            ref.commit(t)
        assert torch.equal(got.counts[i], ref.counts) and torch.equal(got.seen[i], ref.seen)
    assert torch.equal(state.inputs(torch.tensor([], dtype=torch.long)).counts[0], state.counts)
    stale = state.inputs(torch.tensor([], dtype=torch.long)).counts[0]
    assert all(not torch.equal(got.counts[i], stale) for i in range(1, 5))
    last = state.inputs(drafts, last_only=True)  # the draft loop's one position
    assert torch.equal(last.counts[0], got.counts[-1]) and torch.equal(last.seen[0], got.seen[-1])
    assert NoState().inputs(drafts).counts is None


class HiddenSpy(DraftModelProposer):
    """A draft model that asks for the target's hidden states and keeps what it is handed."""

    wants_hidden_states = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.seen: list[RowResult] = []

    def accept(self, req, result):
        self.seen.append(result)
        super().accept(req, result)


def test_hidden_states_reach_the_proposer_for_the_committed_tokens():
    """RowResult.hidden[j] is the target's final hidden state at the input that produced the
    j-th committed token: equal (same kernels, same bits per row) to a full forward's hidden
    state at that token's position - 1."""
    target, draft = tiny_model(seed=1), tiny_model(seed=2)
    spy = HiddenSpy(draft, 64, 64)
    eng = Engine(target, None, spy, num_draft_tokens=3, max_seq_len=64, vocab_size=64)
    req = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert spy.seen and req.stats.rounds > 0
    seq = torch.tensor([req.tokens])
    _, full = target.forward(seq, torch.arange(seq.shape[1]).view(1, -1), target.new_cache(1, 64),
                             return_hidden=True)  # [1, L, dim]
    pos = len(PROMPT)
    for res in spy.seen:
        assert res.hidden.shape == (len(res.committed), target.args.dim)
        assert res.committed == req.tokens[pos:pos + len(res.committed)]
        assert torch.equal(res.hidden, full[0, pos - 1:pos - 1 + len(res.committed)])
        pos += len(res.committed)
    # every round, the last one too (no room to draft, k = 0): a proposer that reads hidden states
    # needs the features of every committed token
    assert pos == len(req.tokens)


def test_step_reports_each_rows_round():
    """committed = accepted drafts + one token; the rows' tokens add up to the output; the
    batch's time is shared out, not charged to every row."""
    target = tiny_model(seed=1)
    eng = make_engine(target, target, 3, max_batch=2)  # self-draft: every draft accepted
    params = SamplingParams(temperature=0, max_tokens=9)
    eng.reserve(2)
    reqs = [eng.add_request(PROMPT, params), eng.add_request(PROMPT[:5], params)]
    committed = {r.id: [] for r in reqs}
    total_target = 0.0
    while eng.active:
        res = eng.step()
        total_target += res.target_s
        for row in res.rows:
            assert row.drafted == row.k and row.accepted == len(row.committed) - 1 or row.request.finished
            committed[row.request.id] += row.committed
    for r in reqs:
        assert committed[r.id] == r.output and r.stats.rounds > 0
    assert abs(sum(r.stats.target_time for r in reqs) - total_target) < 1e-9


def test_abort_frees_its_rows_and_leaves_the_others_alone():
    """Aborting one request mid-generation frees its target and draft state at once; the other
    request's output equals a run without the aborted one."""
    target, draft = tiny_model(seed=1), tiny_model(seed=2)
    params = SamplingParams(temperature=0, max_tokens=16)
    alone = make_engine(target, draft, 3).generate([PROMPT[:6]], params)[0].output
    eng = make_engine(target, draft, 3, max_batch=2)
    eng.reserve(2)
    a = eng.add_request(PROMPT, params)
    b = eng.add_request(PROMPT[:6], params)
    eng.step()
    eng.abort(a)
    assert a.finish_reason == "abort" and a not in eng.active
    assert eng.cache.lengths[a.row] == 0 and eng.proposer.cache.lengths[a.row] == 0
    assert a.row in eng.free_rows
    eng.abort(a)  # a second abort is a no-op
    eng.run()
    assert b.output == alone and b.finish_reason == "length" and b.stats.rounds > 0
