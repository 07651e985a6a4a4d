"""Adaptive EAGLE-2 tree depth ("A Drop-in Solution for On-the-Fly Adaptation of Speculative
Decoding in Large Language Models", App. C.4): the online window optimisation of §4.1
(``online_window.py``) with the tree's depth as the window, top-k and node budget fixed.

App. C.4 gives no formula of its own: it applies "our method" (§4.1) to EAGLE-2 "by adaptively
changing the draft tree depth", "effectively changing the speculation window size", while it
"keeps the number of tokens selected from the draft tree the same as in EAGLE-2". So, per step:

    α̂      the paper's Eq. 2 over this request's last h tree steps, with γ = the depth the draft
            offered: Σn / (Σn + Σ1[n < d]), the per-level acceptance of the tree, capped at α_max
    a       draft ms per draft forward (a tree level is one forward), measured
    b(d)    verify ms of a forward feeding this request's 1 + nodes(d) tokens beside the others',
            measured (``online_window.verify_ms_at``); nodes(d) = min(N, d·k), what the builder
            (``drafts/tree_growth.py``) grows at depth d, top-k k and budget N
    G(d)    = E(d) / (d·a + b(d)),  E(d) = (1 − α̂^(d+1)) / (1 − α̂)                (Eq. 1)
    d       = argmax G over 0..depth_max (0: a plain step), the smallest d on ties

Where this deviates, the same as ``online_window.py`` and for the same reasons: the batch's
objective when the request shares the forward (Eq. 1 when alone); until α̂ and two forward sizes
are measured the request alternates its own depth with depth 1 (whose tree has the fewest
nodes, so that the two forwards differ in size); after ``explore_every`` plain
steps in a row it drafts a depth-1 tree to look at α̂ again. As in the online window rule, the
cluster's α for the draft and task bucket (``SpecRequest.prior_alpha``) counts as ``prior_steps``
pseudo-steps in α̂; and a request's first depth is the mean depth finished requests last chose
(this replica's and, through Redis, the cluster's: ``carry.py``), else the request's.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.goodput import expected_emitted
from specserve.policies.online_window import draft_ms_per_token, verify_ms_at
from specserve.policies.tree import TreeOutcome
from specserve.policies.window import JsonState, estimate_alpha, fit_verify_ms, keep_last, with_costs
from specserve.replicas.request import SpecRequest
from specserve.replicas.step import TreeShape


@dataclass(frozen=True)
class Eagle2DepthState(JsonState):
    start_depth: int                               # the first depth: carried, else the request's (bounded)
    depth: int                                     # the depth asked last (0: plain)
    top_k: int                                     # k, the request's, fixed
    budget: int                                    # N, the request's, fixed
    outcomes: tuple[tuple[int, int], ...] = ()     # (n, depth offered) of the last h steps that drafted
    draft_costs: tuple[tuple[int, float], ...] = ()    # (draft forwards, draft ms) per step
    verify_costs: tuple[tuple[int, float], ...] = ()   # (forward tokens, verify ms) per step
    others_tokens: int = 0                         # tokens the rest of the batch fed the last forward
    others_emitted: int = 0                        # tokens the rest of the batch emitted in the last step
    others_depth: int = 0                          # the deepest path the rest of the batch was offered
    plain_steps: int = 0                           # depth 0 chosen this many steps in a row
    prior_alpha: float | None = None               # the cluster's α for the draft and bucket


@dataclass(frozen=True)
class Eagle2DepthTree:
    depth_max: int = 8           # the largest depth considered (γ_max)
    history_steps: int = 6       # h; the paper's Table 10 found 5-7 about equally good
    cost_steps: int = 32         # steps the cost measurements look back over
    alpha_max: float = 0.95      # α̂ cap (Eq. 2): a run of full acceptances must not mean α = 1
    explore_every: int = 16      # plain steps in a row before a depth-1 tree re-measures α̂
    prior_steps: float = 3.0     # pseudo-steps the cluster's α counts as in α̂ (as online_window's)

    name: ClassVar[str] = "eagle2-depth"

    def __post_init__(self) -> None:
        if self.depth_max < 1:
            raise ValueError(f"depth_max must be >= 1, got {self.depth_max}")

    def start(self, request: SpecRequest, carried: Mapping[str, float] | None = None) -> Eagle2DepthState:
        tree = request.tree
        depth = tree.depth
        requests = (carried or {}).get("eagle2_requests", 0.0)
        if requests > 0:
            depth = max(1, round(carried.get("eagle2_depth", 0.0) / requests))
        depth = min(depth, self.depth_max)
        return Eagle2DepthState(start_depth=depth, depth=depth, top_k=tree.top_k, budget=tree.budget,
                                prior_alpha=request.prior_alpha)

    def counts(self, state: Eagle2DepthState) -> dict[str, int]:
        """The depth the request chose last, once it drafted (0 when it ended plain)."""
        return {"eagle2_requests": 1, "eagle2_depth": state.depth} if state.outcomes else {}

    def update(self, state: Eagle2DepthState, outcome: TreeOutcome) -> Eagle2DepthState:
        outcomes = state.outcomes
        if outcome.depth > 0:
            outcomes = keep_last(outcomes, (outcome.accepted, outcome.depth), self.history_steps)
        draft_costs, verify_costs = with_costs(state.draft_costs, state.verify_costs, outcome.depth,
                                               outcome.others_depth, outcome.draft_ms, outcome.forward_tokens,
                                               outcome.verify_ms, self.cost_steps)
        return replace(
            state, outcomes=outcomes, draft_costs=draft_costs, verify_costs=verify_costs,
            others_tokens=max(0, outcome.forward_tokens - 1 - outcome.nodes),
            others_emitted=outcome.others_emitted, others_depth=outcome.others_depth,
        )

    @staticmethod
    def nodes(state: Eagle2DepthState, depth: int) -> int:
        """Nodes a tree of ``depth`` levels holds: the builder keeps k per level, N in all."""
        return min(state.budget, depth * state.top_k)

    def objective(self, state: Eagle2DepthState, alpha: float, depth: int) -> float | None:
        """G(d) in emitted tokens per ms for the batch (Eq. 1 when the request is alone)."""
        verify_ms = verify_ms_at(state.verify_costs, state.others_tokens + 1 + self.nodes(state, depth))
        if verify_ms is None:
            return None
        draft_ms = draft_ms_per_token(state.draft_costs) * max(depth, state.others_depth)
        return (expected_emitted(alpha, depth) + state.others_emitted) / (draft_ms + verify_ms)

    def shape(self, state: Eagle2DepthState, depth: int) -> TreeShape | None:
        return TreeShape(depth, state.top_k, state.budget) if depth > 0 else None

    def decide(self, state: Eagle2DepthState, batch_size: int,
               rng: random.Random) -> tuple[TreeShape | None, Eagle2DepthState]:
        prior = None if state.prior_alpha is None else (state.prior_alpha, self.prior_steps)
        alpha = estimate_alpha(state.outcomes, self.alpha_max, prior) if state.outcomes else None
        if alpha is None or fit_verify_ms(state.verify_costs) is None:
            # Unmeasured: alternate two depths so that the first cost fit has two forward sizes.
            # Depth 1 holds the fewest nodes (min(N, k)), so the two sizes differ unless N <= k.
            other = 1 if state.start_depth > 1 else min(2, self.depth_max)
            depth = state.start_depth if len(state.verify_costs) % 2 == 0 else other
            return self.shape(state, depth), replace(state, depth=depth, plain_steps=0)
        gains = [self.objective(state, alpha, d) for d in range(self.depth_max + 1)]
        depth = max(range(len(gains)), key=lambda d: (gains[d], -d))
        if depth == 0:
            if state.plain_steps + 1 >= self.explore_every:
                return self.shape(state, 1), replace(state, depth=1, plain_steps=0)
            return None, replace(state, depth=0, plain_steps=state.plain_steps + 1)
        return self.shape(state, depth), replace(state, depth=depth, plain_steps=0)
