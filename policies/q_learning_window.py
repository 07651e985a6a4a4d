"""Q-learning window ("A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in
Large Language Models", §4.2, Algorithm 2 of App. B.4): an agent whose state is the previous
window and whose action is the next one, trained online after every verified step.

    state s     the window of the step before (0..window_max)
    action a    the window of the step (0..window_max): Algorithm 2's ``y = GetAction(Agent, y)``
    reward r    the step's emitted tokens per second, (n + 1) / (draft_ms + verify_ms)
    update      Q[s][a] += lr · (r + discount · max_a' Q[a][a'] − Q[s][a])      (s' = a)
    policy      ε-greedy: with probability ε a uniformly random window, else argmax_a Q[s][a]
                (the smallest window on ties); the random generator is injected

Where this deviates from the paper, and why:

- **Reward.** Algorithm 2 rewards "the percentage of the accepted speculated tokens". The paper
  itself reports that this agent then keeps γ low to keep acceptance high and loses throughput
  (§6.3); the reward here is the throughput the objective is about, emitted tokens per second of
  the step (draft and verify time; a prefill chunk in the same step belongs to another request
  and is not counted).
- **Scope of the table.** The paper's agent persists across prompts (25 warm-up prompts before
  measuring). Here a request starts from the table its replica's finished requests and the
  cluster's left (``carry.py``): each entry the visit-weighted mean of the values requests ended
  with, over the requests that visited it; an entry none visited is ``q_init`` (or ``q_start``'s).
  Concurrent requests each update their own copy, which the paper's one sequential agent never
  had to merge. ``carry=False`` keeps the table per request (a fresh table for every prompt).
- **Hyper-parameters.** The paper gives none; ``lr``, ``discount`` and ``epsilon`` are ours.
- A step whose draft offered nothing although a window was asked still updates Q with its reward:
  that is what the action earned.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.window import JsonState, WindowOutcome
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class QState(JsonState):
    q: tuple[tuple[float, ...], ...]   # q[s][a], (window_max + 1) x (window_max + 1)
    previous: int                      # s of the pending step: the window before it
    window: int                        # a of the pending step: the window asked for it
    visits: tuple[tuple[int, ...], ...] = ()   # this request's backups of each q[s][a] (empty: none yet)


def q_update(q: tuple[tuple[float, ...], ...], s: int, a: int, reward: float, lr: float,
             discount: float) -> tuple[tuple[float, ...], ...]:
    """One Q-learning backup of (s, a) toward reward + discount · max Q[s'], with s' = a."""
    target = reward + discount * max(q[a])
    row = list(q[s])
    row[a] += lr * (target - row[a])
    return (*q[:s], tuple(row), *q[s + 1:])


def carried_q(carried: Mapping[str, float], s: int, a: int, default: float) -> float:
    """q[s][a] from carried sums: Σ visits x value / Σ visits; ``default`` where none visited."""
    n = carried.get(f"q_n_{s}_{a}", 0.0)
    return carried.get(f"q_mq_{s}_{a}", 0.0) / n / 1e3 if n > 0 else default


def greedy(row: tuple[float, ...]) -> int:
    return max(range(len(row)), key=lambda a: (row[a], -a))


@dataclass(frozen=True)
class QLearningWindow:
    window_max: int = 8
    lr: float = 0.1             # step size of the backup
    discount: float = 0.5       # weight of the next state's value
    epsilon: float = 0.1        # exploration probability
    q_init: float = 0.0         # every entry of a fresh table (when q_start is None)
    q_start: tuple[tuple[float, ...], ...] | None = None
    carry: bool = True          # start from the carried table (the paper's agent across prompts)

    name: ClassVar[str] = "q-learning"

    def __post_init__(self) -> None:
        size = self.window_max + 1
        if self.q_start is not None and (len(self.q_start) != size or any(len(r) != size for r in self.q_start)):
            raise ValueError(f"q_start must be {size} x {size} (windows 0..{self.window_max}), "
                             f"got {len(self.q_start)} rows of {[len(r) for r in self.q_start]}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")

    def start(self, request: SpecRequest, carried: Mapping[str, float] | None = None) -> QState:
        size = self.window_max + 1
        q = self.q_start if self.q_start is not None else tuple((self.q_init,) * size for _ in range(size))
        if self.carry and carried:
            q = tuple(tuple(carried_q(carried, s, a, q[s][a]) for a in range(size)) for s in range(size))
        window = min(request.window, self.window_max)
        return QState(q=q, previous=window, window=window)

    def counts(self, state: QState) -> dict[str, int]:
        """The entries this request backed up: visits and visits x value (milli-reward, floored at 0)."""
        if not self.carry:
            return {}
        out = {}
        for s, row in enumerate(state.visits):
            for a, n in enumerate(row):
                if n > 0:
                    out[f"q_n_{s}_{a}"] = n
                    out[f"q_mq_{s}_{a}"] = max(0, round(n * state.q[s][a] * 1e3))
        return out

    def reward(self, outcome: WindowOutcome) -> float | None:
        """Emitted tokens per second of the step; None when the step's time was not measured."""
        step_ms = outcome.draft_ms + outcome.verify_ms
        return 1e3 * (outcome.accepted + 1) / step_ms if step_ms > 0 else None

    def update(self, state: QState, outcome: WindowOutcome) -> QState:
        reward = self.reward(outcome)
        if reward is None:
            return state
        action = max(0, min(outcome.asked, self.window_max))   # what was asked after the scheduler's cap
        q = q_update(state.q, state.previous, action, reward, self.lr, self.discount)
        size = self.window_max + 1
        visits = state.visits or tuple((0,) * size for _ in range(size))
        row = list(visits[state.previous])
        row[action] += 1
        visits = (*visits[:state.previous], tuple(row), *visits[state.previous + 1:])
        return replace(state, q=q, window=action, visits=visits)

    def decide(self, state: QState, batch_size: int, rng: random.Random) -> tuple[int, QState]:
        s = state.window
        if rng.random() < self.epsilon:
            action = rng.randrange(self.window_max + 1)
        else:
            action = greedy(state.q[s])
        return action, replace(state, previous=s, window=action)
