"""ADT-Tree ("Fast Inference of Visual Autoregressive Model with Adjacency-Adaptive Dynamical
Draft Trees", §IV): each tree starts from the previous step's depth and top-k ("Horizontal
Repeat", §IV-A: in text the left neighbour is the previous step) and moves by the bisectional
rule on the previous tree's acceptance rate α = τ / d̂ (§III-B):

    α >= β:  d̂ = d̃ + l_d,  k̂ = k̃ − l_k      (a deeper, narrower tree)
    α <  β:  d̂ = d̃ − l_d,  k̂ = k̃ + l_k      (a shallower, wider tree)             (Eq. 2)

within d_min < d̂ < d_max and k_min < k̂ < k_max. Defaults are the paper's for Anole (§V-A):
β = 1, l_d = 1, l_k = 3, depth in (0, 10), top-k in (3, 14); the bounds are stored inclusive
(depth 1..9, top-k 4..13), the same open intervals. The node budget (EAGLE-2's N, which ADT-Tree
does not adapt) stays the request's.

Where this deviates from the paper, or reads it, and why:

- **τ and d̂.** τ is n, the accepted draft tokens, and d̂ the depth the draft actually offered
  (``RequestStep.max_depth``): with β = 1, "positive" then means every level was used ("all
  tokens in each layer of the draft tree are fully utilized", §IV-B). A tree cut short (node
  budget, the request's last tokens) is judged by what it offered, as the FSM window does; a step
  whose draft offered nothing teaches nothing.
- **Top-k at depth 1.** The paper "only restricts the top-k when d̃ ± l_d > 1", because a tree
  of one level costs k̂ (Eq. 5), not k̂²: at depth 1 the top-k may pass k_max, up to the node
  budget (a one-level tree cannot use more children than nodes), which also keeps the state
  bounded. Back at depth 2 the bound applies again at once.
- **Initialisation.** Vertical Repeat and Random Initialization (§IV-A) are for 2-D image grids;
  text has only the previous step. The first tree is where finished requests' walks ended (the
  mean depth and top-k, of this replica's and, through Redis, the cluster's: ``carry.py``), else
  the request's, brought within the bounds.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.tree import TreeOutcome, clamp
from specserve.policies.window import JsonState
from specserve.replicas.request import SpecRequest
from specserve.replicas.step import TreeShape


@dataclass(frozen=True)
class ADTState(JsonState):
    depth: int       # d̃ for the next update: the depth last asked
    top_k: int       # k̃
    budget: int      # the request's node budget (not adapted)
    steps: int = 0   # updates from steps whose draft offered a tree


@dataclass(frozen=True)
class ADTTree:
    beta: float = 1.0         # β, the positive threshold on α = n / d̂
    depth_step: int = 1       # l_d
    top_k_step: int = 3       # l_k
    depth_min: int = 1        # the paper's (0, 10), inclusive
    depth_max: int = 9
    top_k_min: int = 4        # the paper's (3, 14), inclusive
    top_k_max: int = 13

    name: ClassVar[str] = "adt-tree"

    def __post_init__(self) -> None:
        if not 1 <= self.depth_min <= self.depth_max:
            raise ValueError(f"need 1 <= depth_min <= depth_max, got {self.depth_min}, {self.depth_max}")
        if not 1 <= self.top_k_min <= self.top_k_max:
            raise ValueError(f"need 1 <= top_k_min <= top_k_max, got {self.top_k_min}, {self.top_k_max}")
        if self.depth_step < 0 or self.top_k_step < 0:
            raise ValueError(f"steps must be >= 0, got l_d={self.depth_step}, l_k={self.top_k_step}")

    def bounded(self, depth: int, top_k: int, budget: int) -> ADTState:
        depth = clamp(depth, self.depth_min, self.depth_max)
        top_k_max = self.top_k_max if depth > 1 else max(self.top_k_max, budget)
        return ADTState(depth, clamp(top_k, self.top_k_min, top_k_max), budget)

    def start(self, request: SpecRequest, carried: Mapping[str, float] | None = None) -> ADTState:
        tree = request.tree
        requests = (carried or {}).get("adt_requests", 0.0)
        if requests > 0:
            depth, top_k = (round(carried.get(name, 0.0) / requests) for name in ("adt_depth", "adt_top_k"))
            return self.bounded(depth, top_k, tree.budget)
        return self.bounded(tree.depth, tree.top_k, tree.budget)

    def counts(self, state: ADTState) -> dict[str, int]:
        """Where the request's walk ended: the depth and top-k it would have asked next."""
        return {"adt_requests": 1, "adt_depth": state.depth, "adt_top_k": state.top_k} if state.steps else {}

    def update(self, state: ADTState, outcome: TreeOutcome) -> ADTState:
        if outcome.depth == 0:
            return state
        alpha = outcome.accepted / outcome.depth
        sign = 1 if alpha >= self.beta else -1
        moved = self.bounded(state.depth + sign * self.depth_step, state.top_k - sign * self.top_k_step, state.budget)
        return replace(moved, steps=state.steps + 1)

    def decide(self, state: ADTState, batch_size: int, rng: random.Random) -> tuple[TreeShape, ADTState]:
        return TreeShape(state.depth, state.top_k, state.budget), state
