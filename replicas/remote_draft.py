"""A draft deployment behind a Serve handle, answering as an in-process ``DraftServer`` does, with
every call bounded in time.

A step waits for its drafts' proposals, so a draft call that never returns stops every request of
the target replica: a draft deployment that lost its only replica and cannot reschedule it (no
free CPU on the nodes left) leaves Serve's handle queueing the call for ever. So each call has a
deadline derived from the draft's own cost,

    deadline = min(max_deadline_s, max(min_deadline_s, slack × the slowest of the last ``history`` calls))

(a step's draft call takes a few ms; the floor covers a replica's first calls, which resolve the
handle; the cap keeps one slow call from making every later step wait ``slack`` times as long: a
proposal later than the cap is dropped, which costs speculation and leaves the output as it
is), and a call that misses it, or fails, marks the draft down for ``cooldown_s``: its calls
fail at once meanwhile (``DraftUnavailable``), so its requests go on by plain decoding
(``StepLoop``) instead of each paying the deadline, and the first call after the cool-down tries
again. The call that missed its deadline is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from specserve.replicas.drafts.base import NeedFeatures
from specserve.replicas.step import Proposal, ProposeRequest


class DraftUnavailable(RuntimeError):
    """The draft deployment did not answer in time, or failed, recently: no call is made."""


class RemoteDraft:
    def __init__(self, handle, name: str = "draft", min_deadline_s: float = 5.0, slack: float = 10.0,
                 cooldown_s: float = 10.0, history: int = 32, clock: Callable[[], float] = time.monotonic,
                 max_deadline_s: float = 10.0):
        if max_deadline_s < min_deadline_s:
            raise ValueError(f"max_deadline_s ({max_deadline_s}) must be >= min_deadline_s ({min_deadline_s})")
        self.handle = handle
        self.name = name
        self.min_deadline_s = min_deadline_s
        self.max_deadline_s = max_deadline_s
        self.slack = slack
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._calls: deque[float] = deque(maxlen=history)   # seconds of recent calls that answered
        self.down_until = -float("inf")
        self.last_error: str | None = None

    def deadline_s(self) -> float:
        return min(self.max_deadline_s, max(self.min_deadline_s, self.slack * max(self._calls, default=0.0)))

    @property
    def down(self) -> bool:
        return self._clock() < self.down_until

    async def _call(self, method: str, *args):
        if self.down:
            raise DraftUnavailable(f"draft {self.name} is down for {self.down_until - self._clock():.0f} s more "
                                   f"({self.last_error})")
        deadline = self.deadline_s()
        t0 = self._clock()
        try:
            out = await asyncio.wait_for(getattr(self.handle, method).remote(*args), deadline)
        except asyncio.TimeoutError:
            self._fail(f"no answer within {deadline:.1f} s")
            raise DraftUnavailable(f"draft {self.name}: {method} had no answer within {deadline:.1f} s") from None
        except Exception as err:
            self._fail(f"{type(err).__name__}: {err}")
            raise
        self._calls.append(self._clock() - t0)
        return out

    def _fail(self, why: str) -> None:
        self.down_until = self._clock() + self.cooldown_s
        self.last_error = why

    async def info(self) -> dict:
        return await self._call("info")

    async def round_trip_ms(self, calls: int = 3) -> float:
        """What a call costs the step beyond the draft's own work, measured from here: the least
        of ``calls`` ``info`` calls (no model work; the first one resolved the handle)."""
        times = []
        for _ in range(calls):
            t0 = self._clock()
            await self._call("info")
            times.append(1e3 * (self._clock() - t0))
        return min(times)

    async def propose_batch(self, asks: list[ProposeRequest]) -> list[Proposal | NeedFeatures]:
        return await self._call("propose_batch", asks)

    async def release(self, session_ids: list[str], endings: dict | None = None) -> dict:
        """What the sessions left (``DraftServer.release``), unchecked: the caller checks it."""
        return await self._call("release", session_ids, endings)
