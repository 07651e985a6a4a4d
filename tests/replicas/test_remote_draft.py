"""RemoteDraft bounds every call to a draft deployment; here a handle answers at once in real time
while a manual clock says how long each call took, so deadlines are checked without sleeps."""

import asyncio

import pytest

from manual_clock import ManualClock
from specserve.replicas.remote_draft import DraftUnavailable, RemoteDraft


class Handle:
    """A Serve handle's shape: ``handle.<method>.remote(*args)`` is awaitable. Each call moves the
    clock by the next of ``took_s`` (or, for a call that must miss its deadline, never answers)."""

    def __init__(self, clock: ManualClock, took_s: list[float | None]):
        self.clock, self.took_s = clock, list(took_s)
        self.propose_batch = self

    def remote(self, asks):
        took = self.took_s.pop(0)

        async def answer():
            if took is None:
                await asyncio.Event().wait()
            self.clock.now += took
            return ["proposal"] * len(asks)

        return answer()


def test_one_slow_call_raises_the_deadline_only_up_to_its_cap():
    clock = ManualClock()
    draft = RemoteDraft(Handle(clock, [0.004, 4.9]), "slow", min_deadline_s=5.0, max_deadline_s=10.0, clock=clock)

    async def calls():
        await draft.propose_batch([1])
        assert draft.deadline_s() == 5.0          # 10 x 4 ms is below the floor
        await draft.propose_batch([1])
        # 10 x 4.9 s would be 49 s of every later step; the cap holds it at 10 s.
        assert draft.deadline_s() == 10.0

    asyncio.run(calls())


def test_a_call_past_its_deadline_is_dropped_and_the_draft_rests():
    clock = ManualClock()
    draft = RemoteDraft(Handle(clock, [None]), "stuck", min_deadline_s=0.1, max_deadline_s=0.2, cooldown_s=30.0,
                        clock=clock)

    async def call():
        with pytest.raises(DraftUnavailable, match="no answer within 0.1"):
            await draft.propose_batch([1])
        assert draft.down   # later steps go plain at once instead of each waiting

    asyncio.run(call())


def test_a_cap_below_the_floor_is_refused():
    with pytest.raises(ValueError, match="max_deadline_s"):
        RemoteDraft(object(), min_deadline_s=5.0, max_deadline_s=1.0)
