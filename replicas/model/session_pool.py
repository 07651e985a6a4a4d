"""The KV caches a replica keeps: one per live request, plus a few idle ones as a prefix cache.

A replica serves many requests at once, each needing its own KV cache (a ``KVSession`` inside a
``Target`` or a ``DraftLM``). A request first looks for its own session id; a new request takes
the idle cache that shares the longest prefix with its tokens (a multi-turn chat resumes where
the last turn stopped), else a fresh one. A cache that belonged to nobody is still correct:
``KVSession.sync`` rolls it back to the common prefix, so the pool only ever saves recompute.

An idle cache is a prefix cache only for its own tenant: a request of another ``cache_salt``
never reads it (its cache is cleared first), so no tenant's prompt speeds up another's.

A session holds its cache from ``acquire`` until ``release``. Its caller may be another replica
(a target calling a draft server once per step) that can die without calling ``release``, so a
session that goes ``stale_after_s`` without ``acquire`` or ``touch`` is taken to be abandoned and
its cache goes back to the idle list: the pool cannot leak. A holder used for longer than that
without returning to the pool (a whole request on one ``Target``, which under load can outlast
the timeout) must say so: inside ``with pool.using(...)`` it is never reclaimed, and its idle
time counts from the end of the block. So a live session's holder is never handed to another:
"live" means pinned by ``using``, or acquired or touched within ``stale_after_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from specserve.replicas.model.kv_session import common_prefix_len

Holder = TypeVar("Holder")   # anything with a ``.session`` (a KVSession)


@dataclass
class _Busy(Generic[Holder]):
    holder: Holder
    last_used_s: float
    salt: str | None = None  # the tenant whose tokens the holder's cache holds
    in_use: int = 0          # open ``using`` blocks: while > 0 the holder is never reclaimed
    released: bool = False   # released during a ``using`` block: parked when the last one ends


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
        self._idle: list[tuple[Holder, str | None]] = []   # (holder, its salt), least recently released first
        # A ``using`` block may open on the event loop while steps acquire on a model thread;
        # without the lock two sessions could pop the same idle holder.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._busy) + len(self._idle)

    @property
    def busy(self) -> int:
        return len(self._busy)

    def acquire(self, session_id: str, tokens: list[int], salt: str | None = None) -> Holder:
        """The session's holder (taken from the idle list on first use, for a request of
        ``salt``); refreshes its lease."""
        with self._lock:
            return self._acquire(session_id, tokens, salt).holder

    @contextmanager
    def using(self, session_id: str, tokens: list[int], salt: str | None = None) -> Iterator[Holder]:
        """``acquire``, and keep the holder from being reclaimed until the block ends, however
        long it runs. The session keeps the holder after the block; ``release`` ends it."""
        with self._lock:
            entry = self._acquire(session_id, tokens, salt)
            entry.in_use += 1
        try:
            yield entry.holder
        finally:
            with self._lock:
                entry.in_use -= 1
                entry.last_used_s = self._clock()   # idle from now, not from the acquire
                if entry.released and entry.in_use == 0:
                    self._park(entry)

    def touch(self, session_id: str) -> bool:
        """Refresh the session's lease without a step. False if it holds nothing (released, or
        reclaimed as abandoned): its next ``acquire`` may get another cache, which is still correct."""
        with self._lock:
            entry = self._busy.get(session_id)
            if entry is not None:
                entry.last_used_s = self._clock()
            return entry is not None

    def release(self, session_id: str) -> None:
        with self._lock:
            self._release(session_id)

    def _acquire(self, session_id: str, tokens: list[int], salt: str | None) -> _Busy[Holder]:
        now = self._clock()
        entry = self._busy.get(session_id)
        if entry is not None:
            entry.last_used_s = now   # before the sweep: a caller back after a long gap is alive
        self._reclaim_stale(now)
        if entry is None:
            entry = _Busy(self._take_idle(tokens, salt), now, salt)
            self._busy[session_id] = entry
        return entry

    def _release(self, session_id: str) -> None:
        entry = self._busy.pop(session_id, None)
        if entry is None:
            return
        if entry.in_use:
            # Still inside a ``using`` block: parking now would let another session take the
            # holder mid-operation. The block parks it when it ends.
            entry.released = True
        else:
            self._park(entry)

    def _take_idle(self, tokens: list[int], salt: str | None) -> Holder:
        if not self._idle:
            return self._make()

        def shared(i: int) -> int:
            holder, holder_salt = self._idle[i]
            return common_prefix_len(holder.session.tokens, tokens) if holder_salt == salt else 0

        # Longest shared prefix of the same salt wins; among equals the most recently released
        # (max keeps the last).
        holder, holder_salt = self._idle.pop(max(range(len(self._idle)), key=lambda i: (shared(i), i)))
        if holder_salt != salt:
            holder.session.reset()
        return holder

    def _park(self, entry: _Busy[Holder]) -> None:
        self._idle.append((entry.holder, entry.salt))
        del self._idle[: max(0, len(self._idle) - self.keep_idle)]

    def _reclaim_stale(self, now: float) -> None:
        stale = [s for s, e in self._busy.items() if not e.in_use and now - e.last_used_s > self.stale_after_s]
        for session_id in stale:
            self._release(session_id)
