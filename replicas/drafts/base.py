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

from specserve.replicas.sampling import NOT_A_DISTRIBUTION, NonFiniteScores, SamplingParams, draws, logits_to_probs
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
    drafted token; sampling scatters first, since q must cover every id.

    ``choose`` reads each token to the host (a draft that feeds token ids to its model);
    ``choose_unread`` leaves it on the device for a draft that feeds it there (a head's graphs),
    and ``proposal`` reads every such token at once: on a GPU each read waits for the device, so
    a chain of γ tokens waits once instead of γ times. Both make the same draws in the same order."""

    def __init__(self, params: SamplingParams, generator: torch.Generator | None, head=None):
        self.params = params
        self.generator = generator
        self.head = head
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.token_probs: list[float] = []
        self.alternatives: list[int] = []   # greedy: the runner-up at each position
        self._unread: list[torch.Tensor] = []
        self.failed = False   # a q that was not a distribution was read: the chain proposes nothing more

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` [V] (or [K], the tokens of ``head``), read now."""
        self.choose_unread(logits)
        self._read()
        return self.tokens[-1]

    def choose_unread(self, logits: torch.Tensor) -> torch.Tensor:
        """``choose``'s token as a [1] long tensor on the logits' device, unread: a valid id to feed
        even where q is not a distribution (``proposal`` then raises ``NonFiniteScores``)."""
        feed, row = self._chosen(logits)
        self._unread.append(row)
        return feed

    def proposal(self) -> Proposal:
        self._read()
        return Proposal.chain(self.tokens, torch.stack(self.probs) if self.probs else None, self.token_probs,
                              self.alternatives if self.params.greedy else None)

    def _chosen(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The token to feed [1], and what the proposal reports of it, float64 [3] on the device:
        the token (-1: q is not a distribution), its probability, the greedy runner-up (-1: none)."""
        if self.params.greedy:
            # The argmax (the first of equal maxima), the top two, and the argmax's probability;
            # for a head, the picks' vocabulary ids. One-element tensors throughout: indexing with
            # a 0-d tensor would read it.
            index = logits.argmax().view(1)
            top = logits.topk(min(2, logits.shape[-1])).indices
            runner = torch.where(top[:1] != index, top[:1], top[-1:])
            prob = torch.softmax(logits.float(), -1).index_select(0, index)
            token, alternative = index, runner
            if self.head is not None:
                ids = self.head.head_token_ids(logits.device)
                token, alternative = ids.index_select(0, index), ids.index_select(0, runner)
            alternative = torch.where(runner == index, -1, alternative)
            return token, torch.cat([token.double(), prob.double(), alternative.double()])
        if self.head is not None:
            logits = self.head.to_full_vocab(logits)
        q = logits_to_probs(logits, self.params, check=False)   # non-finite: NaN, which ``draws`` marks -1
        token = draws(q[None], self.generator)
        feed = token.clamp(min=0)
        self.probs.append(q)
        return feed, torch.cat([token.double(), q.index_select(0, feed).double(), token.new_full((1,), -1).double()])

    def _read(self) -> None:
        """Every unread token, in one read from the device; ``NonFiniteScores`` once one failed."""
        read_together([self])
        if self.failed:
            raise NonFiniteScores(f"draft: {NOT_A_DISTRIBUTION}")

    def _take(self, rows: list[list[float]]) -> None:
        for token, prob, alternative in rows:
            if token < 0:
                self.failed = True
            if self.failed:
                return
            self.tokens.append(int(token))
            self.token_probs.append(prob)
            if self.params.greedy:
                self.alternatives.append(int(alternative))


def read_together(chains: list[ChainBuilder]) -> None:
    """Every chain's unread tokens in one read from the device (the chains share one): a chain
    whose q was not a distribution is marked ``failed``, the others read as alone."""
    unread = [chain for chain in chains if chain._unread]
    if not unread:
        return
    rows = torch.cat([torch.stack(chain._unread) for chain in unread]).tolist()
    at = 0
    for chain in unread:
        count = len(chain._unread)
        chain._unread.clear()
        chain._take(rows[at:at + count])
        at += count


def draft_chain(logits: torch.Tensor, window: int, params: SamplingParams, generator: torch.Generator | None,
                next_logits: Callable, head=None, unread: bool = False) -> Proposal:
    """The chain loop every one-session model draft shares: choose a token from ``logits`` [V],
    then ``next_logits(token)`` for the next, ``window`` times (a pruned ``head``'s [K] logits:
    see ``ChainBuilder``). ``unread``: the token is given as a [1] tensor on the device, and the
    chain is read once, at the end (``ChainBuilder.choose_unread``)."""
    chain = ChainBuilder(params, generator, head)
    for i in range(window):
        tok = chain.choose_unread(logits) if unread else chain.choose(logits)
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
