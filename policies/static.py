"""The static policy: every step uses the window or tree the request asked for.

A policy is ``choose(state, batch_size) -> Speculation`` plus ``observe(record)``, the seam of
``replicas/scheduler.py``; the adaptive window and tree policies plug in the same way.
"""

from __future__ import annotations

from specserve.replicas.scheduler import RequestState
from specserve.replicas.step import Speculation, StepRecord


class StaticPolicy:
    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        return state.request.speculation

    def observe(self, record: StepRecord) -> None:
        pass
