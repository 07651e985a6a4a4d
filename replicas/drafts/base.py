"""The one interface every draft implements.

A draft sees the whole committed context (prompt + emitted tokens, the last of which is the
tree root) and proposes what the target will say next. It keeps whatever state it likes
(a KV cache, an n-gram index) but must be correct from the tokens alone, because a request may
move between replicas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.replicas.sampling import SamplingParams, logits_to_probs, sample
from specserve.replicas.step import Proposal, ProposeRequest, TreeShape


@dataclass(frozen=True)
class NeedFeatures:
    """A draft server's reply instead of a proposal, from a draft that reads the target's hidden
    states and holds fewer of them than the ask assumed (another target replica drafted this
    request before): re-send the target's states from ``have``."""

    have: int


@dataclass(frozen=True)
class DraftInputs:
    """What a draft reads besides the context, declared by its class (``Draft.inputs``): its
    ``propose`` and ``propose_tree`` then take the matching keyword arguments, and ``propose``
    below passes them from the ask."""

    features: bool = False          # the target's hidden states: ``features``, ``features_start``
    cache_salt: bool = False        # the request's tenant (it reads other requests' outputs): ``cache_salt``
    image_positions: bool = False   # a VLM request's image token as drafts read it: ``image_placeholder``


CONTEXT_ONLY = DraftInputs()


class Draft(Protocol):
    name: str
    inputs: DraftInputs   # what it reads besides the context; CONTEXT_ONLY: the tokens alone

    def propose(
        self,
        context: list[int],
        window: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        **inputs,
    ) -> Proposal:
        """A chain of at most ``window`` tokens. A draft that samples from its own ``q`` returns
        ``draft_probs``; a deterministic one (greedy, lookup) returns none. ``inputs``: the keyword
        arguments its ``inputs`` declares, no others."""
        ...

    def propose_tree(self, context: list[int], shape: TreeShape, **inputs) -> Proposal:
        """A token tree of at most ``shape.depth`` levels and ``shape.budget`` nodes."""
        ...


class ChainBuilder:
    """One chain proposal, token by token: the argmax under greedy (q = one-hot, so no
    draft_probs), else a sample from the warped q, whose rows the rejection sampler needs.

    ``head``: the logits given are this pruned head's (``PrunedHeadMixin``), over its own K tokens
    (every other id at -inf once scattered). Greedy then chooses among the K directly (the same
    token and probability: the other ids have none), a 49,152-wide argmax and softmax less per
    drafted token; sampling scatters first, since q must cover every id."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, head=None):
        self.params = params
        self.generator = generator
        self.head = head
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.token_probs: list[float] = []
        self.alternatives: list[int] = []   # greedy: the runner-up at each position

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` [V] (or [K], the tokens of ``head``)."""
        if self.params.greedy:
            # One read from the device a token (on a GPU each read waits for it): the argmax, the
            # top two and the argmax's probability; for a head, the picks' vocabulary ids.
            picks = torch.cat([logits.argmax()[None], logits.topk(min(2, logits.shape[-1])).indices])
            parts = [torch.softmax(logits.float(), -1)[picks[:1]].double(), picks.double()]
            if self.head is not None:
                parts.append(self.head.head_token_ids(logits.device)[picks].double())
            prob, *read = torch.cat(parts).tolist()
            n = len(picks)
            places, ids = [int(v) for v in read[:n]], [int(v) for v in read[n:]] or None
            index = places[0]
            second = 1 if places[1] != index else n - 1   # the runner-up's place in ``picks``
            self.token_probs.append(prob)
            tok = index if ids is None else ids[0]
            self.alternatives.append(-1 if places[second] == index else (ids or places)[second])
        else:
            if self.head is not None:
                logits = self.head.to_full_vocab(logits)
            q = logits_to_probs(logits, self.params)
            tok = sample(q, self.generator)
            self.probs.append(q)
            self.token_probs.append(float(q[tok]))
        self.tokens.append(tok)
        return tok

    def proposal(self) -> Proposal:
        return Proposal.chain(self.tokens, torch.stack(self.probs) if self.probs else None, self.token_probs,
                              self.alternatives if self.params.greedy else None)


def draft_chain(logits: torch.Tensor, window: int, params: SamplingParams, generator: torch.Generator | None,
                next_logits: Callable[[int], torch.Tensor], head=None) -> Proposal:
    """The chain loop every one-session model draft shares: choose a token from ``logits`` [V],
    then ``next_logits(token)`` for the next, ``window`` times (a pruned ``head``'s [K] logits:
    see ``ChainBuilder``)."""
    chain = ChainBuilder(params, generator, head)
    for i in range(window):
        tok = chain.choose(logits)
        if i + 1 < window:
            logits = next_logits(tok)
    return chain.proposal()


def draft_model(draft):
    """The model a draft runs (a draft LM's or a hidden-state-reuse head's), None for model-free drafts."""
    session = getattr(draft, "session", None)
    return getattr(session, "model", None) or getattr(draft, "head", None)


def vocabulary_error(name: str, draft_vocab: int | None, target_vocab: int) -> str | None:
    """Why a draft cannot serve a target, or None. A draft's vocabulary is its config's (a pruned
    head scatters its logits back to full-vocabulary ids); None: model-free, the target's own ids."""
    if draft_vocab is None or draft_vocab == target_vocab:
        return None
    return f"draft {name!r} has a vocabulary of {draft_vocab} ids, the target {target_vocab}: a draft must share the target's tokenizer"


def needs_features(draft: Draft) -> bool:
    """Whether ``draft`` reads the target's hidden states (a hidden-state-reuse head)."""
    return draft.inputs.features


def propose(draft: Draft, ask: ProposeRequest, generator: torch.Generator | None) -> Proposal:
    """The proposal ``ask`` wants of ``draft``: a tree, or a chain of ``ask.window`` tokens, with
    the inputs the draft declares (``DraftInputs``)."""
    inputs = draft.inputs
    extra = {"features": ask.features, "features_start": ask.features_start} if inputs.features else {}
    if inputs.cache_salt:
        extra["cache_salt"] = ask.cache_salt
    if inputs.image_positions:
        extra["image_placeholder"] = ask.image_placeholder
    if ask.tree is not None:
        return draft.propose_tree(ask.context, ask.tree, **extra)
    return draft.propose(ask.context, ask.window, ask.params, generator, **extra)
