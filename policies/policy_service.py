"""The policy service: a Serve deployment that turns every replica's counters into cluster priors.

Every ``interval_s`` it reads the counters of the last ``horizon_s`` from Redis, computes the
priors (``priors.compute_snapshot``) and publishes them as the next versioned JSON snapshot,
which target replicas pick up (``snapshot_cache``). It holds no state of its own: restarted, it
reads the counters again and publishes the next version. Its health does not depend on Redis;
while Redis is down it publishes nothing and replicas keep their last snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis
from ray import serve

from specserve.policies.priors import compute_snapshot
from specserve.policies.redis_schema import MAX_PRIORS, Prior, valid
from specserve.policies.redis_stats import RedisStats

logger = logging.getLogger("ray.serve")


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, num_replicas=1, max_ongoing_requests=64, health_check_period_s=10)
class PolicyService:
    def __init__(self, redis_url: str, prefix: str = "specserve", interval_s: float = 10.0,
                 half_life_s: float = 3600.0, horizon_s: float = 24 * 3600.0, min_steps: int = 20,
                 router_retrain: Callable[[list[dict]], dict] | None = None):
        """``router_retrain``: turns the routing outcomes stream into the draft router's weights
        (``router/retrain.py``, handed in by the application: this layer does not import the
        router's); None: no router weights are published."""
        self.store = RedisStats(redis_url, prefix)
        self.router_retrain = router_retrain
        self.router_latest: dict | None = None
        self.interval_s = interval_s
        self.half_life_s = half_life_s
        self.horizon_s = horizon_s
        self.min_steps = min_steps
        self.latest: dict | None = None
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    def publish(self) -> dict:
        """Read, compute and publish one snapshot now (blocking)."""
        now = time.time()
        counts = self.store.read(since=now - self.horizon_s)
        snapshot = compute_snapshot(counts, now, self.half_life_s, self.min_steps)
        snapshot["priors"] = valid(Prior, snapshot.get("priors", []), "policy_snapshot", "policy:snapshot", MAX_PRIORS)
        self.latest = self.store.publish_snapshot(snapshot)
        if self.router_retrain is not None:
            self.router_latest = self.store.publish_snapshot(self.router_retrain(self.store.read_routes()), "router")
        return self.latest

    async def _publish_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.publish)
                if self.last_error:
                    logger.warning("policy service: Redis answers again; published version %s", self.latest["version"])
                self.last_error = None
            except (redis.RedisError, OSError) as err:
                if self.last_error is None:
                    logger.warning("policy service: Redis unreachable (%s: %s); replicas keep their last snapshot",
                                   type(err).__name__, err)
                self.last_error = f"{type(err).__name__}: {err}"
            except Exception:  # noqa: BLE001 - a bad counter must not stop the service
                logger.exception("policy service: computing the snapshot failed")
            await asyncio.sleep(self.interval_s)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._publish_forever())

    async def snapshot(self) -> dict | None:
        """The latest snapshot: this replica's last publication, else the one in Redis."""
        self._ensure_running()
        if self.latest is not None:
            return self.latest
        try:
            return await asyncio.to_thread(self.store.read_snapshot)
        except (redis.RedisError, OSError):
            return None

    async def refresh(self) -> dict:
        """Publish a snapshot now (``specserve policy --refresh``)."""
        self._ensure_running()
        return await asyncio.to_thread(self.publish)

    async def status(self) -> dict:
        self._ensure_running()
        return {"interval_s": self.interval_s, "half_life_s": self.half_life_s, "min_steps": self.min_steps,
                "redis_error": self.last_error, "version": (self.latest or {}).get("version"),
                "router_weights_version": (self.router_latest or {}).get("version"),
                "router_outcomes": (self.router_latest or {}).get("outcomes")}

    async def recent_routes(self, count: int = 50) -> list[dict] | None:
        """The newest routing outcomes of the whole cluster (``GET /v1/routing/recent``); None
        when Redis does not answer."""
        try:
            return await asyncio.to_thread(self.store.read_routes, count)
        except (redis.RedisError, OSError):
            return None

    async def check_health(self) -> None:
        # Starts the publishing loop without waiting for a first call; never asks Redis.
        self._ensure_running()
