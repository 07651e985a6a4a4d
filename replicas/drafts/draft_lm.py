"""A small causal LM that shares the target's tokenizer, drafting with its own KV cache."""

from __future__ import annotations

import torch

from specserve.replicas.drafts.base import CONTEXT_ONLY, draft_chain
from specserve.replicas.drafts.tree_growth import TreeGrowth
from specserve.replicas.model.kv_session import KVSession
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape


class DraftLM:
    inputs = CONTEXT_ONLY

    def __init__(self, name: str, model):
        self.name = name
        self.session = KVSession(model)

    def _root_logits(self, context: list[int]) -> torch.Tensor:
        """Logits after the last context token, feeding only what the cache lacks. returns [V]"""
        missing = self.session.sync(context)
        if not missing:   # all cached, but the root's logits were not kept: recompute that one
            self.session.crop(len(context) - 1)
            missing = context[-1:]
        return self.session.extend(missing, logits_rows=1)[-1]

    def propose(
        self,
        context: list[int],
        window: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if window <= 0:
            return Proposal.empty()
        return draft_chain(self._root_logits(context), window, params, generator,
                           lambda tok: self.session.extend([tok], logits_rows=1)[-1])

    def propose_tree(self, context: list[int], shape: TreeShape) -> Proposal:
        """An EAGLE-2-style tree (``TreeGrowth``), each level fed in one forward."""
        growth = TreeGrowth(shape)
        frontier_logits = self._root_logits(context)[None]            # [F, V]
        for level in range(shape.depth):
            if not growth.growing:   # budget spent, or every candidate pruned (SAGE's θ)
                break
            first_new = growth.grow(frontier_logits)
            if growth.more_levels(level):
                frontier_logits = self.session.extend_tree(growth.tokens, growth.parents, first_fed=first_new)
        self.session.crop(len(context))   # tree nodes are not part of the committed sequence
        return growth.proposal()
