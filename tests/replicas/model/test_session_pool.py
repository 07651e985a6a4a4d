"""SessionPool: a request keeps its cache between steps, new requests reuse the idle cache with
the longest shared prefix, and abandoned sessions come back after the stale timeout."""

from dataclasses import dataclass, field

import pytest
from manual_clock import ManualClock

from specserve.replicas.model.session_pool import SessionPool


@dataclass
class FakeSession:
    tokens: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.tokens = []


@dataclass
class Holder:
    """Stands in for a Target or DraftLM: the pool only reads ``.session.tokens`` and resets it."""

    session: FakeSession = field(default_factory=FakeSession)


def test_a_session_keeps_its_holder_until_released():
    pool = SessionPool(Holder, keep_idle=2)
    a = pool.acquire("a", [1, 2])
    assert pool.acquire("a", [1, 2, 3]) is a
    assert pool.acquire("b", [1, 2]) is not a      # a is busy: b gets its own
    assert pool.busy == 2
    pool.release("a")
    assert pool.busy == 1 and len(pool) == 2


def test_new_session_takes_the_idle_cache_with_the_longest_common_prefix():
    pool = SessionPool(Holder, keep_idle=4)
    short, long_ = pool.acquire("s", []), pool.acquire("l", [])
    short.session.tokens = [1, 2, 9]
    long_.session.tokens = [1, 2, 3, 4]
    pool.release("s")
    pool.release("l")
    # [1, 2, 3, 4, 5] shares 4 tokens with long_, 2 with short.
    assert pool.acquire("next", [1, 2, 3, 4, 5]) is long_
    assert pool.acquire("other", [7]) is short      # no prefix shared: the remaining idle one


def test_an_idle_cache_is_a_prefix_cache_for_its_own_salt_only():
    pool = SessionPool(Holder, keep_idle=4)
    mine, theirs = pool.acquire("m", [], salt="a"), pool.acquire("t", [], salt="b")
    mine.session.tokens, theirs.session.tokens = [1, 2], [1, 2, 3, 4]
    pool.release("m")
    pool.release("t")
    # Tenant a's prompt shares more with b's cache, but only a's cache may serve it.
    assert pool.acquire("next-a", [1, 2, 3, 4, 5], salt="a") is mine and mine.session.tokens == [1, 2]
    # Only b's cache is left: a request of c gets it cleared, never reading b's tokens.
    assert pool.acquire("next-c", [1, 2, 3, 4, 5], salt="c") is theirs and theirs.session.tokens == []


def test_idle_caches_beyond_keep_idle_are_dropped_oldest_first():
    pool = SessionPool(Holder, keep_idle=1)
    pool.acquire("1", [])
    second = pool.acquire("2", [])
    pool.release("1")
    pool.release("2")
    assert len(pool) == 1
    assert pool.acquire("3", []) is second


def test_abandoned_sessions_are_reclaimed_after_the_stale_timeout():
    clock = ManualClock()
    pool = SessionPool(Holder, keep_idle=4, stale_after_s=10, clock=clock)
    lost = pool.acquire("lost", [5])      # its caller died without release()
    clock.now = 11
    # Any acquire first sweeps stale sessions, so the next request reuses the abandoned cache.
    assert pool.acquire("new", [6]) is lost
    assert pool.busy == 1


def test_a_holder_in_use_is_never_reclaimed_however_long_its_request_runs():
    # The defect: a Target held for a whole request was handed to a new request once the request
    # outlasted stale_after_s, because nothing refreshed it between acquire and release.
    clock = ManualClock()
    pool = SessionPool(Holder, keep_idle=4, stale_after_s=10, clock=clock)
    with pool.using("long", [1, 2]) as held:
        clock.now = 1000                                  # 100 timeouts without a pool call
        assert pool.acquire("new", [1, 2]) is not held    # same prefix, yet held is not idle
        assert pool.busy == 2
    pool.release("long")
    assert pool.acquire("next", [1, 2]) is held           # released: now it may be reused


def test_idle_time_of_a_used_holder_counts_from_the_end_of_the_block():
    clock = ManualClock()
    pool = SessionPool(Holder, keep_idle=4, stale_after_s=10, clock=clock)
    with pool.using("s", [1]) as held:
        clock.now = 50
    clock.now = 59                  # 9 s since the block ended (59 since the acquire): still live
    assert pool.acquire("other", [1]) is not held
    clock.now = 61                  # 11 s since the block ended: abandoned, reclaimed
    assert pool.acquire("third", [1]) is held


def test_touch_and_acquire_refresh_the_lease():
    clock = ManualClock()
    pool = SessionPool(Holder, keep_idle=4, stale_after_s=10, clock=clock)
    a = pool.acquire("a", [1])
    clock.now = 8
    assert pool.touch("a")
    clock.now = 15                  # 15 s since the acquire, 7 since the touch: live
    b = pool.acquire("b", [1])
    assert b is not a
    b.session.tokens = [9]
    pool.release("b")
    clock.now = 30                  # 22 s since the touch: any other call would reclaim "a", but
    # its own call proves it alive, so it keeps its cache rather than taking b, the better prefix.
    assert pool.acquire("a", [9]) is a
    clock.now = 39                  # 9 s since that acquire: live
    assert pool.acquire("c", [1]) is not a
    clock.now = 41                  # 11 s: abandoned
    assert pool.acquire("d", [1]) is a
    assert not pool.touch("a")      # reclaimed: the caller learns its cache is gone


def test_release_inside_a_using_block_parks_the_holder_only_when_the_block_ends():
    pool = SessionPool(Holder, keep_idle=4)
    with pool.using("a", [1]) as held:
        pool.release("a")
        assert pool.acquire("b", [1]) is not held         # still in use: not idle yet
    assert pool.acquire("c", [1]) is held


def test_keep_idle_must_not_be_negative():
    with pytest.raises(ValueError, match="keep_idle must be >= 0"):
        SessionPool(Holder, keep_idle=-1)
