"""What a step costs, measured on this replica, priced for the router's objective.

The objective of "A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in Large
Language Models" (Eq. 1) per draft d at window γ, for one request in a batch of B:

    G_d(γ) = E(α_d, γ) / (γ·a_d + b(γ))        tokens per ms
    E(α, γ) = (1 − α^(γ+1)) / (1 − α)           emitted tokens per step (bonus included)
    a_d      the draft's ms per drafted position (its batched forward), measured per draft
    b(γ)     the verify forward: c0 + c1 · B·(1 + γ) ms, least squares over recent steps of
             the same load bucket (``stats.load_bucket``: b1, b4, b8, b8+), else over all
             (the batch's other requests are priced at the same window)

and the plain candidate (no speculation) emits one token per ``c0 + c1·B`` ms. The router takes
each draft at its best γ (``best``), as the per-step window policy will then adapt it.

Prediction is never priced with a placeholder. The replica measures the verify forward and each
of its in-replica drafts before it serves (``replicas/cost_probe.py``, through ``seed_verify`` and
``seed``); the cluster's snapshot may seed a draft's cost too. A draft whose cost is still unknown
(a separate deployment with no probe that no request has drafted with here) is priced at 0
tokens/s by ``best``, so prediction alone never chooses it. Exploration may try it, priced at
``stand_in_ms``: the dearest known draft's cost, pessimistic, so that the exploration bonus must
pay for the worst cost seen (priced at 0 ms, an unknown draft would win every first decision);
the steps it drafts then measure its own.

Why a line per load bucket (``policies/load_lines.py``): one line through every batch size (and
the start-up probe's batch-1 points) prices a busy step's speculation at the batch-1 slope, too
cheap, so the router keeps choosing drafts where plain decoding is faster (docs/benchmarks.md
§2.2).
"""

from __future__ import annotations

from collections import deque

from specserve.policies.goodput import expected_emitted
from specserve.policies.load_lines import LoadLines
from specserve.replicas.step import StepRecord


class StepCosts:
    def __init__(self, history_steps: int = 128, window_max: int = 8):
        self.window_max = window_max
        self._verify = LoadLines(history_steps)   # verify ms by forward tokens, per load bucket
        self._draft: dict[str, deque[float]] = {}                              # draft -> ms per drafted position
        self._seeded: dict[str, float] = {}
        self._history = history_steps

    def seed(self, draft: str, ms_per_position: float) -> None:
        """A draft's cost from elsewhere (the start-up probe, the cluster's priors) until this
        replica's steps measure it."""
        self._seeded[draft] = max(0.0, float(ms_per_position))

    def seed_verify(self, points, batch_size: int = 1) -> None:
        """(forward tokens, ms) of verify forwards of ``batch_size`` requests measured before
        serving (the start-up probe: alone, and loaded); real steps push them out of the history."""
        for tokens, ms in points:
            self._verify.add(batch_size, tokens, ms)

    def observe(self, record: StepRecord) -> None:
        if record.batch_size:
            self._verify.add(record.batch_size, record.forward_tokens, record.verify_ms)
        for draft, ms in record.draft_ms_by:
            # A draft's requests are drafted in one batched forward per position: the step costs
            # the deepest proposal's positions.
            positions = max((s.max_depth for s in record.requests if s.draft == draft), default=0)
            if positions > 0:
                self._draft.setdefault(draft, deque(maxlen=self._history)).append(ms / positions)

    def draft_ms(self, draft: str) -> float | None:
        """ms per drafted position (the median of recent steps: robust to a slow one); None while
        unknown."""
        measured = self._draft.get(draft)
        if measured:
            ordered = sorted(measured)
            return ordered[len(ordered) // 2]
        return self._seeded.get(draft)

    def verify_model(self, batch_size: int | None = None) -> tuple[float, float]:
        """(c0, c1) of verify ms ≈ c0 + c1·tokens at ``batch_size``'s load bucket (when its steps
        span two sizes), else over all recent steps; flat (1 ms, 0) until measured (only an
        in-process engine without the start-up probe), which scales every candidate alike."""
        return self._verify.line(batch_size) or (1.0, 0.0)

    def step_ms(self, draft_ms: float, window: int, batch_size: int) -> float:
        c0, c1 = self.verify_model(batch_size)
        return window * draft_ms + c0 + c1 * max(1, batch_size) * (1 + window)

    def stand_in_ms(self) -> float | None:
        """What exploration prices a draft of unknown cost at: the dearest known draft's ms per
        drafted position; None while no draft is priced (nothing to bound the guess by)."""
        known = [ms for ms in map(self.draft_ms, {*self._draft, *self._seeded}) if ms is not None]
        return max(known, default=None)

    def best(self, alpha: float, draft: str, batch_size: int, unknown_ms: float | None = None) -> tuple[float, int]:
        """(tokens per second, γ) of ``draft`` at its best window for per-token acceptance α.
        While its cost is unknown it is priced at ``unknown_ms`` (exploration's ``stand_in_ms``),
        or without one is (0, 0): no candidate."""
        a = self.draft_ms(draft)
        if a is None:
            a = unknown_ms
        if a is None:
            return 0.0, 0
        rates = [(1e3 * expected_emitted(alpha, g) / self.step_ms(a, g, batch_size), g)
                 for g in range(1, self.window_max + 1)]
        return max(rates, key=lambda r: (r[0], -r[1]))

    def plain(self, batch_size: int) -> float:
        """Tokens per second of plain decoding."""
        return 1e3 / self.step_ms(0.0, 0, batch_size)
