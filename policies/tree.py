"""Adaptive trees: what a tree rule learns from, and the one wrapper that makes any rule the
scheduler's ``Policy`` (``replicas/scheduler.py``). The tree counterpart of ``window.py``.

A **tree rule** is a frozen dataclass of settings with three pure methods over an explicit,
per-request state ``S`` (a frozen dataclass that round-trips through JSON, ``window.JsonState``)::

    start(request)              -> S                       a request the policy has not seen
    update(S, outcome)          -> S                       one verified step (a TreeOutcome)
    decide(S, batch_size, rng)  -> (TreeShape | None, S)   the tree of its next step; None: plain

The rules, one per file: ``sage_tree.py`` ("SAGE: Accelerating Vision-Language Models via
Entropy-Guided Adaptive Speculative Decoding": entropy → depth and width, with the draft's tree
builder applying the width decay, threshold and node budget), ``adt_tree.py`` ("Fast Inference
of Visual Autoregressive Model with Adjacency-Adaptive Dynamical Draft Trees": bisectional depth
/ top-k update from the previous tree), ``eagle2_depth_tree.py`` ("A Drop-in Solution for
On-the-Fly Adaptation of Speculative Decoding in Large Language Models", App. C.4: the online
window objective choosing an EAGLE-2 tree's depth). The static tree is the
static policy (``static.py``): each step uses the tree the request asked for.

``TreePolicy`` holds the bookkeeping: one state per request id, dropped when the request
finishes. It adapts only unpinned requests that asked a tree of a draft; a request that asked a
chain (the window policies' business), pinned its speculation, or has no draft keeps exactly
what it asked for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

from specserve.policies.carry import CarriedSums
from specserve.policies.window import JsonState
from specserve.replicas.request import NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord, TreeShape


@dataclass(frozen=True)
class TreeOutcome(JsonState):
    """One request's part of one verified step, as a tree rule sees it. Times are the whole
    step's; ``others_*`` describe the rest of the batch (as in ``window.WindowOutcome``)."""

    asked_depth: int            # the depth asked for this step (after the scheduler's cap); 0: plain
    depth: int                  # the longest path the draft offered (RequestStep.max_depth); 0: nothing
    nodes: int                  # nodes the draft proposed
    accepted: int               # n
    root_probs: tuple[float, ...] = ()   # the draft's top probabilities at the root, highest first
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    forward_tokens: int = 0     # tokens the verify forward fed, over the whole batch
    batch_size: int = 1
    others_depth: int = 0       # the deepest path another request of the batch was offered
    others_emitted: int = 0     # Σ (n + 1) over the other requests of the batch

    @classmethod
    def of(cls, record: StepRecord, step: RequestStep) -> TreeOutcome:
        others = [s for s in record.requests if s is not step]
        tree = step.asked.tree
        return cls(
            asked_depth=step.asked.window if tree is None else tree.depth, depth=step.max_depth,
            nodes=step.proposed, accepted=step.accepted, root_probs=tuple(step.draft_root_probs or ()),
            draft_ms=record.draft_ms, verify_ms=record.verify_ms, forward_tokens=record.forward_tokens,
            batch_size=record.batch_size, others_depth=max((s.max_depth for s in others), default=0),
            others_emitted=sum(s.accepted + 1 for s in others),
        )


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


class TreeRule(Protocol):
    def start(self, request: SpecRequest) -> Any: ...

    def update(self, state: Any, outcome: TreeOutcome) -> Any: ...

    def decide(self, state: Any, batch_size: int, rng: random.Random) -> tuple[TreeShape | None, Any]: ...


class TreePolicy:
    """Any tree rule as the scheduler's ``Policy``: ``choose`` runs the rule's ``decide`` on the
    request's state, ``observe`` its ``update`` with each request's part of the step. States of
    finished or cancelled requests are dropped at the next ``observe``."""

    def __init__(self, rule: TreeRule, rng: random.Random | None = None):
        self.rule = rule
        self.rng = rng if rng is not None else random.Random()
        self.states: dict[str, Any] = {}          # request id -> the rule's state (JSON-serialisable)
        self.carried = CarriedSums()               # what finished requests leave to new ones (carry.py)
        self._requests: dict[str, RequestState] = {}

    @staticmethod
    def adapts(request: SpecRequest) -> bool:
        """Only unpinned tree requests with a draft are adapted; chains belong to window policies."""
        return not request.pinned and request.draft != NO_DRAFT and request.tree is not None

    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        if not self.adapts(state.request):
            return state.request.speculation
        current = self.states.get(state.id)
        if current is None:
            current = self.carried.start(self.rule, state.request)
        shape, current = self.rule.decide(current, batch_size, self.rng)
        self.states[state.id] = current
        self._requests[state.id] = state
        return PLAIN if shape is None else Speculation(0, shape)

    def observe(self, record: StepRecord) -> None:
        for step in record.requests:
            if step.request_id in self._requests:
                self.states[step.request_id] = self.rule.update(self.states[step.request_id], TreeOutcome.of(record, step))
        for request_id in [i for i, request in self._requests.items() if request.done]:
            if request_id in self.states:
                self.carried.finish(self.rule, self._requests[request_id].request, self.states[request_id])
            self.drop(request_id)

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._requests.pop(request_id, None)
