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
from collections.abc import Callable
from typing import Any

import redis

from specserve.policies.redis_stats import RedisStats
from specserve.policies.stats import StatsCollector

logger = logging.getLogger("ray.serve")


class BatchFlusher:
    """Sends batches to Redis exactly once: ``drain()`` gives the next batch (empty: nothing to
    send), ``send(flusher, number, batch)`` applies it (``RedisStats.flush``, ``add_routes``).
    A batch Redis did not take is kept and retried under the same number; failures are logged
    once per outage as ``what``."""

    def __init__(self, drain: Callable[[], Any], send: Callable[[str, int, Any], bool], what: str,
                 url: str, flusher: str | None = None, interval_s: float = 2.0):
        self.drain = drain
        self.interval_s = interval_s
        self.send = send
        self.what = what
        self.url = url
        self.flusher = flusher or uuid.uuid4().hex   # one per replica life: numbers restart with it
        self._number = 0
        self._pending: Any = None
        self._down_since: float | None = None
        self.flushed = 0   # batches applied

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def flush_once(self) -> bool:
        """Send what is pending (or drain a new batch); True when Redis took it. Blocking: call it
        in a thread."""
        if self._pending is None:
            batch = self.drain()
            if not batch:
                return True
            self._number += 1
            self._pending = batch
        try:
            self.send(self.flusher, self._number, self._pending)
        except (redis.RedisError, OSError) as err:
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning("%s to %s failed (%s: %s); they wait in the replica's buffer and are retried",
                               self.what, self.url.split("@")[-1], type(err).__name__, err)
            return False
        if self._down_since is not None:
            logger.warning("%s reach Redis again", self.what)
            self._down_since = None
        self._pending = None
        self.flushed += 1
        return True


    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.flush_once)
            except Exception:  # noqa: BLE001 - learning never takes the replica down
                logger.exception("%s flush failed unexpectedly", self.what)


class RedisExporter(BatchFlusher):
    def __init__(self, collector: StatsCollector, store: RedisStats, interval_s: float = 2.0, flusher: str | None = None):
        super().__init__(collector.drain, store.flush, "statistics", store.url, flusher, interval_s)
        self.collector = collector
        self.store = store
