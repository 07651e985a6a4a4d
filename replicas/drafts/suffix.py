"""SuffixDecoding's draft: the request's own suffix index and the cluster's, whichever expects more.

Per request, an index of its prompt and output so far (``SuffixIndex.extend``, token by token as
steps accept them); across requests, an index of earlier outputs (``remember``), bounded to the
last ``remembered_tokens`` tokens, oldest out first. Each step both are matched against the
context and the speculation with the higher score (expected accepted tokens, ``suffix_index``)
is proposed: the request's own wins where the output copies its prompt, the cluster's where
requests repeat what earlier ones produced (agents, templated answers, edits of the same code).
No model, so it drafts greedily (q one-hot): sampled requests stay exact through rejection
sampling like prompt lookup's.

Like every draft it is correct from the tokens alone (``base``): a request's index is found by
its context (``_own``), rebuilt if this replica has none, and extended with what was accepted.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from specserve.replicas.drafts.suffix_index import Speculation, SuffixIndex
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape

KEY_TOKENS = 32   # a request's index is looked up by its first tokens, then checked in full


class SuffixDraft:
    name = "suffix"

    def __init__(self, depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 remembered_tokens: int = 1 << 20, requests: int = 64):
        self.depth = depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.cluster = SuffixIndex(depth)
        self.remembered_tokens = remembered_tokens
        self._remembered: deque[list[int]] = deque()
        self._remembered_size = 0
        self.requests = requests
        self._own_indexes: OrderedDict[tuple[int, ...], list[SuffixIndex]] = OrderedDict()

    # ---- the cluster's outputs ----------------------------------------------------------------

    def remember(self, output: list[int]) -> None:
        """Index a finished output for every later request; the oldest leave past the bound."""
        if not output:
            return
        self.cluster.add(output)
        self._remembered.append(list(output))
        self._remembered_size += len(output)
        while self._remembered_size > self.remembered_tokens and len(self._remembered) > 1:
            old = self._remembered.popleft()
            self.cluster.remove(old)
            self._remembered_size -= len(old)

    # ---- the request's own --------------------------------------------------------------------

    def _own(self, context: list[int]) -> SuffixIndex:
        """The index of this context: the request's, extended with what it accepted since. An
        index is filed under its context's first ``KEY_TOKENS`` tokens (all of them while it was
        shorter), so a context looks under each of its prefixes up to that length."""
        best, key = None, None
        for n in range(min(len(context), KEY_TOKENS), 0, -1):
            for index in self._own_indexes.get(tuple(context[:n]), ()):
                have = len(index.context)
                if have <= len(context) and index.context == context[:have] and (best is None or have > len(best.context)):
                    best, key = index, tuple(context[:n])
            if best is not None:
                break
        if best is None:
            best, key = SuffixIndex(self.depth), tuple(context[:KEY_TOKENS])
            candidates = self._own_indexes.setdefault(key, [])
            candidates.append(best)
            if len(candidates) > 4:   # several requests sharing an opening: keep the latest few
                candidates.pop(0)
        best.extend(context[len(best.context):])
        self._own_indexes.move_to_end(key)
        while len(self._own_indexes) > self.requests:
            self._own_indexes.popitem(last=False)
        return best

    # ---- drafting -----------------------------------------------------------------------------

    def speculate(self, context: list[int], max_tokens: int, max_depth: int, top_k: int) -> Speculation:
        """The better of the request's and the cluster's speculations (by expected accepted tokens;
        the request's on a tie)."""
        options = [index.speculate(context, max_tokens, self.max_spec_factor, self.min_token_prob, top_k, max_depth)
                   for index in (self._own(context), self.cluster)]
        return max(options, key=lambda s: s.score)

    def propose(self, context: list[int], window: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        spec = self.speculate(context, window, window, 1)
        return Proposal.chain(spec.tokens, None, _given_parent(spec))

    def propose_tree(self, context: list[int], shape: TreeShape) -> Proposal:
        spec = self.speculate(context, shape.budget, shape.depth, shape.top_k)
        return Proposal(spec.tokens, spec.parents, None, _given_parent(spec))


def _given_parent(spec: Speculation) -> list[float]:
    """Each drafted token's probability given its parent, as the index estimates it."""
    return [score / (spec.scores[parent] if parent >= 0 else 1.0) for score, parent in zip(spec.scores, spec.parents)]
