"""N-gram prompt lookup: propose what followed the longest earlier occurrence of the context's
suffix (prompt + generated text). Token-only, so q is one-hot.

The index maps every n-gram (n_min <= n <= n_max) of the committed tokens to the position right
after its most recent occurrence. It grows by (n_max - n_min + 1) entries per committed token
and is never rebuilt, so a round costs O(n_max) dictionary lookups whatever the context length.
Committed tokens never roll back, so neither does the index.
"""

from __future__ import annotations

import torch

from specdec.config import check_ngram_range
from specdec.proposers.base import Candidate, Proposal, ProposerBase


class NgramIndex:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.last: dict[tuple, int] = {}  # n-gram -> index of the token that followed it
        self.indexed = 0  # n-grams ending before this position are in `last`

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram tokens[j - n:j] whose follower tokens[j] exists (j < len(tokens))."""
        for j in range(max(self.indexed, 1), len(tokens)):  # j: index of the follower token
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self.last[tuple(tokens[j - n:j])] = j
        self.indexed = max(self.indexed, len(tokens))

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
