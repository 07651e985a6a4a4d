"""Prompt lookup: draft by copying what followed earlier occurrences of the last n tokens.

No model, so no cost beyond an n-gram search; it pays where outputs copy their input
(summaries, edits, code that repeats identifiers). Longer n-grams are tried first because a
longer match predicts its continuation better; among equal matches the most recent wins,
because generation tends to repeat what it just wrote.

Example, with the defaults ``max_ngram=3, min_ngram=1``::

    context = [1, 2, 3, 4, 2, 3], window 4 -> [4, 2, 3]
        # the 3-gram [4, 2, 3] occurs nowhere earlier; the 2-gram [2, 3] does, at index 1, and
        # what followed it is [4, 2, 3]: the context ends before the window's 4 tokens
    context = [1, 2, 3, 4, 2, 3, 5, 2, 3], window 2 -> [5, 2]
        # [2, 3] occurs at indices 1 and 4: the most recent wins, [5, 2, 3] cut to the window
    context = [1, 2, 3, 9, 7, 3, 8, 1, 2, 3], window 2 -> [9, 7]
        # the 3-gram [1, 2, 3] at index 0 beats the more recent 1-gram [3] at index 5
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specserve.replicas.drafts.base import CONTEXT_ONLY
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape


class PromptLookupDraft:
    name = "prompt-lookup"
    inputs = CONTEXT_ONLY

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def continuations(self, context: list[int], length: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of at most ``length`` tokens, best first."""
        found: list[list[int]] = []
        if length <= 0 or limit <= 0:
            return found
        tokens = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            # windows[i] = tokens[i:i+n]; a match must end before the suffix itself starts.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            for start in starts[::-1]:
                cont = context[start + n : start + n + length]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == limit:
                        return found
        return found

    def propose(
        self,
        context: list[int],
        window: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        conts = self.continuations(context, window, limit=1)
        return Proposal.chain(conts[0] if conts else [])

    def propose_tree(self, context: list[int], shape: TreeShape) -> Proposal:
        """The continuations of several matches merged into a trie (shared prefixes once)."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, dict[int, int]] = {-1: {}}   # node -> {token: child node}
        for cont in self.continuations(context, shape.depth, limit=shape.budget):
            node = -1
            for tok in cont:
                nxt = children[node].get(tok)
                if nxt is None:
                    if len(tokens) == shape.budget or len(children[node]) == shape.top_k:
                        break
                    nxt = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    children[node][tok] = nxt
                    children[nxt] = {}
                node = nxt
        return Proposal(tokens, parents)
