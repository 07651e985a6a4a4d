"""A replica's counters to Redis: a background task flushes the collector every few seconds, in
one pipelined script per flush; never a Redis round trip on the request path.

When Redis does not answer, the drained batch is kept and retried *as the same flush* (see
``redis_stats``: exactly once), while new counts keep accumulating in the collector's bounded
buffer; after Redis returns, both arrive. Failures are logged once per outage, not per attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter

import redis

from specserve.policies.redis_stats import RedisStats
from specserve.policies.stats import StatsCollector, StatsKey

logger = logging.getLogger("ray.serve")


class RedisExporter:
    def __init__(self, collector: StatsCollector, store: RedisStats, interval_s: float = 2.0, flusher: str | None = None):
        self.collector = collector
        self.store = store
        self.interval_s = interval_s
        self.flusher = flusher or uuid.uuid4().hex   # one per replica life: flush numbers restart with it
        self._number = 0
        self._pending: dict[StatsKey, Counter] | None = None
        self._down_since: float | None = None
        self.flushed = 0   # flushes applied

    def flush_once(self) -> bool:
        """Flush what is pending (or drain a new batch); True when Redis took it. Blocking: call it
        in a thread (``run_forever`` does)."""
        if self._pending is None:
            counts = self.collector.drain()
            if not counts:
                return True
            self._number += 1
            self._pending = counts
        try:
            self.store.flush(self.flusher, self._number, self._pending)
        except (redis.RedisError, OSError) as err:
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning("statistics flush to %s failed (%s: %s); counts wait in the replica's buffer "
                               "and are retried", self.store.url.split("@")[-1], type(err).__name__, err)
            return False
        if self._down_since is not None:
            logger.warning("statistics flush to Redis works again")
            self._down_since = None
        self._pending = None
        self.flushed += 1
        return True

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.flush_once)
            except Exception:  # noqa: BLE001 - statistics never take the replica down
                logger.exception("statistics flush failed unexpectedly")
