"""The per-request speculation session: propose, verify, emit, until done.

    while not done:
        proposal = draft.propose(context, γ)        # or a token tree
        result   = target.verify(context, proposal)  # n accepted + 1 bonus token
        emit result.emitted_tokens                   # stop at EOS / max_tokens

The window or tree shape is fixed per request for now; the adaptive policies of
``specserve.policies`` plug in where ``window`` and ``tree`` are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.replicas.drafts.base import Draft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, SpecStats, TreeShape
from specserve.replicas.target import Target


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str   # "stop" (an EOS token) or "length" (max_tokens), as in the OpenAI API
    stats: SpecStats


def speculative_generate(
    target: Target,
    draft: Draft | None,
    prompt_ids: list[int],
    max_tokens: int,
    params: SamplingParams,
    window: int = 0,
    tree: TreeShape | None = None,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
) -> Generation:
    """``draft=None`` or ``window=0`` without a tree is plain decoding through the same path."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    generator = None if params.greedy else params.generator()
    stats = SpecStats(draft=draft.name if draft is not None else "none")
    context = list(prompt_ids)
    out: list[int] = []
    while True:
        # Never draft past max_tokens: the bonus token always comes on top.
        room = max_tokens - len(out) - 1
        if draft is None or room == 0:
            proposal = Proposal.empty()
        elif tree is not None:
            proposal = draft.propose_tree(context, TreeShape(min(tree.depth, room), tree.top_k, tree.budget))
        else:
            proposal = draft.propose(context, min(window, room), params, generator)
        result = target.verify(context, proposal, params, generator)
        stats.record(result)
        for token in result.emitted_tokens:
            out.append(token)
            context.append(token)
            if token in eos_token_ids:
                return Generation(out, "stop", stats)
            if len(out) == max_tokens:
                return Generation(out, "length", stats)
