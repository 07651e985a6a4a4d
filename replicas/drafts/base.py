"""The one interface every draft implements.

A draft sees the whole committed context (prompt + emitted tokens, the last of which is the
tree root) and proposes what the target will say next. It keeps whatever state it likes
(a KV cache, an n-gram index) but must be correct from the tokens alone, because a request may
move between replicas.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape


class Draft(Protocol):
    name: str

    def propose(
        self,
        context: list[int],
        window: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """A chain of at most ``window`` tokens. A draft that samples from its own ``q`` returns
        ``draft_probs``; a deterministic one (greedy, lookup) returns none."""
        ...

    def propose_tree(self, context: list[int], shape: TreeShape) -> Proposal:
        """A token tree of at most ``shape.depth`` levels and ``shape.budget`` nodes."""
        ...


def draft_from_model(name: str, model) -> Draft:
    """The draft that drives ``model``: a hidden-state-reuse head reads the target's states, any
    other causal LM drafts from tokens alone."""
    from specserve.replicas.drafts.draft_lm import DraftLM
    from specserve.replicas.drafts.hsr_draft import HSRDraft
    from specserve.replicas.drafts.hsr_head import HSRHead

    return HSRDraft(name, model) if isinstance(model, HSRHead) else DraftLM(name, model)
