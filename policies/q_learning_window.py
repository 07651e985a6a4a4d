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
  measuring). Here the table is part of the per-request state, as every window policy's is; a
  table learnt elsewhere (e.g. a cluster prior from the policy service) is passed as ``q_start``
  and copied into each new request.
- **Hyper-parameters.** The paper gives none; ``lr``, ``discount`` and ``epsilon`` are ours.
- A step whose draft offered nothing although a window was asked still updates Q with its reward:
  that is what the action earned.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import ClassVar

from specserve.policies.window import JsonState, WindowOutcome
from specserve.replicas.request import SpecRequest


@dataclass(frozen=True)
class QState(JsonState):
    q: tuple[tuple[float, ...], ...]   # q[s][a], (window_max + 1) x (window_max + 1)
    previous: int                      # s of the pending step: the window before it
    window: int                        # a of the pending step: the window asked for it


def q_update(q: tuple[tuple[float, ...], ...], s: int, a: int, reward: float, lr: float,
             discount: float) -> tuple[tuple[float, ...], ...]:
    """One Q-learning backup of (s, a) toward reward + discount · max Q[s'], with s' = a."""
    target = reward + discount * max(q[a])
    row = list(q[s])
    row[a] += lr * (target - row[a])
    return (*q[:s], tuple(row), *q[s + 1:])


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

    name: ClassVar[str] = "q-learning"

    def __post_init__(self) -> None:
        size = self.window_max + 1
        if self.q_start is not None and (len(self.q_start) != size or any(len(r) != size for r in self.q_start)):
            raise ValueError(f"q_start must be {size} x {size} (windows 0..{self.window_max}), "
                             f"got {len(self.q_start)} rows of {[len(r) for r in self.q_start]}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")

    def start(self, request: SpecRequest) -> QState:
        size = self.window_max + 1
        q = self.q_start if self.q_start is not None else tuple((self.q_init,) * size for _ in range(size))
        window = min(request.window, self.window_max)
        return QState(q=q, previous=window, window=window)

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
        return replace(state, q=q, window=action)

    def decide(self, state: QState, batch_size: int, rng: random.Random) -> tuple[int, QState]:
        s = state.window
        if rng.random() < self.epsilon:
            action = rng.randrange(self.window_max + 1)
        else:
            action = greedy(state.q[s])
        return action, replace(state, previous=s, window=action)
