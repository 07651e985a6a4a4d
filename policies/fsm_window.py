"""Finite-state-machine window ("A Drop-in Solution for On-the-Fly Adaptation of Speculative
Decoding in Large Language Models", §4.2): a saturating counter, as in branch prediction.

    all γ draft tokens accepted   ->  γ + 1      (saturates at window_max, the paper's γ_max)
    a draft token rejected        ->  γ − 1      (saturates at window_min)

Where this deviates from the paper, and why:

- **The floor.** The paper lets γ fall to 0 ("potentially even at 0") but never says how it
  leaves: at γ = 0 nothing is drafted, so nothing can be accepted or rejected. ``window_min``
  defaults to 1; with ``window_min = 0`` a plain step counts as a fully accepted empty window,
  so the counter climbs back to 1 on the next step and looks again.
- **What "all accepted" means.** It is judged against the window the draft actually offered
  (``RequestStep.max_depth``): a draft that offered fewer tokens than asked (prompt lookup with a
  short match, the scheduler's cap near ``max_tokens``) and had all of them accepted counts as a
  full acceptance. A step in which the draft offered nothing although a window was asked (no
  match, a dropped proposal) teaches nothing and leaves γ as it was.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from specserve.policies.window import JsonState, WindowOutcome
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class FSMState(JsonState):
    window: int


def fsm_step(window: int, outcome: WindowOutcome, window_min: int, window_max: int) -> int:
    """The counter's next value; the pure core that the cache-enabled machine builds on too."""
    if outcome.window == 0:
        vacuous = outcome.asked == 0 and window == 0   # γ = 0 was asked: an empty, fully accepted window
        return min(window_max, window + 1) if vacuous else window
    step = 1 if outcome.fully_accepted else -1
    return max(window_min, min(window_max, window + step))


@dataclass(frozen=True)
class FSMWindow:
    window_max: int = 8     # γ_max: the paper's chosen γ becomes the upper bound
    window_min: int = 1     # see the module docstring: 0 is allowed, 1 by default

    name: ClassVar[str] = "fsm"

    def __post_init__(self) -> None:
        if not 0 <= self.window_min <= self.window_max:
            raise ValueError(f"need 0 <= window_min <= window_max, got {self.window_min} and {self.window_max}")

    def start(self, request: SpecRequest) -> FSMState:
        return FSMState(max(self.window_min, min(request.window, self.window_max)))

    def update(self, state: FSMState, outcome: WindowOutcome) -> FSMState:
        return FSMState(fsm_step(state.window, outcome, self.window_min, self.window_max))

    def decide(self, state: FSMState, batch_size: int, rng: random.Random) -> tuple[int, FSMState]:
        return state.window, state
