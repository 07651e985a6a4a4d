"""Hugging Face assisted generation's window heuristic, a baseline
(``transformers.generation.candidate_generator``, ``num_assistant_tokens_schedule="heuristic"``):

    every offered draft token accepted  ->  γ + 2
    otherwise                           ->  max(1, γ − 1)

Transformers compares the accepted count with the candidates actually offered, as this does
(``RequestStep.max_depth``). Where this deviates: transformers has no upper bound and starts at
``num_assistant_tokens = 20``; here γ saturates at ``window_max`` (so that a rejection after a
long run costs one step, not many) and starts at the request's own window. A step whose draft
offered nothing leaves γ as it was (transformers always gets candidates from its assistant).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from specserve.policies.window import JsonState, WindowOutcome
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class HFState(JsonState):
    window: int


@dataclass(frozen=True)
class HFWindow:
    window_max: int = 8

    name: ClassVar[str] = "hf-heuristic"

    def start(self, request: SpecRequest) -> HFState:
        return HFState(max(1, min(request.window, self.window_max)))

    def update(self, state: HFState, outcome: WindowOutcome) -> HFState:
        if outcome.window == 0:
            return state
        window = state.window + 2 if outcome.fully_accepted else state.window - 1
        return HFState(max(1, min(self.window_max, window)))

    def decide(self, state: HFState, batch_size: int, rng: random.Random) -> tuple[int, HFState]:
        return state.window, state
