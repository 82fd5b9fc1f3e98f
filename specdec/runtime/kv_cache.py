"""Static KV buffers with per-row lengths; rollback is arithmetic on lengths.

The buffers are laid out for `capacity` positions per row: the context length plus head-room
for one verification block (k + 1 tokens), so that verify forwards never need to reallocate. The
model writes keys/values at the positions it is given and attends to slots <= each query's
position; it never touches `lengths`. The caller (engine or proposer) owns the lengths: it calls
`advance` after tokens are known to belong to the history and `rollback` to drop rejected ones.
Stale slots past a row's length are masked by position and overwritten by the next forward.

On the CPU the buffers are *reserved, not committed* (the vAttention design: virtual memory for
every row's whole context, physical pages on demand): an anonymous private mapping made with
MAP_NORESERVE, whose pages the OS supplies, zeroed, the first time a forward writes them. A row
therefore holds memory for the tokens it has actually written, not for the context; the kernels
still see one contiguous row per request (so nothing in them changed, nor the batch-invariance
that rests on them). `release` hands a row's pages back (madvise MADV_DONTNEED) when the engine
evicts it from the KV pool (specdec.engine.rows). Each (layer, row, head) region is padded to a
whole number of pages, so that a release never touches a neighbour's slots.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import numpy as np
import torch

from specdec.errors import SpecdecError

PAGE = mmap.PAGESIZE
# MAP_NORESERVE: the mapping is not charged against the commit limit up front (Python's mmap
# module exposes the constant from 3.12 on; 0x4000 is its value on Linux)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def reserved_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor]:
    """(mapping, tensor of `shape` in it): zeros whose pages exist only once written."""
    nbytes = max(math.prod(shape) * torch.empty(0, dtype=dtype).element_size(), PAGE)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    return mm, torch.frombuffer(mm, dtype=dtype, count=math.prod(shape)).view(shape)


def resident(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) (page-aligned) the OS really holds: mincore(2)'s
    page map (0 where it cannot be asked). Exact for this range, unlike /proc's per-mapping Rss,
    which the kernel reports for merged neighbouring mappings together."""
    pages = -(-nbytes // PAGE)
    if _mincore is None or not pages:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    if _mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) != 0:
        return 0
    return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) * PAGE


def _libc_mincore():
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


_mincore = _libc_mincore()


PAD_RELEASE = 64  # pad slots past a row's tokens in one forward from which their pages are given back


def ragged_block(chunks: list[list[int]], starts: list[int], capacity: int):
    """(tokens, positions) [B, T] int64 for feeding rows their own token runs at once: row b's
    `chunks[b]` at positions starts[b].., padded at the end to the longest (T).  Pads sit past
    the row's history and are clamped inside the buffer: stale slots, overwritten later."""
    T = max(len(c) for c in chunks)
    tok = torch.zeros(len(chunks), T, dtype=torch.long)
    pos = torch.zeros(len(chunks), T, dtype=torch.long)
    for b, (c, s) in enumerate(zip(chunks, starts)):
        tok[b, :len(c)] = torch.tensor(c, dtype=torch.long)
        pos[b] = torch.arange(s, s + T).clamp(max=capacity - 1)
    return tok, pos


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most limit."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return max(n, 0)
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on list slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def rows_arg(reqs, device):
    """A forward's `rows` for these requests: None (cache views, no copies) when the batch is
    exactly cache rows 0..B-1, else their rows as a tensor."""
    rows = [r.row for r in reqs]
    return None if rows == list(range(len(rows))) else torch.tensor(rows, device=device)


# About this many rows (prompt positions, all requests together) per prefill forward. Measured on Zen 5 (docs/bench, prefill_chunks_zen5.txt):
# pieces of 128-384 tokens beat one forward over the whole prompt by 1.1-1.3x at 1,024-2,048
# tokens on SmolLM2, Qwen 0.5B and Qwen 1.5B (the MLP's intermediate activations of a whole
# long prompt spill out of the caches; Qwen 1.5B's gate/up output is 72 KB per token), and 512
# lost to 256 on all three. Every row's bits are the same in any piece (batch invariance).
PREFILL_PIECE = 256


def prefill(model, cache: "KVCache", reqs, budget: int | None = None, on_hidden=None,
            taps: tuple[int, ...] = (), piece: int | None = None) -> list:
    """Give `cache` KV for every committed token of each request but the last (the next round
    feeds it), in padded forwards of about `piece` rows (default PREFILL_PIECE) that compute no
    logits; returns the requests fed. budget: at most this many tokens in all (chunked prefill),
    handed out in request order; a request left short gets the rest in later calls. The
    requests' tokens go in windows of piece // (requests still feeding) positions, all rows
    together, so equal prompts are never padded to one another. on_hidden(request, start,
    hidden [n, dim]): told the final hidden states of the n positions fed from `start` (a draft
    head's input; with `taps`, the residual streams after those layers before them, as
    Transformer.forward), once per forward that fed it."""
    piece = piece or PREFILL_PIECE
    left = budget if budget is not None else float("inf")
    todo, owed = [], []
    for r in reqs:
        n = min(len(r.tokens) - 1 - cache.lengths[r.row], left)
        if n > 0:
            todo.append(r)
            owed.append(n)
            left -= n
    while True:
        live = [b for b, n in enumerate(owed) if n > 0]
        if not live:
            return todo
        w = max(1, piece // len(live))
        feed = [(todo[b], min(owed[b], w)) for b in live]
        _prefill_once(model, cache, feed, on_hidden, taps)
        for b, (_, n) in zip(live, feed):
            owed[b] -= n


def _prefill_once(model, cache, feed, on_hidden, taps) -> None:
    """One forward of prefill: feed [(request, tokens to feed from its KV length)]."""
    chunks = [r.tokens[cache.lengths[r.row]:cache.lengths[r.row] + n] for r, n in feed]
    todo = [r for r, _ in feed]
    dev = model.device
    starts = [cache.lengths[r.row] for r in todo]
    tok, pos = ragged_block(chunks, starts, cache.capacity)
    out = model.forward(tok.to(dev), pos.to(dev), cache, rows=rows_arg(todo, dev),
                        logits_at=torch.zeros(len(todo), 0, dtype=torch.long, device=dev),
                        return_hidden=on_hidden is not None, **({"taps": taps} if taps else {}))
    for b, (r, c) in enumerate(zip(todo, chunks)):
        if on_hidden is not None:
            on_hidden(r, starts[b], out[1][b, : len(c)])
        cache.advance(r.row, len(c))
        if tok.shape[1] - len(c) >= PAD_RELEASE:  # a short prompt padded to a long one's width:
            cache.release(r.row, cache.lengths[r.row])  # its pads' pages are not its memory


class KVCache:
    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int,
                 max_seq_len: int, headroom: int = 33, dtype=torch.float32, device="cpu"):
        self.max_seq_len = max_seq_len  # the context limit a request may reach
        self.capacity = max_seq_len + headroom  # slots a row may use
        itemsize = torch.empty(0, dtype=dtype).element_size()
        # slots per region, padded to whole pages (g slots make a page)
        g = PAGE // math.gcd(PAGE, head_dim * itemsize)
        self._slots = -(-self.capacity // g) * g
        shape = (n_layers, batch_size, n_kv_heads, self._slots, head_dim)
        self._maps: list[mmap.mmap] = []
        if torch.device(device).type == "cpu" and math.prod(shape):  # (an empty cache: nothing to map)
            (mk, k), (mv, v) = reserved_zeros(shape, dtype), reserved_zeros(shape, dtype)
            self._maps = [mk, mv]
        else:
            k = torch.zeros(shape, dtype=dtype, device=device)
            v = torch.zeros(shape, dtype=dtype, device=device)
        self.k = k[..., : self.capacity, :]  # [L, B, Hkv, S, D] (S = capacity) views
        self.v = v[..., : self.capacity, :]
        self._region = self._slots * head_dim * itemsize  # bytes of one (layer, row, head) region
        self._slot_bytes = head_dim * itemsize
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per layer [B, Hkv, S, D] views
        self.lengths = [0] * batch_size  # tokens with valid KV, per row (host ints: no sync)

    def release(self, row: int, keep: int = 0) -> None:
        """Give back the memory of row's slots from `keep` on (whole pages; the row's lengths
        are the caller's): the pages read as zeros afterwards and cost nothing until written
        again. A no-op off the CPU."""
        if not self._maps:
            return
        L, B, Hkv = self.k.shape[0], self.k.shape[1], self.k.shape[2]
        start = -(-keep * self._slot_bytes // PAGE) * PAGE  # within a region: whole pages only
        if start >= self._region:
            return
        for mm in self._maps:
            for layer in range(L):
                base = (layer * B + row) * Hkv * self._region
                if start == 0:  # the row's heads are adjacent: one call per layer
                    mm.madvise(mmap.MADV_DONTNEED, base, Hkv * self._region)
                else:
                    for h in range(Hkv):
                        mm.madvise(mmap.MADV_DONTNEED, base + h * self._region + start, self._region - start)

    def resident_bytes(self) -> int:
        """Bytes of these buffers the OS really holds (0 off the CPU / where mincore is missing)."""
        return sum(resident(t.data_ptr(), len(mm)) for t, mm in zip((self.k, self.v), self._maps))

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def check_fits(self, row: int, n_new: int) -> None:
        """Raise if writing n_new tokens after row's current length would pass the buffer."""
        if self.lengths[row] + n_new > self.capacity:
            raise SpecdecError(
                f"sequence length {self.lengths[row] + n_new} exceeds the KV cache capacity "
                f"{self.capacity} (context length {self.max_seq_len})")

    def advance(self, row: int, n: int) -> None:
        assert n >= 0
        self.check_fits(row, n)
        self.lengths[row] += n

    def rollback(self, row: int, n: int) -> None:
        assert 0 <= n <= self.lengths[row], (n, self.lengths[row])
        self.lengths[row] -= n

    def set_length(self, row: int, n: int) -> None:
        assert 0 <= n <= self.capacity
        self.lengths[row] = n

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row dst gets row src's KV for its first n positions (prefix reuse: a copy costs far
        less than the prefill it saves); dst's length becomes n."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def compact(self, row: int, src: list[int], dst: int) -> None:
        """Move the KV at slots `src` (a draft tree's accepted path, increasing) to the contiguous
        slots dst, dst + 1, ...: afterwards the row is a plain prefix again, and rollback stays
        arithmetic on its length."""
        for i, s in enumerate(src):  # increasing, s >= dst + i: a slot is read before it is written
            if s != dst + i:
                self.k[:, row, :, dst + i].copy_(self.k[:, row, :, s])  # [layers, Hkv, D] each
                self.v[:, row, :, dst + i].copy_(self.v[:, row, :, s])

    def reset(self) -> None:
        self.lengths = [0] * self.batch_size
