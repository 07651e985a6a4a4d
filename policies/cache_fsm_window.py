"""Cache-enabled finite-state-machine window ("A Drop-in Solution for On-the-Fly Adaptation of
Speculative Decoding in Large Language Models", §4.2): the window follows whether the tokens the
target confirms were seen before, in the prompt or earlier in the answer (answers often restate
their context: QA, code completion).

    cache   the prompt's tokens; after every step, the step's new tokens (accepted and bonus)
    step    +1 if one of the step's accepted draft tokens is already in the cache
            +1 more if every offered draft token was accepted
            −1 if none of the accepted tokens is in the cache (also when none was accepted)
            then saturate in [window_min, window_max]

The cache is checked before this step's tokens join it.

Where this deviates from, or settles what is open in, the paper:

- "if a validated token is already in the cache" is read as *at least one* accepted draft token;
  the bonus token is validated too but was not proposed, so it only joins the cache.
- A fully accepted window none of whose tokens was cached gets −1 + 1 = 0: the paper gives both
  rules and no precedence, and summing them never shrinks γ on a full acceptance.
- The floor and the steps where the draft offered nothing follow ``fsm_window.py``: ``window_min``
  is 1 by default, and such a step leaves γ as it was (its tokens still join the cache).
- The cache is a sorted tuple of distinct token ids in the state, so it serialises to JSON; it
  grows with the prompt and answer (at most the vocabulary).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import ClassVar

from specserve.policies.fsm_window import fsm_step
from specserve.policies.window import JsonState, WindowOutcome
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class CacheFSMState(JsonState):
    window: int
    cache: tuple[int, ...]       # distinct token ids, sorted


def cached(cache: tuple[int, ...], token: int) -> bool:
    i = bisect.bisect_left(cache, token)
    return i < len(cache) and cache[i] == token


def with_tokens(cache: tuple[int, ...], tokens: tuple[int, ...]) -> tuple[int, ...]:
    new = {t for t in tokens if not cached(cache, t)}
    return tuple(sorted((*cache, *new))) if new else cache


@dataclass(frozen=True)
class CacheFSMWindow:
    window_max: int = 8
    window_min: int = 1

    name: ClassVar[str] = "cache-fsm"

    def __post_init__(self) -> None:
        if not 0 <= self.window_min <= self.window_max:
            raise ValueError(f"need 0 <= window_min <= window_max, got {self.window_min} and {self.window_max}")

    def start(self, request: SpecRequest) -> CacheFSMState:
        return CacheFSMState(max(self.window_min, min(request.window, self.window_max)),
                             tuple(sorted(set(request.prompt_ids))))

    def update(self, state: CacheFSMState, outcome: WindowOutcome) -> CacheFSMState:
        cache = with_tokens(state.cache, outcome.emitted_tokens)
        if outcome.window == 0:
            return CacheFSMState(fsm_step(state.window, outcome, self.window_min, self.window_max), cache)
        accepted = outcome.emitted_tokens[:outcome.accepted]
        hit = any(cached(state.cache, t) for t in accepted)
        step = (1 if hit else -1) + (1 if outcome.fully_accepted else 0)
        return CacheFSMState(max(self.window_min, min(self.window_max, state.window + step)), cache)

    def decide(self, state: CacheFSMState, batch_size: int, rng: random.Random) -> tuple[int, CacheFSMState]:
        return state.window, state
