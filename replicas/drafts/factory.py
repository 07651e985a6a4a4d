"""Which draft drives a loaded model (kept apart from ``base`` so that the drafts it builds can
import ``base`` without a cycle)."""

from __future__ import annotations

from specserve.replicas.drafts.base import Draft
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.drafts.hsr_head import HSRHead


def draft_from_model(name: str, model, windowed: bool = False) -> Draft:
    """A hidden-state-reuse head reads the target's states (``windowed``: Sparrow's text-anchored
    attention on VLM requests, ``HSRDraft``; always for a head trained with IVSB, whose picture
    positions read states the target does not send); any other causal LM drafts from tokens alone."""
    if not isinstance(model, HSRHead):
        return DraftLM(name, model)
    return HSRDraft(name, model, windowed or model.config.visual_anchor_layer is not None)
