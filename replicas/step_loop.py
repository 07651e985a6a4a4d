"""The one step loop: the served target replica, ``specserve generate`` and ``bench engine`` all
drive a ``Scheduler`` through it.

    plan = scheduler.plan()                                   # admit, prefill chunks, policy
    proposals = await each draft.propose_batch(its asks)      # one call per draft, concurrently
    work = worker.submit(scheduler.execute, plan, proposals)  # ONE verify forward for all
    deliver the previous step's tokens                        # while the forward runs
    await work

A draft is a ``DraftServer`` (in-process, or inside the target replica) or a draft deployment behind a Serve handle
(``remote_draft.RemoteDraft``, every call bounded in time); both answer ``info``, ``propose_batch`` and ``release``. A draft that fails costs
its requests their speculation (they go on with plain decoding), never the requests (docs/design.md §7).

Tokens reach their requests on the event loop's thread, never from the model thread
(``asyncio`` objects are not thread-safe), and after the next forward has started, so that a
served replica's streaming overlaps the model's work (with 16 requests on one-thread replicas
this changed throughput by nothing measurable: the point is thread safety).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace

from specserve.replicas.drafts.base import NeedFeatures, vocabulary_error
from specserve.replicas.request import AUTO_DRAFT, RequestState, SpecRequest, StepError, StreamItem
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.target import DEFAULT_FEATURE_LAYERS
from specserve.replicas.step import Proposal, ProposeRequest, Speculation, StepRecord

logger = logging.getLogger("ray.serve")


class StepLoop:
    def __init__(self, scheduler: Scheduler, drafts: dict, worker, clock: Callable[[], float] = time.perf_counter,
                 on_idle: Callable[[], Awaitable[None]] | None = None):
        """``drafts``: ``DraftServer`` or ``RemoteDraft`` by name. ``on_idle``: awaited each time
        the work runs out (the served replica gives freed memory back)."""
        self.scheduler = scheduler
        self.drafts = dict(drafts)
        self.worker = worker
        self._clock = clock
        self._info: dict[str, dict] = {}
        self._asked_every_draft = False
        self._disabled: dict[str, str] = {}   # draft -> why it is not used
        self._wake = asyncio.Event()
        self._draft_ms: dict[str, float] = {}   # this step's time per draft (they run concurrently)
        self.failures = 0                     # steps failed in a row (the replica's health reads it)
        self.last_error: str | None = None
        self.on_idle = on_idle
        # (emit, item) pairs the scheduler sent, from whichever thread, until _deliver hands them on.
        self._outbox: deque[tuple[Callable[[StreamItem], None], StreamItem]] = deque()

    def add(self, request: SpecRequest, emit: Callable[[StreamItem], None] | None = None) -> RequestState:
        """Queue ``request``; ``emit`` gets its items on the event loop's thread."""
        send = None if emit is None else (lambda item: self._outbox.append((emit, item)))
        state = self.scheduler.add(request, send)
        if state.speculating and request.draft not in (*self.drafts, AUTO_DRAFT):
            raise ValueError(f"unknown draft {request.draft!r}; this target knows: {', '.join(self.drafts) or 'none'}")
        self._wake.set()
        return state

    # ---- drafts ------------------------------------------------------------------------------

    async def draft_info(self, name: str) -> dict | None:
        """The draft's ``info`` (asked once), or None when the draft is unusable."""
        if name in self._disabled:
            return None
        if name not in self._info:
            info = await self.drafts[name].info()
            error = vocabulary_error(name, info.get("vocab_size"), self.scheduler.target.vocab)
            if error is not None:
                self._disabled[name] = error
                logger.error("%s; requests for it are decoded without speculation", self._disabled[name])
                return None
            if info.get("needs_features"):
                try:   # the target keeps the layers this draft reads from its next forward on
                    self.scheduler.target.tap_features(info.get("feature_layers") or DEFAULT_FEATURE_LAYERS)
                except ValueError as err:
                    self._disabled[name] = f"draft {name!r} reads hidden states this target lacks: {err}"
                    logger.error("%s; requests for it are decoded without speculation", self._disabled[name])
                    return None
            self._info[name] = info
        return self._info[name]

    async def _ask_every_draft(self) -> None:
        """Every draft's ``info`` before the first forward: a hidden-state-reuse draft's layers
        must be tapped while prompts are prefilled (a request routed to it after its prefill
        would otherwise have no states for its prompt). A draft that does not answer is asked
        again when a request first uses it."""
        self._asked_every_draft = True
        names = list(self.drafts)
        answers = await asyncio.gather(*(self.draft_info(name) for name in names), return_exceptions=True)
        for name, answer in zip(names, answers):
            if isinstance(answer, BaseException):
                logger.warning("draft %s: no info before the first step (%s: %s)", name, type(answer).__name__, answer)

    async def _propose(self, name: str, entries: list[tuple[RequestState, Speculation]]) -> dict[str, Proposal]:
        t0 = self._clock()
        try:
            return await self._proposals(name, entries)
        finally:
            self._draft_ms[name] = 1e3 * (self._clock() - t0)

    async def _proposals(self, name: str, entries: list[tuple[RequestState, Speculation]]) -> dict[str, Proposal]:
        draft = self.drafts[name]
        try:
            info = await self.draft_info(name)
            if info is None:
                raise RuntimeError(self._disabled[name])
            hsr = bool(info.get("needs_features"))
            layers = info.get("feature_layers") or DEFAULT_FEATURE_LAYERS
            pending = [(state, spec, state.features_sent if hsr else None) for state, spec in entries]
            out: dict[str, Proposal] = {}
            for _ in range(2):   # a draft replica that lacks a session's states asks once from where
                asks = [self.scheduler.propose_request(state, spec, start, layers) for state, spec, start in pending]
                if hsr:   # views of the target's buffers: send only the rows
                    asks = [ask if ask.features is None else replace(ask, features=ask.features.clone()) for ask in asks]
                replies = await draft.propose_batch(asks)
                retry = []
                for (state, spec, _), ask, reply in zip(pending, asks, replies):
                    if isinstance(reply, NeedFeatures):
                        retry.append((state, spec, reply.have))
                        continue
                    if ask.features is not None:
                        state.features_sent = ask.features_start + len(ask.features)
                    out[state.id] = reply
                pending = retry
                if not pending:
                    break
            return out
        except Exception as err:  # noqa: BLE001 - any draft failure degrades its requests to plain decoding
            logger.warning("draft %s failed (%s: %s); %d requests go on without speculation",
                           name, type(err).__name__, err, len(entries))
            for state, _ in entries:
                state.speculating = False
            return {}

    async def _release(self, sessions: list[tuple[str, str]]) -> None:
        """Free the draft sessions of (draft, request id) pairs."""
        by_draft: dict[str, list[str]] = {}
        for draft, request_id in sessions:
            if draft in self.drafts and draft not in self._disabled:
                by_draft.setdefault(draft, []).append(request_id)
        for name, ids in by_draft.items():
            try:
                await self.drafts[name].release(ids)
            except Exception as err:  # noqa: BLE001 - releasing only frees a cache
                logger.info("draft %s: release failed (%s)", name, err)

    # ---- the loop ----------------------------------------------------------------------------

    def _deliver(self) -> None:
        """Hand the items sent so far to their requests (deque: appended on the model thread,
        taken here in order)."""
        while self._outbox:
            emit, item = self._outbox.popleft()
            emit(item)

    async def step(self) -> StepRecord | None:
        plan = self.scheduler.plan()
        if plan.empty:
            self._deliver()
            return None
        if not self._asked_every_draft:
            await self._ask_every_draft()
        t0 = self._clock()
        proposals: dict[str, Proposal] = {}
        self._draft_ms: dict[str, float] = {}
        proposing = asyncio.gather(*(self._propose(name, entries) for name, entries in plan.asks.items()))
        self._deliver()
        for part in await proposing:
            proposals.update(part)
        work = self.worker.submit(self.scheduler.execute, plan, proposals, self._clock() - t0, self._draft_ms)
        self._deliver()   # the previous step's tokens stream while this step's forward runs
        record = await work
        # Sessions of finished requests, and of drafts a request switched away from.
        sessions = [(s.request.draft, s.id) for s in plan.decode if s.done] + self.scheduler.released
        self.scheduler.released = []
        if sessions:
            await self._release(sessions)
        return record

    async def run_until_idle(self) -> None:
        while self.scheduler.has_work:
            await self.step()
        self._deliver()

    async def serve_forever(self) -> None:
        """The replica's background task: step while there is work, sleep until there is."""
        while True:
            if not self.scheduler.has_work:
                self._deliver()
                self._wake.clear()          # before on_idle: a request added meanwhile still wakes us
                if self.on_idle is not None:
                    try:
                        await self.on_idle()
                    except Exception:  # noqa: BLE001 - idle housekeeping never stops the loop
                        logger.exception("the step loop's on_idle failed")
                await self._wake.wait()
            try:
                if await self.step() is not None:   # a step that ran (not one that only retired requests)
                    self.failures = 0
            except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the replica
                logger.exception("step failed; its requests end with an error")
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"
                for state in [*self.scheduler.running, *self.scheduler.waiting]:
                    state.fail(StepError(self.last_error))
                self._deliver()

