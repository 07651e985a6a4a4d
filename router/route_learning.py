"""A target replica's router learning with the cluster, through Redis.

- **Out**: every finished request's routing outcome (``LearnedDraftRouter.on_outcome``) waits in a
  bounded buffer; a background task appends them to the capped Redis stream every few seconds,
  exactly once per batch (``RedisStats.add_routes``); when Redis does not answer the batch is
  kept and retried, newer outcomes wait, the oldest drop when the buffer is full (an outage costs
  learning, never memory or requests).
- **In**: the policy service retrains the acceptance models from the stream
  (``router/retrain.py``) and publishes them; a background task reads them every few seconds and,
  on a new version, the router takes the models for its target and topic basis. A replica that
  cannot reach Redis keeps the weights it has; so does one that reads a document failing
  ``retrain.WeightsDocument`` (garbage, dims beyond bounds: checked before any matrix is
  allocated) or a model of another feature count or not positive definite (counted,
  ``policies/redis_schema.py``).

Nothing here runs on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Coroutine

from specserve.policies.redis_schema import reject
from specserve.policies.redis_stats import RedisStats
from specserve.policies.stats_exporter import BatchFlusher
from specserve.policies.snapshot_cache import SnapshotCache
from specserve.router.draft_router import LearnedDraftRouter
from specserve.router.acceptance import LinearAcceptance
from specserve.router.retrain import WeightsDocument, weights_for

logger = logging.getLogger("ray.serve")

# Weights do not go stale the way load-dependent priors do: a week-old model beats a cold one.
WEIGHTS_MAX_AGE_S = 7 * 24 * 3600.0


class RouteLearning:
    def __init__(self, router: LearnedDraftRouter, target: str, store: RedisStats, interval_s: float = 2.0,
                 buffer: int = 2000, refresh_s: float = 5.0):
        self.router = router
        self.target = target
        self.store = store
        self._lock = threading.Lock()
        self._buffer: deque[dict] = deque(maxlen=buffer)
        self.outcomes = BatchFlusher(self._drain, store.add_routes, "routing outcomes", store.url, interval_s=interval_s)
        self.weights = SnapshotCache(store, refresh_s=refresh_s, max_age_s=WEIGHTS_MAX_AGE_S, name="router",
                                     schema=WeightsDocument)
        self.weights_version: int | None = None
        router.on_outcome.append(self.add)

    def add(self, outcome: dict) -> None:
        with self._lock:
            self._buffer.append({**outcome, "target": self.target})

    def _drain(self) -> list[dict]:
        with self._lock:
            batch, self._buffer = list(self._buffer), deque(maxlen=self._buffer.maxlen)
        return batch

    def flush_once(self) -> bool:
        """Send the buffered outcomes (exactly once per batch); True when Redis took them. Blocking."""
        return self.outcomes.flush_once()

    def load_weights(self) -> bool:
        """Take newly published weights for this target and basis; True when the router changed."""
        document = self.weights.refresh()
        if document is None or document.get("version") == self.weights_version:
            return False
        self.weights_version = document.get("version")
        dims = next((model.dims for model in self.router.models.values()), None)   # one feature vector for all
        models = {}
        for draft, data in weights_for(document, self.target, self.router.basis_id, dims).items():
            if draft not in self.router.models:
                continue
            try:   # a model that cannot predict is not taken: the router keeps its own
                LinearAcceptance.from_dict(data, dims=self.router.models[draft].dims)
            except ValueError as err:
                reject("router_weights", "schema", f"{self.store.prefix}:router:weights", f"{draft}: {err}")
                continue
            models[draft] = data
        if models:
            self.router.load_weights(models)
        return bool(models)

    async def _weights_forever(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.load_weights)
            except Exception:  # noqa: BLE001
                logger.exception("loading the router's weights failed")
            await asyncio.sleep(self.weights.refresh_s)

    def background(self) -> list[Coroutine]:
        return [self.outcomes.run_forever(), self._weights_forever()]
