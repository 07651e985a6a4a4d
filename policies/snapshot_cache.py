"""A replica's local copy of the policy service's latest snapshot.

A background task re-reads it every ``refresh_s``; requests read the local copy (no Redis on the
request path). A snapshot older than ``max_age_s`` (by its publication time: the policy service
stopped publishing, or Redis has been unreachable that long) is not used, and requests start from
the deployment's defaults, as they do before the first snapshot. A stored value that fails its
schema (``redis_schema``: garbage, the wrong shape, out of bounds) is skipped and counted like an
absent one: the replica keeps its last good snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis
from pydantic import BaseModel

from specserve.policies.redis_stats import RedisStats

logger = logging.getLogger("ray.serve")


class SnapshotCache:
    def __init__(self, store: RedisStats, refresh_s: float = 5.0, max_age_s: float = 600.0,
                 clock: Callable[[], float] = time.time, name: str = "policy",
                 schema: type[BaseModel] | None = None):
        """``name``: the document (``policy``: the priors; ``router``: the router's weights);
        ``schema``: what it must parse as (default: the policy snapshot's)."""
        self.store = store
        self.name = name
        self.schema = schema
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._snapshot: dict | None = None
        self._failing = False

    def refresh(self) -> dict | None:
        """Read the latest snapshot (blocking; ``run_forever`` calls it in a thread). Keeps the last
        one when Redis does not answer, holds none, or holds one that fails the schema."""
        try:
            snapshot = self.store.read_snapshot(self.name, self.schema)
        except (redis.RedisError, OSError, ValueError) as err:
            if not self._failing:
                logger.warning("%s snapshot: Redis read failed (%s: %s); keeping version %s",
                               self.name, type(err).__name__, err, (self._snapshot or {}).get("version"))
            self._failing = True
            return self._snapshot
        self._failing = False
        if snapshot is not None and (self._snapshot is None or snapshot["version"] != self._snapshot["version"]):
            self._snapshot = snapshot
        return self._snapshot

    def current(self) -> dict | None:
        """The snapshot to start a request from, or None (stale or never seen)."""
        snapshot = self._snapshot
        if snapshot is None or self._clock() - snapshot.get("published_at", 0.0) > self.max_age_s:
            return None
        return snapshot

    async def run_forever(self) -> None:
        while True:
            await asyncio.to_thread(self.refresh)
            await asyncio.sleep(self.refresh_s)
