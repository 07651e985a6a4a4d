"""The per-request speculation session: propose, verify, emit, until done.

    while not done:
        proposal = draft.propose(context, γ)        # or a token tree
        result   = target.verify(context, proposal)  # n accepted + 1 bonus token
        emit result.emitted_tokens                   # stop at EOS / max_tokens

``SpecSession`` holds the bookkeeping of that loop (context, room left, stop conditions,
statistics) and does no I/O, so the same object drives the in-process loop below and the served
loop on a target replica, where ``propose`` is a call to a draft deployment.

The window or tree shape is fixed per request for now; the adaptive policies of
``specserve.policies`` plug in where ``window`` and ``tree`` are read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specserve.replicas.drafts.base import Draft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, SpecStats, StepResult, TreeShape
from specserve.replicas.target import Target


@dataclass(frozen=True)
class ProposeRequest:
    """What the next step asks of the draft: a chain of ``window`` tokens, or a tree.

    A hidden-state-reuse draft (``needs_features``) also gets the target's hidden states of
    context positions ``features_start..``: the ones it has not been sent yet."""

    window: int
    tree: TreeShape | None
    features: torch.Tensor | None = None
    features_start: int = 0


def needs_features(draft) -> bool:
    return bool(getattr(draft, "needs_features", False))


def propose(draft: Draft, context: list[int], ask: ProposeRequest, params: SamplingParams,
            generator: torch.Generator | None) -> Proposal:
    extra = {"features": ask.features, "features_start": ask.features_start} if needs_features(draft) else {}
    if ask.tree is not None:
        return draft.propose_tree(context, ask.tree, **extra)
    return draft.propose(context, ask.window, params, generator, **extra)


@dataclass(frozen=True)
class SpecRequest:
    """One generation as the ingress hands it to a target replica (already tokenized and checked)."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    draft: str = "none"
    window: int = 0
    tree: TreeShape | None = None
    session_id: str = ""


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str   # "stop" (an EOS token) or "length" (max_tokens), as in the OpenAI API
    stats: SpecStats


class SpecSession:
    """One request's state between steps. Check the arguments once, here, for every caller."""

    def __init__(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        draft: str = "none",
        window: int = 0,
        tree: TreeShape | None = None,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
    ):
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.context = list(prompt_ids)
        self.max_tokens = max_tokens
        self.window = window
        self.tree = tree
        self.eos_token_ids = eos_token_ids
        self.out: list[int] = []
        self.finish_reason: str | None = None
        self.stats = SpecStats(draft=draft)
        self.speculating = draft != "none" and (window > 0 or tree is not None)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def next_ask(self) -> ProposeRequest | None:
        """The proposal the next step needs, or None for a plain decoding step."""
        # Never draft past max_tokens: the bonus token always comes on top.
        room = self.max_tokens - len(self.out) - 1
        if not self.speculating or room == 0:
            return None
        if self.tree is not None:
            return ProposeRequest(0, TreeShape(min(self.tree.depth, room), self.tree.top_k, self.tree.budget))
        return ProposeRequest(min(self.window, room), None)

    def stop_speculating(self) -> None:
        """Plain decoding from here on (a draft replica failed: it costs speed, not the request)."""
        self.speculating = False

    def advance(self, result: StepResult) -> list[int]:
        """Record a verified step; returns the tokens it adds to the output (cut at EOS / max_tokens)."""
        self.stats.record(result)
        new: list[int] = []
        for token in result.emitted_tokens:
            new.append(token)
            self.out.append(token)
            self.context.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
            elif len(self.out) == self.max_tokens:
                self.finish_reason = "length"
            if self.done:
                break
        return new

    def generation(self) -> Generation:
        return Generation(self.out, self.finish_reason or "length", self.stats)


def speculative_generate(
    target: Target,
    draft: Draft | None,
    prompt_ids: list[int],
    max_tokens: int,
    params: SamplingParams,
    window: int = 0,
    tree: TreeShape | None = None,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """``draft=None`` or ``window=0`` without a tree is plain decoding through the same path.
    ``on_tokens`` sees each step's new tokens as they are verified (streaming, benchmarks)."""
    session = SpecSession(prompt_ids, max_tokens, draft.name if draft is not None else "none",
                          window, tree, eos_token_ids)
    generator = None if params.greedy else params.generator()
    stats = session.stats
    while not session.done:
        ask = session.next_ask()
        if ask is not None and needs_features(draft):   # in-process: a view of them all, no copy
            ask = replace(ask, features=target.features(session.context))
        t0 = time.perf_counter()
        proposal = Proposal.empty() if ask is None else propose(draft, session.context, ask, params, generator)
        t1 = time.perf_counter()
        result = target.verify(session.context, proposal, params, generator)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        new = session.advance(result)
        if on_tokens is not None:
            on_tokens(new)
    return session.generation()
