"""Tree attention in our runtime: a draft tree's nodes are scored in one forward where each node
sees the committed prefix and its own ancestors; its RoPE position is prefix + depth while its KV
slot is its own (siblings share a position, not a slot). Every node's logits must be bit-identical
to a plain causal forward over its path (what decoding that path would compute), on the fused
extension and on the torch fallback; after the accepted path's KV is compacted into contiguous
slots, decoding goes on exactly as if the path had been decoded plainly."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from specdec.runtime.kernels import fused
from specdec.tree import ancestor_mask, depths, path_to, tree_from_widths

SHAPES = [(3, 2, 1), (2, 2, 2), (4,), (1, 3, 2)]


def _tree_inputs(parents, tokens_of_nodes, L, root_token):
    N = len(parents)
    feed = torch.tensor([[root_token] + tokens_of_nodes])  # [1, N + 1]
    positions = (L - 1 + depths(parents)).view(1, N + 1)
    slots = (L - 1 + torch.arange(N + 1)).view(1, N + 1)
    return feed, positions, slots, ancestor_mask(parents).unsqueeze(0)


def scored_tree(model, widths, seed: int, prompt_len: int):
    """(parents, prompt, nodes, slots, tree logits [N + 1, V], cache): a random prompt prefilled
    but its last token, then one tree forward over [last token, nodes] with random node tokens."""
    g = torch.Generator().manual_seed(seed)
    parents = tree_from_widths(widths)
    prompt = torch.randint(0, 64, (prompt_len,), generator=g).tolist()
    nodes = torch.randint(0, 64, (len(parents),), generator=g).tolist()
    L = len(prompt)
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prompt[:-1]]), torch.arange(L - 1).view(1, -1), cache)
    feed, positions, slots, mask = _tree_inputs(parents, nodes, L, prompt[-1])
    logits = model.forward(feed, positions, cache, mask=mask, slots=slots)[0]
    return parents, prompt, nodes, slots, logits, cache


def same(kernel, a, b) -> bool:
    """Bit-identical on the fused extension (batch-invariant by construction); the torch fallback
    is not (its attention's reductions depend on the shapes), so there: equal to fp32 rounding."""
    return torch.equal(a, b) if kernel == "fused" else torch.allclose(a, b, rtol=0, atol=1e-5)


@pytest.fixture(params=["fused", "torch"])
def kernel(request, monkeypatch):
    if request.param == "fused" and not fused.available():
        pytest.skip("the fused extension did not build on this machine")
    if request.param == "torch":
        monkeypatch.setenv("SPECDEC_KERNEL", "torch")
    return request.param


@pytest.mark.parametrize("widths", SHAPES)
def test_tree_logits_equal_each_paths_causal_logits(kernel, widths):
    model = tiny_model(seed=3, vocab=64)
    check_paths(kernel, model, widths, 11)


@pytest.mark.parametrize("head_dim, kv_heads", [(64, 1), (64, 2), (128, 2)])
def test_tree_logits_equal_paths_at_real_head_dims(head_dim, kv_heads):
    """The fused path at SmolLM2's and Qwen's head sizes (64, 128), with query groups of 2 and 4
    sharing a KV head (it scores a group's queries in tiles, a tree's through each query's own
    visible slots), after a 40-token history: bit-identical to each path's causal forward."""
    if not fused.available():
        pytest.skip("the fused extension did not build on this machine")
    model = tiny_model(seed=5, vocab=64, dim=4 * head_dim, heads=4, kv_heads=kv_heads, inter=64)
    check_paths("fused", model, (3, 2, 1), 40)


def check_paths(kernel, model, widths, prompt_len):
    parents, prompt, nodes, _, tree_logits, _ = scored_tree(model, widths, sum(widths), prompt_len)
    for j in range(-1, len(parents)):
        path = path_to(parents, j)
        seq = prompt + [nodes[i] for i in path]
        ref_cache = model.new_cache(1, 64)
        ref = model.forward(torch.tensor([seq]), torch.arange(len(seq)).view(1, -1), ref_cache)[0, -1]
        assert same(kernel, tree_logits[j + 1], ref), (widths, j, path)


def test_compacted_path_decodes_like_plain(kernel):
    model = tiny_model(seed=4, vocab=64)
    parents, prompt, nodes, slots, _, cache = scored_tree(model, (2, 3, 2), 7, 9)
    L = len(prompt)
    accepted = path_to(parents, len(parents) - 3)  # a path through non-first siblings: slots far from depth
    assert [int(slots[0, j + 1]) for j in accepted] != list(range(L, L + len(accepted)))
    cache.compact(0, [L + j for j in accepted], L)
    cache.set_length(0, L + len(accepted))
    seq = prompt + [nodes[i] for i in accepted]
    nxt = [5, 17, 33]
    got = model.forward(torch.tensor([nxt]), torch.arange(len(seq), len(seq) + 3).view(1, -1), cache)[0]
    ref_cache = model.new_cache(1, 64)
    full = seq + nxt
    ref = model.forward(torch.tensor([full]), torch.arange(len(full)).view(1, -1), ref_cache)[0, -3:]
    assert same(kernel, got, ref)


def test_slots_without_a_mask_are_refused():
    model = tiny_model(seed=0)
    cache = model.new_cache(1, 32)
    with pytest.raises(ValueError, match="slots need a mask"):
        model.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, slots=torch.tensor([[0, 1]]))
