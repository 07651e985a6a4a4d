"""The KV caches a replica keeps: one per live request, plus a few idle ones as a prefix cache.

A replica serves many requests at once, each needing its own KV cache (a ``KVSession`` inside a
``Target`` or a ``DraftLM``). A request first looks for its own session id; a new request takes
the idle cache that shares the longest prefix with its tokens (a multi-turn chat resumes where
the last turn stopped), else a fresh one. A cache that belonged to nobody is still correct:
``KVSession.sync`` rolls it back to the common prefix, so the pool only ever saves recompute.

Holders whose request vanished without ``release`` (a caller that died) go back to the idle list
after ``stale_after_s`` without use, so the pool cannot leak.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from specserve.replicas.kv_session import common_prefix_len

Holder = TypeVar("Holder")   # anything with a ``.session`` (a KVSession)


@dataclass
class _Busy(Generic[Holder]):
    holder: Holder
    last_used_s: float


class SessionPool(Generic[Holder]):
    def __init__(
        self,
        make: Callable[[], Holder],
        keep_idle: int = 4,
        stale_after_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if keep_idle < 0:
            raise ValueError(f"keep_idle must be >= 0, got {keep_idle}")
        self._make = make
        self.keep_idle = keep_idle
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._busy: dict[str, _Busy[Holder]] = {}
        self._idle: list[Holder] = []   # least recently released first

    def __len__(self) -> int:
        return len(self._busy) + len(self._idle)

    @property
    def busy(self) -> int:
        return len(self._busy)

    def acquire(self, session_id: str, tokens: list[int]) -> Holder:
        now = self._clock()
        self._reclaim_stale(now)
        entry = self._busy.get(session_id)
        if entry is None:
            entry = _Busy(self._take_idle(tokens), now)
            self._busy[session_id] = entry
        entry.last_used_s = now
        return entry.holder

    def release(self, session_id: str) -> None:
        entry = self._busy.pop(session_id, None)
        if entry is not None:
            self._park(entry.holder)

    def _take_idle(self, tokens: list[int]) -> Holder:
        if not self._idle:
            return self._make()
        # Longest shared prefix wins; among equals the most recently released (max keeps the last).
        best = max(range(len(self._idle)),
                   key=lambda i: (common_prefix_len(self._idle[i].session.tokens, tokens), i))
        return self._idle.pop(best)

    def _park(self, holder: Holder) -> None:
        self._idle.append(holder)
        del self._idle[: max(0, len(self._idle) - self.keep_idle)]

    def _reclaim_stale(self, now: float) -> None:
        for session_id in [s for s, e in self._busy.items() if now - e.last_used_s > self.stale_after_s]:
            self.release(session_id)
