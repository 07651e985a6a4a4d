"""A suffix array over token sequences: the compact form of the cluster's index of earlier outputs.

The per-request trie (``suffix_index.SuffixIndex``) costs kilobytes a token in Python objects
(several nodes a token at depth 24), fine for one request's context and far too much for the
millions of tokens a cluster produces. This array answers the same questions from 8 bytes a
token (the tokens, int32, and their sorted positions, int32), built with numpy.

Layout: the sequences concatenated, each followed by a separator (-1) so that no window crosses
two of them, then ``depth`` separators so that every position plus an offset below ``depth``
stays inside. ``order`` lists the positions that start with a token, sorted by their next
``depth`` tokens (prefix doubling). A string ``s`` of ``d`` tokens is then a contiguous range
``[lo, hi)`` of ``order``: the positions where it occurs, ``hi - lo`` of them (the trie node's
count); the tokens at offset ``d`` of those positions are sorted within the range, so its
continuations are sub-ranges (the trie node's children) and a child's count is its range's size.
A separator continuation is the end of a sequence: no child, as in the trie.

``SuffixArrays`` matches and speculates over several arrays at once (the seed corpus and the
cluster's outputs of one ``cache_salt``), summing their counts, with the scoring and growth of
``suffix_index`` (SuffixDecoding, NeurIPS 2025).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence

import numpy as np

from specserve.replicas.model import native_kernels
from specserve.replicas.drafts.suffix_index import Speculation, grow

SEPARATOR = -1
# Ranges this small finish ``find`` with one comparison instead of a search per token.
FEW = 64


def _sorted_positions(buf: np.ndarray, depth: int) -> np.ndarray:
    """Positions of ``buf`` sorted by their first ``depth`` tokens (ties: position order), by
    prefix doubling: ranks by 1, 2, 4, ... tokens, each round one argsort of (rank, rank ahead)."""
    n = len(buf)
    rank = buf.astype(np.int64) + 2          # the separator ranks 1; 0 is past the end
    covered = 1
    while covered < depth:
        ahead = np.zeros(n, np.int64)
        ahead[:n - covered] = rank[covered:]
        key = rank * (int(rank.max()) + 1) + ahead
        order = np.argsort(key, kind="stable")
        ranked = key[order]
        rank = np.empty(n, np.int64)
        rank[order] = np.concatenate(([1], 1 + np.cumsum(ranked[1:] != ranked[:-1])))
        covered *= 2
    return np.argsort(rank, kind="stable")


_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {
    "sa_find": [_P, _P, _I, _P, _I, _P],
    "sa_children": [_P, _P, _I, _I, _I, _I, _P, _P, _P, _P],
}


def _kernel():
    """``kernels/suffix_array.c``: a search per call instead of numpy calls per token, whose
    dispatch dominates a speculation's search; None without a C compiler, and numpy does it."""
    kernel = native_kernels.load("suffix_array", _SIGNATURES, "the suffix index searches with numpy")
    if kernel is not None:
        kernel.sa_children.restype = ctypes.c_int64
    return kernel


class SuffixArray:
    def __init__(self, sequences: Iterable[Sequence[int]], depth: int = 24):
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        parts = []
        for seq in sequences:
            if len(seq):
                parts.append(np.asarray(seq, dtype=np.int32))
                parts.append(np.full(1, SEPARATOR, np.int32))
        parts.append(np.full(depth, SEPARATOR, np.int32))
        self.buf = np.concatenate(parts)
        order = _sorted_positions(self.buf, depth)
        self.order = order[self.buf[order] != SEPARATOR].astype(np.int32)
        self.first = self.buf[self.order]     # the sorted first column: offset 0 without a gather
        self._c = _kernel()
        self._out: tuple[np.ndarray, ...] | None = None   # the kernel's result buffers, made on first use
        self._pointers = (self.buf.ctypes.data, self.order.ctypes.data)

    @property
    def tokens(self) -> int:
        """Tokens held (separators not counted)."""
        return len(self.order)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes + self.order.nbytes + self.first.nbytes

    def token_arrays(self) -> list[np.ndarray]:
        """The sequences held, in the order added (to rebuild a larger array from them)."""
        cuts = np.flatnonzero(self.buf == SEPARATOR)
        out, start = [], 0
        for cut in cuts:
            if cut > start:
                out.append(self.buf[start:cut])
            start = cut + 1
        return out

    def _column(self, lo: int, hi: int, offset: int) -> np.ndarray:
        return self.first[lo:hi] if offset == 0 else self.buf[self.order[lo:hi] + offset]

    def narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """The sub-range of ``[lo, hi)`` (a string of ``offset`` tokens) followed by ``token``."""
        column = self._column(lo, hi, offset)
        token = np.int32(token)   # a Python int would make numpy convert the whole column first
        return lo + int(column.searchsorted(token, "left")), lo + int(column.searchsorted(token, "right"))

    def _buffers(self) -> tuple[np.ndarray, ...]:
        if self._out is None:
            width = int(self.buf.max()) + 1   # at most one child per token id
            self._out = (np.empty(width, np.int32), np.empty(width, np.int64), np.empty(width, np.int64),
                         np.empty(2, np.int64))
            self._out_pointers = tuple(a.ctypes.data for a in self._out)
        return self._out

    def find(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The range of the positions where ``pattern`` occurs (empty: lo == hi)."""
        if self._c is not None:
            query = np.asarray(pattern, dtype=np.int32)
            out = self._buffers()[3]
            self._c.sa_find(*self._pointers, len(self.order), query.ctypes.data, len(query), self._out_pointers[3])
            return int(out[0]), int(out[1])
        lo, hi = 0, len(self.order)
        for offset, token in enumerate(pattern):
            if hi - lo <= FEW and offset + 1 < len(pattern):
                return self._compare_rest(lo, hi, offset, pattern)
            lo, hi = self.narrow(lo, hi, offset, token)
            if lo == hi:
                break
        return lo, hi

    def _compare_rest(self, lo: int, hi: int, offset: int, pattern: Sequence[int]) -> tuple[int, int]:
        """``find``'s tail for a range of a few positions: the rest of the pattern compared in one
        gather (the positions that match it are still contiguous in ``order``)."""
        rest = np.asarray(pattern[offset:], dtype=np.int32)
        rows = self.buf[self.order[lo:hi, None] + np.arange(offset, len(pattern))]
        hits = np.flatnonzero((rows == rest).all(axis=1))
        return (lo, lo) if len(hits) == 0 else (lo + int(hits[0]), lo + int(hits[-1]) + 1)

    def continued(self, lo: int, hi: int, offset: int) -> bool:
        """Whether some occurrence of the string ``[lo, hi)`` goes on (the separator sorts first)."""
        return hi > lo and offset < self.depth and self.buf[self.order[hi - 1] + offset] != SEPARATOR

    def continuations(self, lo: int, hi: int, offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tokens that follow the string ``[lo, hi)`` (of ``offset`` tokens), each with its
        sub-range ``[starts, ends)``; a sequence's end is none."""
        if hi <= lo or offset >= self.depth:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        if self._c is not None:
            tokens, counts, starts, total = self._buffers()
            written = self._c.sa_children(*self._pointers, lo, hi, offset, len(tokens), *self._out_pointers)
            return tokens[:written].copy(), starts[:written].copy(), starts[:written] + counts[:written]
        column = self._column(lo, hi, offset)
        starts = np.concatenate(([0], np.flatnonzero(column[1:] != column[:-1]) + 1))
        ends = np.append(starts[1:], len(column))
        tokens = column[starts]
        keep = tokens != SEPARATOR
        return tokens[keep], lo + starts[keep], lo + ends[keep]


class SuffixArrays:
    """Several arrays read as one index: a string's count is the sum of its counts in each.

    A node is ``(offset, ((array, lo, hi), ...))``: the string's length and its range in each
    array that holds it.
    """

    def __init__(self, arrays: Sequence[SuffixArray]):
        self.arrays = [a for a in arrays if a.tokens]
        self.depth = min((a.depth for a in self.arrays), default=2)

    def _node(self, pattern: Sequence[int]):
        ranges = []
        for array in self.arrays:
            lo, hi = array.find(pattern)
            if hi > lo:
                ranges.append((array, lo, hi))
        return (len(pattern), tuple(ranges))

    @staticmethod
    def _continued(node) -> bool:
        offset, ranges = node
        return any(array.continued(lo, hi, offset) for array, lo, hi in ranges)

    def match(self, context: Sequence[int], longest: int | None = None):
        """The node of the longest suffix of ``context`` (at most ``longest`` tokens, shorter than
        ``depth``) that some array continues, and its length; (None, 0) when none does. Binary
        search on the length: a suffix that is continued has every shorter suffix continued."""
        if not self.arrays or not context:
            return None, 0
        top = min(len(context), self.depth - 1, self.depth - 1 if longest is None else longest)
        best, lo, hi = None, 1, top
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self._node(context[len(context) - mid:])
            if self._continued(node):
                best, lo = (node, mid), mid + 1
            else:
                hi = mid - 1
        return best if best is not None else (None, 0)

    @staticmethod
    def children(node, top_k: int) -> tuple[int, list]:
        """(Σ counts of every continuation, the ``top_k`` most frequent as (token, count, node))."""
        offset, ranges = node
        merged: dict[int, list] = {}
        for array, lo, hi in ranges:
            tokens, starts, ends = array.continuations(lo, hi, offset)
            for tok, start, end in zip(tokens.tolist(), starts.tolist(), ends.tolist()):
                entry = merged.setdefault(tok, [0, []])
                entry[0] += end - start
                entry[1].append((array, start, end))
        total = sum(count for count, _ in merged.values())
        best = sorted(merged.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top_k]
        return total, [(tok, count, (offset + 1, tuple(rs))) for tok, (count, rs) in best]

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, top_k: int = 1, max_depth: int | None = None) -> Speculation:
        """As ``SuffixIndex.speculate``, over the arrays' summed counts."""
        wanted = max_tokens if max_depth is None else min(max_depth, max_tokens)
        node, length = self.match(context, max(1, self.depth - wanted))
        return grow(node, length, self.children, self.depth, wanted, max_tokens, max_spec_factor,
                    min_token_prob, top_k)
