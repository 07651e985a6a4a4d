"""A draft server: ``propose`` for one step of one session, ``release`` when the session ends.

It runs in one of two places (``DraftSpec.colocated``):

- as its own Ray Serve deployment (``DraftDeployment``): drafts scale and fail apart from the
  target, on their own GPUs, and a step pays one handle call (measured 6-7 ms inside a replica on
  the 2-core machines here, 3.7 ms from an idle driver);
- inside each target replica: no call at all, sharing the target's worker thread. Worth it when
  proposing is cheap next to the hop (prompt lookup: 0.5 ms) or the draft is small enough to sit
  beside the target.

Target replicas call it once per step with the session's whole context; the server keeps that
session's KV cache between steps (``SessionPool``), so a step feeds only the tokens the cache
lacks. Any replica can serve any call, since the cache is rebuilt from the tokens; the target
routes a session's calls to one replica by session id only to save that rebuild.

Model work runs on one ``ModelWorker`` thread, which the health check watches.
"""

from __future__ import annotations

import logging

import torch
from ray import serve

from specserve.replicas.drafts.base import draft_from_model
from specserve.replicas.drafts.hsr_draft import MissingFeatures, NeedFeatures
from specserve.replicas.drafts.hsr_head import HSRHead
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.model_store import load_causal_lm
from specserve.replicas.model_worker import ModelWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.session_pool import SessionPool
from specserve.replicas.step import Proposal
from specserve.router.session import ProposeRequest, propose

logger = logging.getLogger("ray.serve")

# Seeded generators of sampled sessions in flight; far more than a replica serves at once.
MAX_GENERATORS = 4096


class DraftServer:
    def __init__(self, name: str, model: str | None, dtype: str = "auto", torch_threads: int | None = None,
                 kv_sessions_idle: int = 4, worker: ModelWorker | None = None):
        """``worker``: the thread model work runs on; a colocated draft shares the target's."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.name = name
        self._worker = worker or ModelWorker(f"draft-{name}")
        self._generators: dict[str, torch.Generator] = {}
        self._needs_features = False
        if model is None:
            self._lookup: PromptLookupDraft | None = PromptLookupDraft()
            self.pool = None
        else:
            loaded = load_causal_lm(model, dtype=dtype)
            self._needs_features = isinstance(loaded.model, HSRHead)
            self._lookup = None
            self.pool = SessionPool(lambda: draft_from_model(name, loaded.model), keep_idle=kv_sessions_idle)
        logger.info("draft %s ready (%s)", name, model or "prompt lookup, no model")

    async def needs_features(self) -> bool:
        """Whether proposals need the target's hidden states (a hidden-state-reuse head)."""
        return self._needs_features

    async def propose(self, session_id: str, context: list[int], ask: ProposeRequest,
                      params: SamplingParams) -> Proposal | NeedFeatures:
        """A proposal; or, for an HSR head that holds fewer of the session's target states than
        the call assumes (another replica had the session), ``NeedFeatures``: send them again."""
        if self._lookup is not None:   # an n-gram search: cheaper than a thread hand-off
            return propose(self._lookup, context, ask, params, None)
        return await self._worker.run(self._propose_lm, session_id, context, ask, params)

    def _propose_lm(self, session_id: str, context: list[int], ask: ProposeRequest,
                    params: SamplingParams) -> Proposal | NeedFeatures:
        draft = self.pool.acquire(session_id, context)
        generator = None
        if not params.greedy:
            # The draft's own randomness never changes the output distribution (the target's
            # rejection test corrects for q); a per-session seed only makes runs repeatable.
            generator = self._generators.get(session_id)
            if generator is None:
                # Bounded: a target that died never calls release(); its entry ages out here.
                while len(self._generators) >= MAX_GENERATORS:
                    self._generators.pop(next(iter(self._generators)))
                generator = self._generators[session_id] = params.generator()
        try:
            return propose(draft, context, ask, params, generator)
        except MissingFeatures as missing:
            return NeedFeatures(missing.have)

    async def release(self, session_id: str) -> None:
        """The session ended: its KV cache becomes an idle prefix cache."""
        self._generators.pop(session_id, None)
        if self.pool is not None:
            await self._worker.run(self.pool.release, session_id)

    def check_health(self) -> None:
        self._worker.check()


DraftDeployment = serve.deployment(
    ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64, health_check_period_s=10
)(DraftServer)
