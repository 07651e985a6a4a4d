"""SAGE ("SAGE: Accelerating Vision-Language Models via Entropy-Guided Adaptive Speculative
Decoding"): the draft's entropy chooses the next tree's depth and width, and the acceptance
history moves the maximum depth, with hysteresis.

    P̃_i  = P_i / Σ_{j ≤ k} P_j  over the draft's top-k at the root          (Eq. 7)
    α     = 1 − H(P̃) / log k                                                 (Eq. 8, 9)
    D     = D_min + α (D_max − D_min)                                         (Eq. 10)
    W     = W_min + (1 − α)(W_max − W_min)                                    (Eq. 11)
    W_l   = W · (1/l) · (0.5 + P_parent)  for levels l >= 2                  (Eq. 12)
    keep a node iff its path probability > θ_l = 0.1 · l / D; stop at D levels or N_max nodes
    history: the mean accepted length of the last 10 steps below 2 lowers D_max by one, above 3
    raises it by one, in between leaves it (§3.3, "Adaptive History Tracking")

Confident drafts (low entropy) get deeper, narrower trees; uncertain ones (high entropy)
shallower, wider ones (§3.2). So on high entropy SAGE does not narrow the tree, it makes it
*shallower and wider*; what narrows there is each path, since θ_l prunes the improbable
continuations.

**Who does what.** The entropy of step t shapes the tree of step t + 1 (§3.2, "Temporal
Correlation Exploitation"; Algorithm 1 lines 15-18), so this rule is a pure function of the step
records: it reads the root's top probabilities the draft reported (``RequestStep.
draft_root_probs``), computes α, D and W, and asks ``TreeShape(D, W, N_max, width_decay=True,
threshold=0.1)``. The draft's tree builder (``replicas/drafts/tree_growth.py``) applies what can
only be done while drafting: Eq. 12's per-node width, θ_l and the node budget.

Where this deviates from the paper, and why:

- **First tree.** The paper starts from SpecVLM's static tree (App. A.1) with α = 0.5 (Alg. 1
  line 3); here the first step uses the tree the request asked for (the static baseline's tree,
  as in App. A.1), and α = 0.5 stands until a step reports the draft's root probabilities.
- **Node budget.** ``node_budget=None`` (the default) keeps the request's own budget, the N every
  other tree policy and the static tree get, so that a benchmark compares rules, not budgets; the
  paper's N_max = 64 (for 72B targets on H20 GPUs) is ``SageTree(node_budget=64)``.
- **Rounding.** D and W are rounded to the nearest integer (half up); the paper does not say.
- **Acceptance length.** The history thresholds (2 and 3) apply to n, the accepted draft tokens,
  the paper's τ of §2.2 ("advancing τ + 1 tokens per iteration"), not docs/design.md §3's τ = n + 1.
- **Hysteresis bounds.** The paper says D_max is reduced or increased, not by how much nor how
  far: here by one per step, within [D_min, ``depth_ceiling``] (12 by default, 1.5 × D_max), so
  that the draft's cost stays bounded. A step whose draft offered nothing teaches nothing.
- **Expansion order.** Breadth first, one level per draft forward (``tree_growth.py``), where the
  paper recurses; the trees are the same unless the budget runs out, and then this keeps the more
  probable nodes of the shallower levels.
- **Carried history.** The paper's D_max starts at its setting for every sequence. Here a request
  starts at the mean D_max that finished requests (of this replica and, through Redis, of the
  cluster) left (``carry.py``): the history's verdict on the draft outlives the request.
- **Drafts without a distribution** (prompt lookup) report no probabilities: α stays at its last
  value, the hysteresis still moves D_max, and the builder ignores the width decay and threshold.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.tree import TreeOutcome, clamp
from specserve.policies.window import JsonState, keep_last
from specserve.replicas.drafts.tree_growth import ROOT_TOP_PROBS
from specserve.replicas.request import SpecRequest
from specserve.replicas.step import TreeShape


def sage_confidence(probs: tuple[float, ...], k: int) -> float:
    """α = 1 − H(P̃) / log k over the top-k of ``probs`` renormalised (Eq. 7-9): 1 when all the
    mass is on one token, 0 when the top k are equally likely. Fewer than k probabilities (a
    vocabulary smaller than k) normalise by the log of their count."""
    top = sorted(probs, reverse=True)[:k]
    total = sum(top)
    if len(top) < 2 or total <= 0:
        return 1.0
    entropy = -sum(p / total * math.log(p / total) for p in top if p > 0)
    return min(1.0, max(0.0, 1.0 - entropy / math.log(len(top))))


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


@dataclass(frozen=True)
class SageState(JsonState):
    start_tree: tuple[int, int, int]   # the request's (depth, top_k, budget): the first step's tree
    max_depth: int                     # D_max as the acceptance history has moved it
    confidence: float = 0.5            # α (Eq. 9) of the last step that reported root probabilities
    accepted: tuple[int, ...] = ()     # n of the last ``history_steps`` steps that drafted
    steps: int = 0                     # steps observed


@dataclass(frozen=True)
class SageTree:
    depth_min: int = 3          # D_min (paper §5.1)
    depth_max: int = 8          # D_max, where the history's D_max starts
    width_min: int = 2          # W_min
    width_max: int = 10         # W_max
    entropy_top_k: int = 10     # k of Eq. 7
    node_budget: int | None = None   # N_max; None: the request's own budget (paper: 64)
    threshold: float = 0.1      # θ_l = threshold · l / D
    history_steps: int = 10     # the sliding window of accepted lengths
    history_low: float = 2.0    # mean n below this: D_max − 1
    history_high: float = 3.0   # mean n above this: D_max + 1
    depth_ceiling: int = 12     # D_max never rises above this (the paper gives no bound)

    name: ClassVar[str] = "sage"

    def __post_init__(self) -> None:
        if not 1 <= self.depth_min <= self.depth_max <= self.depth_ceiling:
            raise ValueError(f"need 1 <= depth_min <= depth_max <= depth_ceiling, got "
                             f"{self.depth_min}, {self.depth_max}, {self.depth_ceiling}")
        if not 1 <= self.width_min <= self.width_max:
            raise ValueError(f"need 1 <= width_min <= width_max, got {self.width_min}, {self.width_max}")
        if not 2 <= self.entropy_top_k <= ROOT_TOP_PROBS:
            raise ValueError(f"entropy_top_k must be in 2..{ROOT_TOP_PROBS} (the root probabilities a "
                             f"tree reports), got {self.entropy_top_k}")
        if self.history_low > self.history_high:
            raise ValueError(f"history_low {self.history_low} is above history_high {self.history_high}")

    def start(self, request: SpecRequest, carried: Mapping[str, float] | None = None) -> SageState:
        tree = request.tree
        max_depth = self.depth_max
        if carried and carried.get("sage_requests", 0.0) > 0:
            mean = carried.get("sage_max_depth", 0.0) / carried["sage_requests"]
            max_depth = clamp(round_half_up(mean), self.depth_min, self.depth_ceiling)
        return SageState(start_tree=(tree.depth, tree.top_k, tree.budget), max_depth=max_depth)

    def counts(self, state: SageState) -> dict[str, int]:
        """The D_max the request's history settled at, once it drafted."""
        return {"sage_requests": 1, "sage_max_depth": state.max_depth} if state.accepted else {}

    def update(self, state: SageState, outcome: TreeOutcome) -> SageState:
        confidence = state.confidence
        if outcome.root_probs:
            confidence = sage_confidence(outcome.root_probs, self.entropy_top_k)
        accepted, max_depth = state.accepted, state.max_depth
        if outcome.depth > 0:
            accepted = keep_last(accepted, outcome.accepted, self.history_steps)
            mean = sum(accepted) / len(accepted)
            if mean < self.history_low:
                max_depth -= 1
            elif mean > self.history_high:
                max_depth += 1
            max_depth = clamp(max_depth, self.depth_min, self.depth_ceiling)
        return replace(state, max_depth=max_depth, confidence=confidence, accepted=accepted, steps=state.steps + 1)

    def shape(self, state: SageState) -> TreeShape:
        """Eq. 10 and 11 at the state's α and D_max, for the builder to grow with Eq. 12 and θ_l."""
        alpha = state.confidence
        depth = round_half_up(self.depth_min + alpha * (state.max_depth - self.depth_min))
        width = round_half_up(self.width_min + (1.0 - alpha) * (self.width_max - self.width_min))
        budget = self.node_budget if self.node_budget is not None else state.start_tree[2]
        return TreeShape(depth, width, budget, width_decay=True, threshold=self.threshold)

    def decide(self, state: SageState, batch_size: int, rng: random.Random) -> tuple[TreeShape, SageState]:
        if state.steps == 0:   # App. A.1: the static tree first
            return TreeShape(*state.start_tree), state
        return self.shape(state), state
