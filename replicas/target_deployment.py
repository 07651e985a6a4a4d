"""The target as a Ray Serve deployment; the speculation loop of a request runs here.

Why here: each step needs the draft's proposal and the target's verify. Driven from the ingress,
a step would cost two handle calls (~2.5 ms each on these machines, against a 25-40 ms step);
driven from the target replica it costs one, the call to the draft, while the tokens stream
back to the ingress asynchronously, off the step's critical path.

A draft replica that fails mid-request costs speed, never the request: the session goes on with
plain decoding (DESIGN.md §7).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts.hsr_draft import NeedFeatures
from specserve.replicas.model_store import load_causal_lm
from specserve.replicas.model_worker import ModelWorker
from specserve.replicas.session_pool import SessionPool
from specserve.replicas.step import Proposal
from specserve.replicas.target import Target
from specserve.router.session import SpecRequest, SpecSession

logger = logging.getLogger("ray.serve")


class _LocalCall:
    def __init__(self, method):
        self._method = method

    def remote(self, *args) -> asyncio.Future:
        return asyncio.ensure_future(self._method(*args))


class ColocatedDraft:
    """A DraftServer inside this replica, called like a deployment handle (``.propose.remote``)."""

    def __init__(self, server: DraftServer):
        self.propose = _LocalCall(server.propose)
        self.release = _LocalCall(server.release)
        self.needs_features = _LocalCall(server.needs_features)

    def options(self, **_) -> "ColocatedDraft":
        return self


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16, health_check_period_s=10)
class TargetDeployment:
    def __init__(self, model: str, drafts: dict[str, DeploymentHandle | dict], dtype: str = "auto",
                 torch_threads: int | None = None, kv_sessions_idle: int = 4):
        """``drafts``: a handle per draft deployment, or the ``DraftSpec`` fields of a colocated draft."""
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.loaded = load_causal_lm(model, dtype=dtype)
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.pool = SessionPool(lambda: Target(self.loaded.model), keep_idle=kv_sessions_idle)
        # One forward at a time: concurrent requests interleave step by step instead of
        # oversubscribing the cores, and the event loop stays free. Colocated drafts share it.
        self._worker = ModelWorker("target")
        self.drafts = {
            name: ColocatedDraft(DraftServer(name, d["model"], dtype, kv_sessions_idle=kv_sessions_idle,
                                             worker=self._worker)) if isinstance(d, dict) else d
            for name, d in drafts.items()
        }
        self._needs_features: dict[str, bool] = {}   # per draft, asked on first use
        logger.info("target %s ready on %s (%s, %d threads), drafts: %s", model, self.loaded.model.device,
                    self.loaded.model.dtype, torch.get_num_threads(), ", ".join(drafts) or "none")

    async def generate(self, request: SpecRequest) -> AsyncIterator[dict]:
        """Yields ``{"token_ids": [...]}`` per step; the last item also carries ``finish_reason``
        and ``spec`` (the statistics summary)."""
        session = SpecSession(request.prompt_ids, request.max_tokens, request.draft, request.window,
                              request.tree, self.eos_token_ids)
        draft = self.drafts.get(request.draft) if session.speculating else None
        if session.speculating and draft is None:
            raise ValueError(f"unknown draft {request.draft!r}; this target knows: {', '.join(self.drafts) or 'none'}")
        if draft is not None:
            # Same session, same draft replica: its KV cache is warm (any replica would be correct).
            draft = draft.options(session_id=request.session_id)
        params = request.params
        generator = None if params.greedy else params.generator()
        target = await self._worker.run(self.pool.acquire, request.session_id, request.prompt_ids)
        try:
            stats = session.stats
            needs_features = False
            if draft is not None:
                try:
                    needs_features = await self._draft_needs_features(request.draft, draft)
                except Exception as err:  # noqa: BLE001 - a draft that cannot answer: plain decoding
                    logger.warning("draft %s failed (%s: %s); session %s goes on without speculation",
                                   request.draft, type(err).__name__, err, request.session_id)
                    session.stop_speculating()
            sent = 0   # the target states the draft has been sent for this session
            while not session.done:
                ask = session.next_ask()
                proposal = Proposal.empty()
                t0 = time.perf_counter()
                if ask is not None:
                    try:
                        if needs_features:
                            proposal, sent = await self._propose_with_features(
                                draft, request.session_id, session.context, ask, params, target, sent)
                        else:
                            proposal = await draft.propose.remote(request.session_id, session.context, ask, params)
                    except Exception as err:  # noqa: BLE001 - any draft failure degrades to plain decoding
                        logger.warning("draft %s failed (%s: %s); session %s goes on without speculation",
                                       request.draft, type(err).__name__, err, request.session_id)
                        session.stop_speculating()
                t1 = time.perf_counter()
                result = await self._worker.run(target.verify, session.context, proposal, params, generator)
                stats.draft_s += t1 - t0
                stats.verify_s += time.perf_counter() - t1
                item = {"token_ids": session.advance(result)}
                if session.done:
                    item.update(finish_reason=session.finish_reason, spec=session.stats.summary())
                yield item
        finally:
            await self._worker.run(self.pool.release, request.session_id)
            if draft is not None:
                draft.release.remote(request.session_id)   # fire and forget: only frees a cache

    async def _draft_needs_features(self, name: str, draft) -> bool:
        if name not in self._needs_features:
            self._needs_features[name] = bool(await draft.needs_features.remote())
        return self._needs_features[name]

    @staticmethod
    async def _propose_with_features(draft, session_id: str, context: list[int], ask, params, target: Target,
                                     sent: int) -> tuple[Proposal, int]:
        """An HSR draft's proposal: the call carries the target states the draft has not been sent
        (a step's accepted positions, a few rows); a draft replica that lacks earlier ones says
        from where, and gets them once more. Returns the proposal and the new ``sent``."""
        for _ in range(2):
            rows = target.features(context, sent)
            ask = replace(ask, features=None if rows is None else rows.clone(), features_start=sent)
            reply = await draft.propose.remote(session_id, context, ask, params)
            if not isinstance(reply, NeedFeatures):
                return reply, sent + (0 if rows is None else len(rows))
            sent = reply.have
        raise RuntimeError(f"the draft keeps asking for target states from {sent}")

    def check_health(self) -> None:
        self._worker.check()
