"""The one interface every draft implements.

A draft sees the whole committed context (prompt + emitted tokens, the last of which is the
tree root) and proposes what the target will say next. It keeps whatever state it likes
(a KV cache, an n-gram index) but must be correct from the tokens alone, because a request may
move between replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from specserve.replicas.sampling import SamplingParams, logits_to_probs, sample
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


def draft_chain(logits: torch.Tensor, window: int, params: SamplingParams, generator: torch.Generator | None,
                next_logits: Callable[[int], torch.Tensor]) -> Proposal:
    """The chain loop every model draft shares: choose a token from ``logits`` [V] (argmax, or a
    sample from q), then ``next_logits(token)`` for the next, ``window`` times. Greedy proposals
    are deterministic (q = one-hot), so they carry no draft_probs."""
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for i in range(window):
        if params.greedy:
            tok = int(logits.argmax())
        else:
            q = logits_to_probs(logits, params)
            tok = sample(q, generator)
            probs.append(q)
        tokens.append(tok)
        if i + 1 < window:
            logits = next_logits(tok)
    return Proposal.chain(tokens, torch.stack(probs) if probs else None)


def draft_from_model(name: str, model) -> Draft:
    """The draft that drives ``model``: a hidden-state-reuse head reads the target's states, any
    other causal LM drafts from tokens alone."""
    from specserve.replicas.drafts.draft_lm import DraftLM
    from specserve.replicas.drafts.hsr_draft import HSRDraft
    from specserve.replicas.drafts.hsr_head import HSRHead

    return HSRDraft(name, model) if isinstance(model, HSRHead) else DraftLM(name, model)
