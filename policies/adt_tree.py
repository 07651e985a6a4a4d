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
- **Initialisation** (§IV-A). On an image grid (a request with ``grid`` tokens per row, an
  image generator's) the tree of the step whose first token is s(i, j) starts from: its left
  neighbour's, Horizontal Repeat (the default, the paper's choice) — the previous step's tree,
  already moved by Eq. 2; its upper neighbour's, Vertical Repeat (the tree whose step covered
  s(i - 1, j); on the first row the previous step's); or a uniform draw within the bounds, Random
  Initialization. The previous tree's status (α against β) then moves the start by Eq. 2, as
  the paper's adaptation follows its initialisation. A step that emits several tokens covers
  several grid positions: each records that step's tree. Text has only the previous step
  (Horizontal Repeat). The first tree is where finished requests' walks ended (the mean depth
  and top-k, of this replica's and, through Redis, the cluster's: ``carry.py``), else the
  request's, brought within the bounds.
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


# Adjacent Initialization's strategies (§IV-A).
HORIZONTAL, VERTICAL, RANDOM = "horizontal", "vertical", "random"


@dataclass(frozen=True)
class ADTState(JsonState):
    depth: int       # d̃ for the next update: the depth last asked
    top_k: int       # k̃
    budget: int      # the request's node budget (not adapted)
    steps: int = 0   # updates from steps whose draft offered a tree
    grid: int = 0    # tokens per row of the request's image grid; 0: text
    position: int = 0   # grid: the raster index of the next token to predict
    # grid: per column, the (depth, top-k) of the tree whose step last covered it (the row above's)
    covered: tuple[tuple[int, int], ...] = ()
    status: int = 0  # grid: the previous tree's, +1 positive (α >= β), -1 negative, 0 none yet


@dataclass(frozen=True)
class ADTTree:
    beta: float = 1.0         # β, the positive threshold on α = n / d̂
    depth_step: int = 1       # l_d
    top_k_step: int = 3       # l_k
    depth_min: int = 1        # the paper's (0, 10), inclusive
    depth_max: int = 9
    top_k_min: int = 4        # the paper's (3, 14), inclusive
    top_k_max: int = 13
    init: str = HORIZONTAL    # Adjacent Initialization on an image grid (§IV-A)

    name: ClassVar[str] = "adt-tree"

    def __post_init__(self) -> None:
        if self.init not in (HORIZONTAL, VERTICAL, RANDOM):
            raise ValueError(f"init must be {HORIZONTAL}, {VERTICAL} or {RANDOM}, got {self.init!r}")
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
            state = self.bounded(depth, top_k, tree.budget)
        else:
            state = self.bounded(tree.depth, tree.top_k, tree.budget)
        # A continuation's picture is under way: its next token is where its earlier output ended.
        return replace(state, grid=request.grid, position=request.resumed_tokens) if request.grid else state

    def counts(self, state: ADTState) -> dict[str, int]:
        """Where the request's walk ended: the depth and top-k it would have asked next."""
        return {"adt_requests": 1, "adt_depth": state.depth, "adt_top_k": state.top_k} if state.steps else {}

    def update(self, state: ADTState, outcome: TreeOutcome) -> ADTState:
        if state.grid:   # the positions this step's tokens (n + 1) covered record its tree
            covered = list(state.covered) or [(state.depth, state.top_k)] * state.grid
            for position in range(state.position, state.position + outcome.accepted + 1):
                covered[position % state.grid] = (state.depth, state.top_k)
            state = replace(state, position=state.position + outcome.accepted + 1, covered=tuple(covered))
        if outcome.depth == 0:
            return state
        alpha = outcome.accepted / outcome.depth
        sign = 1 if alpha >= self.beta else -1
        moved = self.bounded(state.depth + sign * self.depth_step, state.top_k - sign * self.top_k_step, state.budget)
        return replace(state, depth=moved.depth, top_k=moved.top_k, steps=state.steps + 1,
                       status=sign if state.grid else 0)

    def decide(self, state: ADTState, batch_size: int, rng: random.Random) -> tuple[TreeShape, ADTState]:
        start = self._adjacent(state, rng)
        if start is not None:   # the neighbour's tree (or a draw), moved by the previous tree's status
            sign = state.status
            moved = self.bounded(start[0] + sign * self.depth_step, start[1] - sign * self.top_k_step, state.budget)
            state = replace(state, depth=moved.depth, top_k=moved.top_k)
        return TreeShape(state.depth, state.top_k, state.budget), state

    def _adjacent(self, state: ADTState, rng: random.Random) -> tuple[int, int] | None:
        """Vertical Repeat's or Random Initialization's start for the next tree; None: the
        previous step's tree, already moved (Horizontal Repeat, text, the first row)."""
        if not state.grid or self.init == HORIZONTAL:
            return None
        if self.init == RANDOM:
            return rng.randint(self.depth_min, self.depth_max), rng.randint(self.top_k_min, self.top_k_max)
        row, column = divmod(state.position, state.grid)
        return state.covered[column] if row > 0 and state.covered else None
