"""The deployment's policy, overridable per request (``spec.policy``).

One instance of each policy a request names lives in the replica, created on first use, so that
policies with per-replica state (the goodput cost model, Q-tables) keep it across requests. Every
step's record goes to every instance: costs measured on any request inform all of them, and a
window policy updates only the requests it chose for.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from specserve.policies.carry import CarriedSums, CarrySink
from specserve.policies.registry import POLICIES, build_policy
from specserve.replicas.request import RequestState
from specserve.replicas.step import Speculation, StepRecord


@runtime_checkable
class PricesSteps(Protocol):
    """A policy that prices steps with measured costs, and takes the replica's start-up ones."""

    def seed_costs(self, verify: tuple[tuple[int, float], ...], draft_ms_per_position: dict[str, float],
                   loaded: tuple = ()) -> None: ...


@runtime_checkable
class Carries(Protocol):
    """A policy whose rule carries learned state across requests (``carry.py``)."""

    carried: CarriedSums


class PolicyByRequest:
    def __init__(self, default: str):
        if default not in POLICIES:
            raise ValueError(f"unknown policy {default!r}; choose from {', '.join(POLICIES)}")
        self.default = default
        self.instances: dict[str, object] = {}
        self._seed: tuple | None = None   # the start-up probe's costs, for instances made later
        self._sinks: list[CarrySink] = []   # where carried counts go besides each policy's own sums

    def seed_costs(self, verify: tuple[tuple[int, float], ...], draft_ms_per_position: dict[str, float],
                   loaded: tuple = ()) -> None:
        """The replica's costs measured at start, to every policy that prices with them (now, and
        each created later): batch-1 verify points, drafts' ms per position, ``loaded`` (batch
        size, verify points) pairs. Called again with more (a draft deployment's costs, known once
        it answers), it adds to what was seeded: later instances get all of it."""
        old_verify, old_drafts, old_loaded = self._seed or ((), {}, ())
        self._seed = (tuple(verify) or old_verify, {**old_drafts, **draft_ms_per_position}, tuple(loaded) or old_loaded)
        for policy in self.instances.values():
            if isinstance(policy, PricesSteps):
                policy.seed_costs(verify, draft_ms_per_position, loaded)

    def __getstate__(self) -> dict:
        # The sinks are this process's callbacks (``CarriedSums.__getstate__``): not copied.
        return {**self.__dict__, "_sinks": []}

    def carry_into(self, sink: CarrySink) -> None:
        """Hand every finished request's carried counts (of each policy that carries, now and
        created later) to ``sink`` too: the replica's statistics, on their way to Redis."""
        self._sinks.append(sink)
        for policy in self.instances.values():
            if isinstance(policy, Carries):
                policy.carried.sinks.append(sink)

    def _seed_one(self, policy) -> None:
        if isinstance(policy, PricesSteps) and self._seed is not None:   # only the cost-aware ones
            policy.seed_costs(*self._seed)

    def name_for(self, state: RequestState) -> str:
        return state.request.policy or self.default

    def _instance(self, name: str):
        if name not in self.instances:
            self.instances[name] = build_policy(name)
            self._seed_one(self.instances[name])
            if isinstance(self.instances[name], Carries):
                self.instances[name].carried.sinks.extend(self._sinks)
        return self.instances[name]

    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        return self._instance(self.name_for(state)).choose(state, batch_size)

    def observe(self, record: StepRecord) -> None:
        for policy in list(self.instances.values()):
            policy.observe(record)
