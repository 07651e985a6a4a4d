"""Online window optimisation ("A Drop-in Solution for On-the-Fly Adaptation of Speculative
Decoding in Large Language Models", §4.1, App. B): each step, the window that maximises the
expected emitted tokens per unit time under the costs and acceptance measured so far.

    α̂       the paper's Eq. 2 over this request's last h drafting steps, capped at α_max
    a        draft ms per draft token: Σ draft_ms / Σ draft forwards over recent steps
             (a step's draft forwards = the longest window of its batch: drafts run batched)
    b(γ)     verify ms of a forward that feeds this request's 1 + γ tokens beside the others':
             the replica's measured table at this batch size and context bucket (the median
             verify ms per forward size over every request's recent steps, ``verify_costs.py``),
             interpolated between
             sizes and extended beyond them with its least-squares slope, plus this request's
             level (the median of its last steps' excess over the table: long contexts cost
             more at every size). Until the replica has measured two sizes, the request's own
             steps: the mean per size, interpolated, extended with their slope. Never assumed
             flat: even at batch 1 a wider forward costs more.
    G(γ)     = E(γ) / (γ·a + b(γ)),  E(γ) = (1 − α̂^(γ+1)) / (1 − α̂)        (Eq. 1)
    γ        = argmax G over 0..window_max, the smallest γ on ties

Where this deviates from the paper, and why:

- **Batching.** The paper verifies one request per forward. Here a request shares the forward
  with the others of its batch, so the objective is the batch's tokens per ms,
  ``G(γ) = (E(γ) + E_others) / (a·max(γ, γ_others) + b(T_others + 1 + γ))``, with the others'
  emitted tokens, longest window and forward tokens taken from the last step. Alone
  (T_others = 0, E_others = 0) this is exactly Eq. 1.
- **Costs pooled over the replica.** The paper measures a and b "by observing the most recent
  steps". One request's steps are too few and too noisy for b (a step varies by more than the
  windows that matter differ by), so b comes from the replica's table (``verify_costs.py``), which
  prices windows closer to the per-request oracle's (figures: docs/benchmarks.md §4.1).
- **Before measurement.** Until α̂ and two forward sizes are measured the request alternates its
  own window with a second size (half of it, or 2 when it asked for 1), so that the first fit
  comes from steps that differ.
- **Leaving γ = 0.** At γ = 0 nothing is drafted and α̂ can never change again; after
  ``explore_every`` plain steps in a row the request drafts one token to look again.
- **Estimator.** Eq. 2 is the paper's own approximation of the MLE of App. B.2; we use Eq. 2.
- **A prior in α̂.** Eq. 2 alone says α̂ = 0 after a few rejected steps in a row, the rule then
  decodes plainly until it looks again, and with prompt lookup that happens in most requests: its
  matches come and go, and three misses say little about the next match. So α̂ counts a prior as
  ``prior_steps`` pseudo-steps, which brings the rule closer to the per-request oracle
  (docs/benchmarks.md §4.1): the cluster's α for the request's draft and task bucket when it came
  with one (``SpecRequest.prior_alpha``, from the policy service's snapshot), else
  ``default_alpha``. With 0.5 over 3 pseudo-steps α̂ stays above 1.5 / 9 = 0.17 over h = 6
  rejected steps, so γ = 0 still wins where drafting costs (a model draft, a busy batch) more than
  that gains.
  ``default_alpha=None`` is the paper's cold estimator.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.goodput import expected_emitted
from specserve.policies.window import JsonState, WindowOutcome, estimate_alpha, fit_verify_ms, keep_last, with_costs
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class OnlineState(JsonState):
    start_window: int                              # the window the request came with (bounded)
    window: int                                    # the window asked last
    outcomes: tuple[tuple[int, int], ...] = ()     # (n, γ) of the last h steps that drafted
    draft_costs: tuple[tuple[int, float], ...] = ()    # (draft forwards, draft ms) per step
    verify_costs: tuple[tuple[int, float], ...] = ()   # (forward tokens, verify ms) per step
    others_tokens: int = 0                         # tokens the rest of the batch fed the last forward
    others_emitted: int = 0                        # tokens the rest of the batch emitted in the last step
    others_window: int = 0                         # the longest window the rest of the batch was offered
    plain_steps: int = 0                           # γ = 0 chosen this many steps in a row
    verify_table: tuple[tuple[int, float], ...] = ()   # the replica's (forward tokens, verify ms), last step's
    verify_excess: tuple[float, ...] = ()          # this request's verify ms over that table, per step
    prior_alpha: float | None = None               # α̂'s prior: the cluster's α for this draft and bucket, else the default


def verify_ms_at(costs: tuple[tuple[int, float], ...], tokens: int) -> float | None:
    """b at ``tokens`` forward tokens from measured (tokens, ms) pairs; None before two sizes."""
    curve = verify_curve(costs)
    return None if curve is None else curve(tokens)


def verify_curve(costs: tuple[tuple[int, float], ...]) -> Callable[[int], float] | None:
    """b as a function of forward tokens from measured (tokens, ms) pairs: the mean at each size,
    interpolated between sizes, extended beyond them with the least-squares slope; None before
    two sizes. Fitted once, so that pricing every window of a step costs one fit."""
    fit = fit_verify_ms(costs)
    if fit is None:
        return None
    slope = fit[1]
    sums: dict[int, list[float]] = {}
    for t, ms in costs:
        sums.setdefault(t, []).append(ms)
    sizes = sorted(sums)
    means = [sum(sums[t]) / len(sums[t]) for t in sizes]

    def at(tokens: int) -> float:
        if tokens <= sizes[0]:
            return max(1e-3, means[0] - slope * (sizes[0] - tokens))
        if tokens >= sizes[-1]:
            return means[-1] + slope * (tokens - sizes[-1])
        i = bisect.bisect_left(sizes, tokens)
        if sizes[i] == tokens:
            return means[i]
        w = (tokens - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return (1 - w) * means[i - 1] + w * means[i]
    return at


def draft_ms_per_token(costs: tuple[tuple[int, float], ...]) -> float:
    """a: draft ms per draft forward (0 before any drafting, and for model-free drafts)."""
    forwards = sum(f for f, _ in costs)
    return sum(ms for _, ms in costs) / forwards if forwards else 0.0


@dataclass(frozen=True)
class OnlineWindow:
    window_max: int = 8          # γ_max
    history_steps: int = 6       # h; the paper's Table 10 found 5-7 about equally good
    cost_steps: int = 32         # steps the cost measurements look back over
    alpha_max: float = 0.95      # α̂ cap (Eq. 2): a run of full acceptances must not mean α = 1
    explore_every: int = 16      # plain steps in a row before one token is drafted to re-measure α
    level_steps: int = 8         # steps of this request whose excess over the replica's table set its level
    default_alpha: float | None = 0.5   # α̂'s prior when the request brings no cluster prior (None: Eq. 2 alone)
    prior_steps: float = 3.0     # pseudo-steps a prior counts as in α̂ (h / 2 at the default h)

    name: ClassVar[str] = "online"

    def start(self, request: SpecRequest) -> OnlineState:
        window = min(request.window, self.window_max)
        prior = self.default_alpha if request.prior_alpha is None else request.prior_alpha
        return OnlineState(start_window=window, window=window, prior_alpha=prior)

    def update(self, state: OnlineState, outcome: WindowOutcome) -> OnlineState:
        outcomes = state.outcomes
        if outcome.window > 0:
            outcomes = keep_last(outcomes, (outcome.accepted, outcome.window), self.history_steps)
        draft_costs, verify_costs = with_costs(state.draft_costs, state.verify_costs, outcome.window,
                                               outcome.others_window, outcome.draft_ms, outcome.forward_tokens,
                                               outcome.verify_ms, self.cost_steps)
        excess = state.verify_excess
        table_ms = verify_ms_at(outcome.verify_table, outcome.forward_tokens)   # one median per size
        if table_ms is not None and outcome.forward_tokens > 0:
            excess = keep_last(excess, round(outcome.verify_ms - table_ms, 4), self.level_steps)
        return replace(
            state, outcomes=outcomes, draft_costs=draft_costs, verify_costs=verify_costs,
            others_tokens=max(0, outcome.forward_tokens - 1 - outcome.window),
            others_emitted=outcome.others_emitted, others_window=outcome.others_window,
            verify_table=outcome.verify_table, verify_excess=excess,
        )

    def verify_curve(self, state: OnlineState) -> Callable[[int], float] | None:
        """b by forward tokens: the replica's table plus this request's level, else the request's
        own measurements; None before either has two sizes."""
        table = verify_curve(state.verify_table)
        if table is None:
            return verify_curve(state.verify_costs)
        level = statistics.median(state.verify_excess) if state.verify_excess else 0.0
        return lambda tokens: max(1e-3, table(tokens) + level)

    def verify_ms(self, state: OnlineState, tokens: int) -> float | None:
        curve = self.verify_curve(state)
        return None if curve is None else curve(tokens)

    def objective(self, state: OnlineState, alpha: float, window: int,
                  curve: Callable[[int], float] | None = None, a: float | None = None) -> float | None:
        """G(γ) in emitted tokens per ms for the batch (Eq. 1 when the request is alone);
        ``curve`` (``verify_curve(state)``) and ``a`` when the caller prices several windows."""
        curve = curve or self.verify_curve(state)
        if curve is None:
            return None
        a = draft_ms_per_token(state.draft_costs) if a is None else a
        draft_ms = a * max(window, state.others_window)
        return (expected_emitted(alpha, window) + state.others_emitted) / (draft_ms + curve(state.others_tokens + 1 + window))

    def decide(self, state: OnlineState, batch_size: int, rng: random.Random) -> tuple[int, OnlineState]:
        # The prior counts as prior_steps pseudo-steps (window.estimate_alpha; not in the paper).
        prior = None if state.prior_alpha is None else (state.prior_alpha, self.prior_steps)
        alpha = estimate_alpha(state.outcomes, self.alpha_max, prior)
        curve = self.verify_curve(state)
        if not state.outcomes or curve is None:
            # Unmeasured: alternate two sizes so that the first cost fit has two points.
            other = state.start_window // 2 if state.start_window > 1 else min(2, self.window_max)
            window = state.start_window if len(state.verify_costs) % 2 == 0 else other
            return window, replace(state, window=window, plain_steps=0)
        a = draft_ms_per_token(state.draft_costs)
        gains = [self.objective(state, alpha, g, curve, a) for g in range(self.window_max + 1)]
        window = max(range(len(gains)), key=lambda g: (gains[g], -g))
        if window == 0:
            if state.plain_steps + 1 >= self.explore_every and self.window_max > 0:
                return 1, replace(state, window=1, plain_steps=0)
            return 0, replace(state, window=0, plain_steps=state.plain_steps + 1)
        return window, replace(state, window=window, plain_steps=0)
