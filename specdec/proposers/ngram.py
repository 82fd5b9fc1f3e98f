"""N-gram prompt lookup: propose what followed the longest earlier occurrence of the context's
suffix (prompt + generated text). Token-only, so q is one-hot.

The index maps every n-gram (n_min <= n <= n_max) of the committed tokens to the position right
after its most recent occurrence, and each such position to the one after the n-gram's previous
occurrence (so every occurrence is reachable, newest first). It grows by (n_max - n_min + 1)
entries per committed token and is never rebuilt, so a chain costs O(n_max) dictionary lookups
whatever the context length. Committed tokens never roll back, so neither does the index.

Trees (`draft_tree="dynamic[:N]"`): what followed *several* earlier occurrences of the suffix
(the longest matched suffix's first, newest first; then shorter suffixes'), merged into a trie
until it has N nodes: where the text went on differently after the same words, both
continuations are drafted, and the first path is the chain's. Each node is a deterministic
candidate (a function of the committed tokens), verified by the deterministic-candidate rule
(specdec.tree).
"""

from __future__ import annotations

import torch

from specdec.config import check_ngram_range
from specdec.proposers.base import Candidate, Proposal, ProposerBase
from specdec.proposers.dynamic_tree import union
from specdec.tree import tree_ok

MATCHES = 8  # earlier occurrences merged into one row's trie


class NgramIndex:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.last: dict[tuple, int] = {}  # n-gram -> index of the token that followed it
        # per n: follower index j -> the follower of the same n-gram's previous occurrence (-1: none)
        self.prev: list[list[int]] = [[-1] for _ in range(n_min, n_max + 1)]
        self.indexed = 0  # n-grams ending before this position are in `last`

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram tokens[j - n:j] whose follower tokens[j] exists (j < len(tokens))."""
        for j in range(max(self.indexed, 1), len(tokens)):  # j: index of the follower token
            for n in range(self.n_min, self.n_max + 1):
                if n > j:
                    self.prev[n - self.n_min].append(-1)
                    continue
                g = tuple(tokens[j - n:j])
                self.prev[n - self.n_min].append(self.last.get(g, -1))
                self.last[g] = j
        self.indexed = max(self.indexed, len(tokens))

    def occurrences(self, tokens: list[int], n: int):
        """Follower indices of the earlier occurrences of tokens' suffix of length n, newest first."""
        j = self.last.get(tuple(tokens[len(tokens) - n:]), -1)
        while j >= 0:
            yield j
            j = self.prev[n - self.n_min][j]

    def tree(self, tokens: list[int], k: int, n_nodes: int,
             matches: int = MATCHES) -> tuple[torch.Tensor, torch.Tensor]:
        """(parents [m], tokens [m]), m <= n_nodes, depth <= k: the trie of what followed up to
        `matches` earlier occurrences of the suffix, inserted in order (longest suffix first,
        newest first) until it has n_nodes nodes; breadth-first (a parent before its children).
        Its first path is the chain `lookup` drafts, so a trie never drafts less than the chain."""
        L, conts, seen = len(tokens), [], set()
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            for j in self.occurrences(tokens, n):
                if len(conts) == matches:
                    break
                if j not in seen:  # (a shorter suffix finds the longer one's occurrences again)
                    seen.add(j)
                    conts.append(tokens[j:min(j + k, L)])
        chains = [(torch.arange(-1, len(c) - 1), torch.tensor(c, dtype=torch.long)) for c in conts]
        return union(chains, n_nodes)  # shared prefixes once, in insertion order, up to n_nodes

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the suffix of `tokens`."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(lookup's tokens, length of the suffix matched; 0: none)."""
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            j = self.last.get(tuple(tokens[L - n:]))
            if j is not None:
                return tokens[j:min(j + k, L)], n
        return [], 0


class NgramProposer(ProposerBase):
    name = "ngram"
    runs_a_model = False  # drafting is a few dictionary lookups (adaptive k's cost prior)

    def __init__(self, n_min: int = 1, n_max: int = 4):
        check_ngram_range(n_min, n_max)
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, NgramIndex] = {}

    def begin(self, req) -> None:
        self.index[req.id] = NgramIndex(self.n_min, self.n_max)

    def release(self, req) -> None:
        self.index.pop(req.id, None)

    # accept / skip: the index only ever holds committed tokens, so there is nothing to roll back

    def peek(self, req, k: int) -> list[Candidate]:
        """[Candidate(name, tokens, acceptance key)]: a match of a longer suffix is likelier to go on
        being copied, so adaptive k keeps acceptance per matched length ("ngram@3")."""
        idx = self.index[req.id]
        idx.extend(req.tokens)
        found, n = idx.match(req.tokens, k) if k > 0 else ([], 0)
        return [Candidate(self.name, len(found), f"{self.name}@{n}")] if found else []

    def propose(self, reqs, ks: list[int], only=None) -> Proposal:
        found = []
        for r, k in zip(reqs, ks):
            idx = self.index[r.id]
            idx.extend(r.tokens)  # n-grams with a known follower: the suffix never matches itself
            found.append(idx.lookup(r.tokens, k) if k > 0 else [])
        width = max(len(f) for f in found)
        tokens = torch.zeros(len(reqs), width, dtype=torch.long)
        for b, f in enumerate(found):
            tokens[b, :len(f)] = torch.tensor(f, dtype=torch.long)
        num = torch.tensor([len(f) for f in found], dtype=torch.long)
        return Proposal(tokens=tokens, num_draft=num, q=None)

    def propose_dynamic(self, reqs, ks: list[int], n_nodes: int) -> Proposal:
        """Each row's trie of earlier continuations (NgramIndex.tree); rows the tree verifier does
        not serve draft a chain as `propose` does."""
        grown = [b for b, k in enumerate(ks) if k and tree_ok(reqs[b].params)]
        tries = self.grow_dynamic([reqs[b] for b in grown], [ks[b] for b in grown], n_nodes)
        return self.dynamic_round(reqs, ks, grown, tries, 0)

    def grow_dynamic(self, reqs, ks: list[int], n_nodes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's trie [(parents, tokens)] (every row drafts: k > 0, tree verifier rows)."""
        tries = []
        for r, k in zip(reqs, ks):
            idx = self.index[r.id]
            idx.extend(r.tokens)
            tries.append(idx.tree(r.tokens, k, n_nodes))
        return tries
