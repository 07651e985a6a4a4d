"""A suffix index of token sequences, and speculation from it (SuffixDecoding, NeurIPS 2025).

The index holds every window of at most ``depth`` tokens of the sequences added, as a trie
with a count per node: the node of a string ``s`` counts the positions where ``s`` occurs (so a
node's children split its occurrences by the token that followed). That is a suffix tree cut at
``depth`` and without path compression, which is what speculation reads: the continuations of
the longest recent pattern, and how often each followed it.

Speculation, for a context (the request's tokens so far):
1. **Match**: the longest suffix of the context, ``p`` tokens (``p < depth``), whose node has a
   continuation.
2. **Score**: from that node, a child's probability is its share of its parent's continuations,
   ``P(child) = count(child) / Σ count(children)``, and a drafted node's score is the product of
   probabilities along its path: the chance, as far as the index knows, that the target emits
   that whole path. The sum of the scores of the drafted nodes is the expected number of
   accepted tokens, which is what the two indexes a request consults (its own, the cluster's)
   are compared by.
3. **Grow**: a chain takes the most frequent child while its score stays at or above
   ``min_token_prob``; a tree grows best-first by score (at most ``top_k`` children a node,
   ``budget`` nodes). Both draft at most ``max_spec_factor · p`` tokens deep: a long match
   predicts a long continuation, a one-token match almost nothing (the paper's adaptive length).

Deviation from the paper: its suffix tree is path-compressed and unbounded in depth; this trie
stops at ``depth`` (the pattern plus what is drafted from it never need more), which bounds its
memory at ``depth`` nodes a token in the worst case and keeps every update O(depth).

A per-request index is extended token by token (``extend``), keeping the nodes of the context's
current suffixes so that an appended token costs one child per suffix. The cluster's index
(``add`` / ``remove`` whole sequences, oldest out first) holds what other requests produced.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field


class Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


@dataclass
class Speculation:
    """Drafted tokens as a tree (``parents[i]`` is -1 for a child of the context's last token),
    each node's score, and the pattern length that was matched."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens: Σ of the drafted nodes' path probabilities."""
        return sum(self.scores)


class SuffixIndex:
    def __init__(self, depth: int = 32):
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = Node()
        self.nodes = 1
        # The context the index was extended with, and the nodes of its last depth - 1 suffixes
        # (longest first; a per-request index only).
        self.context: list[int] = []
        self._suffixes: list[Node] = []

    # ---- building -----------------------------------------------------------------------------

    def add(self, tokens: list[int]) -> None:
        """Every window of ``tokens`` (each start, up to ``depth`` tokens) counted once more."""
        for start in range(len(tokens)):
            self._walk(tokens[start:start + self.depth], 1)

    def remove(self, tokens: list[int]) -> None:
        """Undo an ``add`` of the same tokens; nodes left with no occurrence are freed."""
        for start in range(len(tokens)):
            self._walk(tokens[start:start + self.depth], -1)

    def _walk(self, window: list[int], delta: int) -> None:
        node = self.root
        node.count += delta
        for tok in window:
            child = node.children.get(tok)
            if child is None:
                if delta < 0:
                    raise KeyError(f"token {tok} was never added here")
                child = node.children[tok] = Node()
                self.nodes += 1
            child.count += delta
            if child.count == 0:
                self.nodes -= self._size(child)
                del node.children[tok]
                return
            node = child

    @staticmethod
    def _size(node: Node) -> int:
        return 1 + sum(SuffixIndex._size(c) for c in node.children.values())

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the indexed context: each one adds, under every current suffix
        shorter than ``depth``, the child it continues with (and a new one-token suffix)."""
        for tok in tokens:
            grown = []
            for node in [*self._suffixes, self.root]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = Node()
                    self.nodes += 1
                child.count += 1
                grown.append(child)
            self.root.count += 1
            self.context.append(tok)
            self._suffixes = grown[-(self.depth - 1):] if self.depth > 1 else []

    # ---- speculation --------------------------------------------------------------------------

    def match(self, context: list[int], longest: int | None = None) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``longest`` tokens, shorter than
        ``depth``) that has a continuation here, and its length; (None, 0) when not even its last
        token has one."""
        longest = min(len(context), self.depth - 1, self.depth - 1 if longest is None else longest)
        for length in range(longest, 0, -1):
            node = self.root
            for tok in context[len(context) - length:]:
                node = node.children.get(tok)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def speculate(self, context: list[int], max_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, top_k: int = 1, max_depth: int | None = None) -> Speculation:
        """Draft from the longest match: a chain (``top_k`` 1) or a tree of at most ``max_tokens``
        nodes, each node's score at least ``min_token_prob``, at most ``max_spec_factor · p`` (and
        ``max_depth``) deep."""
        wanted = max_tokens if max_depth is None else min(max_depth, max_tokens)
        # The pattern and what is drafted below it share the trie's depth: leave room to draft.
        node, length = self.match(context, max(1, self.depth - wanted))
        return grow(node, length, _children, self.depth, wanted, max_tokens, max_spec_factor, min_token_prob, top_k)


def _children(node: Node, top_k: int) -> tuple[int, list]:
    total = sum(c.count for c in node.children.values())
    best = sorted(node.children.items(), key=lambda kv: (-kv[1].count, kv[0]))[:top_k]
    return total, [(tok, child.count, child) for tok, child in best]


def grow(node, length: int, children, depth: int, wanted: int, max_tokens: int, max_spec_factor: float,
         min_token_prob: float, top_k: int) -> Speculation:
    """Best-first growth below a matched node of ``length`` tokens, for any index whose
    ``children(node, top_k)`` gives (Σ counts of every child, the ``top_k`` most frequent as
    (token, count, child node)): the candidate with the highest score joins next and its
    children become candidates, down to ``min(wanted, ⌈max_spec_factor · length⌉, depth − length)``."""
    spec = Speculation(match_len=length)
    if node is None or max_tokens <= 0:
        return spec
    max_depth = min(wanted, math.ceil(max_spec_factor * length), depth - length)
    # Heap entries: (-score, tie-break, token, its node, parent index, depth).
    frontier: list[tuple[float, int, int, object, int, int]] = []
    order = 0

    def offer(at, score: float, parent: int, level: int) -> None:
        nonlocal order
        if level > max_depth:
            return
        total, best = children(at, top_k)
        for tok, count, child in best:
            heapq.heappush(frontier, (-score * count / total, order, tok, child, parent, level))
            order += 1

    offer(node, 1.0, -1, 1)
    while frontier and len(spec.tokens) < max_tokens:
        neg, _, tok, child, parent, level = heapq.heappop(frontier)
        if -neg < min_token_prob:
            break   # every candidate left scores lower still
        spec.tokens.append(tok)
        spec.parents.append(parent)
        spec.scores.append(-neg)
        offer(child, -neg, len(spec.tokens) - 1, level + 1)
    return spec
