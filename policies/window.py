"""Adaptive chain windows: what a window rule learns from, and the one wrapper that makes any rule
the scheduler's ``Policy`` (``replicas/scheduler.py``).

A **window rule** is a frozen dataclass of settings with three pure methods over an explicit,
per-request state ``S`` (a frozen dataclass that round-trips through JSON, so it can sit in Redis
and a test can replay it)::

    start(request)              -> S           the state of a request the policy has not seen
    update(S, outcome)          -> S           one verified step of that request (a WindowOutcome)
    decide(S, batch_size, rng)  -> (γ, S)      the window of its next step; rng is injected

The rules, one per file: ``online_window.py`` ("A Drop-in Solution for On-the-Fly Adaptation of
Speculative Decoding in Large Language Models", §4.1, the objective G(γ) with measured costs),
``fsm_window.py`` and ``cache_fsm_window.py`` (its §4.2), ``q_learning_window.py`` (its §4.2 and
App. B.4), ``hf_window.py`` (Hugging Face assisted generation's heuristic, a baseline).

``WindowPolicy`` holds the bounds and the bookkeeping so that no rule repeats them: one state per
request id, dropped when the request finishes; a request that pinned its speculation, asked for a
tree, or has no draft keeps exactly what it asked for; no window above ``rule.window_max``.
It assumes request ids are unique among running requests (the scheduler's ``StepPlan`` already
does).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from specserve.policies.carry import CarriedSums
from specserve.policies.verify_costs import VerifyCosts
from specserve.replicas.request import NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.step import PLAIN, RequestStep, SpecStats, Speculation, StepRecord


def _tuples(value: Any) -> Any:
    """JSON gives lists back; frozen states hold tuples (hashable, and equal after a round trip)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


class JsonState:
    """``to_json`` / ``from_json`` for a frozen dataclass of numbers and (nested) tuples."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{k: _tuples(v) for k, v in data.items()})


@dataclass(frozen=True)
class WindowOutcome(JsonState):
    """One request's part of one verified step, as a window rule sees it.

    Times are the whole step's (``draft_ms``: every draft's proposals, which run batched and
    concurrently; ``verify_ms``: the one target forward of the batch); ``others_*`` describe the
    rest of the batch, so a rule can price its own window inside the shared forward.
    """

    asked: int                  # the window asked for this step (after the scheduler's cap)
    window: int                 # γ the draft actually offered (RequestStep.max_depth); 0: no proposal
    accepted: int               # n
    emitted_tokens: tuple[int, ...] = ()   # the n accepted draft tokens, then the bonus token
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    forward_tokens: int = 0     # tokens the verify forward fed, over the whole batch
    batch_size: int = 1
    others_window: int = 0      # the longest window another request of the batch was offered
    others_emitted: int = 0     # Σ (n + 1) over the other requests of the batch
    # The replica's verify ms by forward tokens at this step's batch size and context bucket, from
    # every request's steps (``verify_costs.VerifyCosts.table``): ((tokens, median ms), ...).
    verify_table: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, record: StepRecord, step: RequestStep, emitted_tokens: Sequence[int] = (),
           verify_table: tuple[tuple[int, float], ...] = ()) -> WindowOutcome:
        others = [s for s in record.requests if s is not step]
        asked = step.asked.window if step.asked.tree is None else step.asked.tree.depth
        return cls(
            asked=asked, window=step.max_depth, accepted=step.accepted, emitted_tokens=tuple(emitted_tokens),
            draft_ms=record.draft_ms, verify_ms=record.verify_ms, forward_tokens=record.forward_tokens,
            batch_size=record.batch_size, others_window=max((s.max_depth for s in others), default=0),
            others_emitted=sum(s.accepted + 1 for s in others), verify_table=verify_table,
        )

    @property
    def fully_accepted(self) -> bool:
        return self.window > 0 and self.accepted >= self.window


def estimate_alpha(history: Sequence[tuple[int, int]], alpha_max: float,
                   prior: tuple[float, float] | None = None) -> float | None:
    """α̂ over (n, γ) pairs (the on-the-fly adaptation paper's Eq. 2), capped at ``alpha_max``;
    None before any drafting (unless there is a prior).

    ``SpecStats.acceptance_rate`` is the project's one implementation of Eq. 2
    (Σn / (Σn + Σ1[n < γ])); this feeds it the window's totals instead of repeating it.

    ``prior = (α0, m)``, the cluster's α for this draft and bucket (``priors.py``), counts as m
    pseudo-steps: (Σn + m·α0) / (Σn + Σ1[n < γ] + m). Not in the paper, which starts cold: one
    unlucky first step (α̂ = 0) would otherwise switch speculation off for a request that the
    cluster knows drafts well; the prior's weight fades as the request's own steps accumulate.
    """
    drafted = [(n, g) for n, g in history if g > 0]
    if not drafted and prior is None:
        return None
    accepted = float(sum(n for n, _ in drafted))
    rejections = float(sum(1 for n, g in drafted if n < g))
    if prior is not None:
        alpha0, weight = prior
        accepted, rejections = accepted + weight * alpha0, rejections + weight * (1.0 - alpha0)
    totals = SpecStats(draft="", accepted=accepted, rejections=rejections)
    return min(alpha_max, totals.acceptance_rate)


def fit_verify_ms(costs: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(c0, c1) of ``verify_ms ≈ c0 + c1 · forward_tokens`` by least squares; None until the
    steps span two sizes. The slope is floored at 0 (noise on a shared machine can make it
    negative) and the intercept at 1 µs, so a step never looks free."""
    if len({t for t, _ in costs}) < 2:
        return None
    # Closed form (statistics.linear_regression is exact but slower, and this runs per step).
    n = len(costs)
    mean_t = sum(t for t, _ in costs) / n
    mean_ms = sum(ms for _, ms in costs) / n
    var = sum((t - mean_t) ** 2 for t, _ in costs)
    slope = max(0.0, sum((t - mean_t) * (ms - mean_ms) for t, ms in costs) / var)
    # The least-squares line passes through the means; with the slope floored it is their level.
    return max(1e-3, mean_ms - slope * mean_t), slope


def with_costs(draft_costs: tuple, verify_costs: tuple, drafted: int, others_drafted: int, draft_ms: float,
               forward_tokens: int, verify_ms: float, limit: int) -> tuple[tuple, tuple]:
    """One step's costs added to a request's measured (draft forwards, draft ms) and (forward
    tokens, verify ms) histories. The drafts of a step run batched, so its draft forwards are the
    longest of the batch (``drafted`` by this request, ``others_drafted`` by the rest)."""
    forwards = max(drafted, others_drafted)
    if forwards > 0:
        draft_costs = keep_last(draft_costs, (forwards, draft_ms), limit)
    if forward_tokens > 0:
        verify_costs = keep_last(verify_costs, (forward_tokens, verify_ms), limit)
    return draft_costs, verify_costs


def keep_last(items: tuple, item: Any, limit: int) -> tuple:
    """``items`` + ``item``, only the last ``limit`` of them."""
    return (*items, item)[-limit:] if limit > 0 else ()


class WindowRule(Protocol):
    window_max: int

    def start(self, request: SpecRequest) -> Any: ...

    def update(self, state: Any, outcome: WindowOutcome) -> Any: ...

    def decide(self, state: Any, batch_size: int, rng: random.Random) -> tuple[int, Any]: ...


class WindowPolicy:
    """Any window rule as the scheduler's ``Policy``.

    ``choose`` runs the rule's ``decide`` on the request's state; ``observe`` runs its ``update``
    with each request's part of the step, including the tokens the step emitted (read from the
    request as the scheduler left it, which is why the wrapper keeps the ``RequestState`` it last
    chose for) and the replica's verify costs measured over every request's steps (``costs``).
    States of finished or cancelled requests are dropped at the next ``observe``.
    """

    def __init__(self, rule: WindowRule, rng: random.Random | None = None):
        if rule.window_max < 0:
            raise ValueError(f"window_max must be >= 0, got {rule.window_max}")
        self.rule = rule
        self.rng = rng if rng is not None else random.Random()
        self.costs = VerifyCosts()
        self.states: dict[str, Any] = {}          # request id -> the rule's state (JSON-serialisable)
        self.carried = CarriedSums()               # what finished requests leave to new ones (carry.py)
        self._requests: dict[str, RequestState] = {}
        self._emitted_before: dict[str, int] = {}  # request id -> len(out) when its window was chosen

    @staticmethod
    def adapts(request: SpecRequest) -> bool:
        """Only unpinned chain requests with a draft are adapted; trees belong to tree policies."""
        return not request.pinned and request.draft != NO_DRAFT and request.tree is None

    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        if not self.adapts(state.request):
            return state.request.speculation
        current = self.states.get(state.id)
        if current is None:
            current = self.carried.start(self.rule, state.request)
        window, current = self.rule.decide(current, batch_size, self.rng)
        self.states[state.id] = current
        self._requests[state.id] = state
        self._emitted_before[state.id] = len(state.out)
        window = max(0, min(int(window), self.rule.window_max))
        return Speculation(window) if window > 0 else PLAIN

    def observe(self, record: StepRecord) -> None:
        # The context the step's requests read: what each had before the tokens this step emitted.
        # Requests this policy does not adapt (pinned, plain) are not tracked and count as none.
        context = sum(len(self._requests[s.request_id].request.prompt_ids) + self._emitted_before[s.request_id]
                      for s in record.requests if s.request_id in self._requests)
        self.costs.observe(record, context)
        table = self.costs.table(record.batch_size, context)
        for step in record.requests:
            request = self._requests.get(step.request_id)
            if request is None:
                continue
            emitted = request.out[self._emitted_before[step.request_id]:]
            outcome = WindowOutcome.of(record, step, emitted, table)
            self.states[step.request_id] = self.rule.update(self.states[step.request_id], outcome)
        for request_id in [i for i, request in self._requests.items() if request.done]:
            if request_id in self.states:
                self.carried.finish(self.rule, self._requests[request_id].request, self.states[request_id])
            self.drop(request_id)

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._requests.pop(request_id, None)
        self._emitted_before.pop(request_id, None)
