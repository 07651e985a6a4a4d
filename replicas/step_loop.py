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

**Drafting ahead** (docs/design.md §9). A draft that runs apart from the target's model thread
(its own deployment, or its own thread inside the replica) does not idle while the target
verifies: for each chain it proposed it drafts the next step at once, from the outcome that would
need it soonest, every token accepted, as PEARL's post-verify does ("PEARL: Parallel Speculative
Decoding with Adaptive Draft Length"): it is asked for γ + 1 tokens after the chain, the first
being its guess of the bonus token. When the verdict emits exactly the chain and that guess, the
rest is the next step's proposal and the step asks nothing. For a greedy request among few it
also drafts from a rejection at each of the chain's first positions, the target emitting there
the draft's runner-up. A chain drafted from an outcome the verdict was not is dropped, unused. A proposal drafted ahead is used only when the context it was drafted
from is the request's context, so verification, and the output, are as without it. A draft
ahead that is still running when the next step is planned is waited for at most one verify's
time, then dropped (that step of its request goes plain).

Tokens reach their requests on the event loop's thread, never from the model thread
(``asyncio`` objects are not thread-safe), and after the next forward has started, so that a
served replica's streaming overlaps the model's work (the reason is thread safety, not
throughput).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from specserve.replicas.drafts.base import NeedFeatures, vocabulary_error
from specserve.replicas.drafts.ensemble_carry import ending_of, released_counts
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.request import AUTO_DRAFT, RequestState, SpecRequest, StepError, StreamItem
from specserve.replicas.scheduler import Scheduler, StepPlan
from specserve.replicas.target import DEFAULT_FEATURE_LAYERS
from specserve.replicas.step import Proposal, ProposeRequest, Speculation, StepRecord

logger = logging.getLogger("ray.serve")


@dataclass
class AheadCounts:
    """What drafting ahead did: chains drafted ahead (one per outcome drafted from), and what
    became of them."""

    drafted: int = 0     # chains asked for while their step was verified
    used: int = 0        # the verdict was the outcome drafted from: the next step's proposal, not asked again
    used_after_rejection: int = 0   # of those, outcomes where the target rejected a draft token
    ruled_out: int = 0   # the verdict was another: dropped unused
    late: int = 0        # the verdict was its outcome but the draft had not answered within a verify's time

    def to_dict(self) -> dict:
        return {"drafted": self.drafted, "used": self.used, "used_after_rejection": self.used_after_rejection,
                "ruled_out": self.ruled_out, "late": self.late}


@dataclass
class _Ahead:
    """A chain drafted ahead for one request, from one outcome of the step being verified: the
    request's context as the step was planned (``start`` tokens), then ``tail``. With
    ``guesses_bonus`` the tail is the whole proposal and the chain's first token guesses the
    bonus; otherwise the tail is the accepted part and the emitted token the draft guessed for
    the rejected position, and the whole chain is the next step's."""

    draft: str
    session: str                 # the draft session it was drafted in (the reply's key)
    start: int
    tail: tuple[int, ...]
    guesses_bonus: bool
    task: asyncio.Task | None = None   # -> dict[session, Proposal]

    def holds(self, context: list[int]) -> bool:
        n = self.start + len(self.tail)
        return len(context) == n + self.guesses_bonus and tuple(context[self.start:n]) == self.tail


# Drafting ahead from rejections too: at most this many of a chain's first positions, for a step
# of at most AHEAD_REJECTION_REQUESTS of a draft's greedy requests (each outcome is a draft session
# of its own; a few requests can afford them, a full batch cannot).
AHEAD_REJECTIONS = 2
AHEAD_REJECTION_REQUESTS = 4
# The share of a verify's time drafting ahead may fill at the draft's measured pace.
AHEAD_SHARE = 0.8


def _median(values) -> float:
    """The upper median of a non-empty collection."""
    return sorted(values)[len(values) // 2]


def outcome_session(request_id: str, position: int) -> str:
    """The draft session that drafts ahead from a rejection at ``position`` of a request's chain."""
    return f"{request_id}#rejected-at-{position}"


# A proposal from a draft that runs apart is waited for at most the longer of one verify's time and
# LATE_SLACK times the draft's median call (its own pace, whatever the hardware), never less than
# MIN_DRAFT_WAIT_S; a draft with no call timed yet is waited for as long as its own deadline.
MIN_DRAFT_WAIT_S = 0.005
LATE_SLACK = 2.0
CALL_HISTORY = 32


class StepLoop:
    def __init__(self, scheduler: Scheduler, drafts: dict, worker, clock: Callable[[], float] = time.perf_counter,
                 on_idle: Callable[[], Awaitable[None]] | None = None, draft_ahead: bool = True,
                 on_draft_costs: Callable[[str, float, float], None] | None = None,
                 on_carried: Callable[[str, SpecRequest, dict[str, int]], None] | None = None):
        """``drafts``: ``DraftServer`` or ``RemoteDraft`` by name. ``on_idle``: awaited each time
        the work runs out (the served replica gives freed memory back). ``draft_ahead``: drafts
        that run apart from ``worker`` draft the next step while the target verifies.
        ``on_draft_costs(name, ms per drafted position, round trip ms)``: a draft deployment's
        costs, once it first answers: its own start-up probe, and the handle call measured from here.
        ``on_carried(draft, request, counts)``: what a finished request's draft session left to the
        cluster (a TABED ensemble's counts, checked), for the replica's statistics."""
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
        self.draft_ahead = draft_ahead
        self.ahead = AheadCounts()
        self._ahead: dict[str, list[_Ahead]] = {}     # request id -> the chains drafted ahead for it
        self._outcome_sessions: dict[str, set[tuple[str, str]]] = {}   # request id -> (draft, session) drafted ahead in
        self._verify_s: deque[float] = deque(maxlen=CALL_HISTORY)   # recent verifies' seconds, the last last
        self._chores: set[asyncio.Task] = set()   # releases waiting for a draft ahead to answer
        self.on_draft_costs = on_draft_costs
        self.on_carried = on_carried
        self._inflight: dict[str, asyncio.Task] = {}   # draft -> its step's call that came too late, still running
        self.late: dict[str, int] = {}   # draft -> request steps that went plain waiting for it
        self._call_s: dict[str, deque[float]] = {}   # draft -> its recent calls' seconds
        self._position_s: dict[str, deque[float]] = {}   # draft -> its recent calls' seconds per drafted position
        self.draft_costs: dict[str, dict] = {}    # draft deployment -> its measured costs

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
            elif isinstance(answer, dict) and hasattr(self.drafts[name], "round_trip_ms"):
                await self._price_remote(name, answer)

    async def _price_remote(self, name: str, info: dict) -> None:
        """A draft deployment's costs, from its own probe and a measured handle call: until a
        step uses it, nothing here measures it, and an unpriced draft is routed only to explore it."""
        try:
            ms = float(info.get("ms_per_position"))
            if not 0.0 <= ms < 1e4:
                raise ValueError(f"ms_per_position {ms!r} out of range")
            round_trip = await self.drafts[name].round_trip_ms()
        except (TypeError, ValueError) as err:
            logger.info("draft %s reports no usable cost (%s)", name, err)
            return
        except Exception as err:  # noqa: BLE001 - an unpriced draft is only explored, never predicted
            logger.warning("draft %s: its round trip could not be measured (%s: %s)", name, type(err).__name__, err)
            return
        self.draft_costs[name] = {"ms_per_position": round(ms, 3), "round_trip_ms": round(round_trip, 3)}
        logger.info("draft %s (its own deployment) costs %s", name, self.draft_costs[name])
        if self.on_draft_costs is not None:
            self.on_draft_costs(name, ms, round_trip)

    async def _propose(self, name: str, entries: list[tuple[RequestState, Speculation]]) -> dict[str, Proposal]:
        t0 = self._clock()
        try:
            return await self._proposals(name, entries)
        finally:
            seconds = self._clock() - t0
            self._draft_ms[name] = 1e3 * seconds
            self._call_s.setdefault(name, deque(maxlen=CALL_HISTORY)).append(seconds)
            positions = sum(spec.window if spec.tree is None else spec.tree.budget for _, spec in entries)
            if positions:
                self._position_s.setdefault(name, deque(maxlen=CALL_HISTORY)).append(seconds / positions)

    def _wait_limit(self, name: str) -> float | None:
        """How long this step waits for ``name``'s proposals (None: its own deadline)."""
        calls = self._call_s.get(name)
        if not calls:
            return None
        return max(self._last_verify_s, LATE_SLACK * _median(calls), MIN_DRAFT_WAIT_S)

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
                    state.carried_sent = True   # the draft has the sums, or never needed them
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

    # ---- drafting ahead ----------------------------------------------------------------------

    @property
    def _last_verify_s(self) -> float:
        """The last verify's seconds (0 before the first)."""
        return self._verify_s[-1] if self._verify_s else 0.0

    def runs_apart(self, name: str) -> bool:
        """Whether ``name`` drafts on hardware other than the target's model thread, and is a model
        draft that reads no target states: only then is there anything to overlap (a model-free
        draft answers in microseconds; a hidden-state-reuse draft needs states of tokens the
        target has not yet verified)."""
        draft = self.drafts[name]
        info = self._info.get(name)
        if info is None or info.get("needs_features") or info.get("vocab_size") is None:
            return False
        worker = getattr(draft, "worker", None)   # a DraftServer's; a draft deployment has none here
        return worker is not self.worker and not isinstance(worker, InlineWorker)

    def _ahead_budget(self, name: str) -> float:
        """Drafted positions that fit in one verify at the draft's measured pace (its recent calls'
        median seconds per position; a verify's time as yet unmeasured: none), times
        ``AHEAD_SHARE``: what drafting ahead may ask of it without the next step waiting. A verify
        lasts the shorter of the last one and the recent median: one preempted verify does not
        widen the budget, and a batch that shrank narrows it at once."""
        paces = self._position_s.get(name)
        if not paces or not self._verify_s:
            return 0.0
        verify_s = min(self._last_verify_s, _median(self._verify_s))
        return AHEAD_SHARE * verify_s / max(_median(paces), 1e-6)

    def _ahead_asks(self, plan: StepPlan, proposals: dict[str, Proposal]) -> dict[str, list[tuple[RequestState, ProposeRequest, _Ahead]]]:
        """The asks of drafting ahead, built before the step's forward changes any context, as many
        as fit in a verify at the draft's pace (``_ahead_budget``), likeliest first: for each chain,
        the outcome where every token is accepted (γ + 1 tokens, the first guessing the bonus);
        then, for greedy requests among few, a rejection at each of their first
        ``AHEAD_REJECTIONS`` positions in turn, the target emitting there the draft's runner-up."""
        out: dict[str, list] = {}
        if not self.draft_ahead:
            return out
        for name, entries in plan.asks.items():
            if not self.runs_apart(name):
                continue
            budget = self._ahead_budget(name)
            chains = []
            for state, spec in entries:
                proposal = proposals.get(state.id)
                if spec.tree is None and proposal is not None and proposal.tokens and proposal.is_chain:
                    chains.append((state, spec, proposal, self.scheduler.propose_request(state, spec)))
            asks = []
            for state, spec, proposal, base in chains:   # every token accepted
                if budget < spec.window + 1:
                    break
                budget -= spec.window + 1
                asks.append((state, replace(base, context=base.context + proposal.tokens, window=spec.window + 1,
                                            ahead=True),
                             _Ahead(name, state.id, len(base.context), tuple(proposal.tokens), True)))
            few = len(entries) <= AHEAD_REJECTION_REQUESTS
            for i in range(AHEAD_REJECTIONS if few else 0):   # a rejection at position i, the likelier first
                for state, spec, proposal, base in chains:
                    alternatives = proposal.alternatives or []
                    if not state.request.params.greedy or i >= len(alternatives) or alternatives[i] < 0:
                        continue
                    if budget < spec.window:
                        break
                    budget -= spec.window
                    tail = list(proposal.tokens[:i]) + [alternatives[i]]
                    session = outcome_session(state.id, i)
                    asks.append((state, replace(base, session_id=session, context=base.context + tail, ahead=True),
                                 _Ahead(name, session, len(base.context), tuple(tail), False)))
                    self._outcome_sessions.setdefault(state.id, set()).add((name, session))
            if asks:
                out[name] = asks
        if len(self._outcome_sessions) > 4 * len(self.scheduler.slots):   # requests that ended by a failed step
            running = {state.id for state in self.scheduler.running}
            self._outcome_sessions = {rid: v for rid, v in self._outcome_sessions.items() if rid in running}
        return out

    def _start_ahead(self, asks: dict[str, list[tuple[RequestState, ProposeRequest, _Ahead]]]) -> None:
        for name, entries in asks.items():
            task = asyncio.get_running_loop().create_task(self._draft_ahead(name, [ask for _, ask, _ in entries]))
            for state, _, ahead in entries:
                ahead.task = task
                self._ahead.setdefault(state.id, []).append(ahead)
                self.ahead.drafted += 1

    async def _draft_ahead(self, name: str, asks: list[ProposeRequest]) -> dict[str, Proposal]:
        try:
            replies = await self.drafts[name].propose_batch(asks)
        except Exception as err:  # noqa: BLE001 - a draft ahead that fails is only not used
            logger.info("draft %s: drafting ahead failed (%s: %s)", name, type(err).__name__, err)
            return {}
        return {ask.session_id: reply for ask, reply in zip(asks, replies) if isinstance(reply, Proposal)}

    async def _take_ahead(self, plan: StepPlan) -> dict[str, Proposal]:
        """The proposals drafted ahead that this step's requests can use, by request id: the
        verdict was the outcome one was drafted from (the whole chain and the guessed bonus, or the
        accepted part and the guessed token at the rejection), the request still asks that draft
        for a chain, and the draft answered within one verify's time."""
        pending, self._ahead = self._ahead, {}
        waiting: dict[str, tuple[_Ahead, Speculation, RequestState]] = {}
        for name, entries in plan.asks.items():
            for state, spec in entries:
                outcomes = pending.pop(state.id, [])
                held = next((a for a in outcomes if a.draft == name and spec.tree is None and a.holds(state.context)), None)
                self.ahead.ruled_out += len(outcomes) - (held is not None)
                if held is not None:
                    waiting[state.id] = (held, spec, state)
        self.ahead.ruled_out += sum(len(outcomes) for outcomes in pending.values())   # finished, or went plain
        tasks = {ahead.task for ahead, _, _ in waiting.values() if not ahead.task.done()}
        if tasks:
            await asyncio.wait(tasks, timeout=max(self._last_verify_s, 1e-3))
        used: dict[str, Proposal] = {}
        for request_id, (ahead, spec, state) in waiting.items():
            if not ahead.task.done():
                self.ahead.late += 1
                continue
            proposal = ahead.task.result().get(ahead.session)
            skip = 1 if ahead.guesses_bonus else 0
            if (proposal is None or len(proposal) <= skip or not proposal.is_chain
                    or (ahead.guesses_bonus and proposal.tokens[0] != state.context[-1])):
                self.ahead.ruled_out += 1
                continue
            used[request_id] = proposal.chain_from(skip, spec.window)
            self.ahead.used += 1
            self.ahead.used_after_rejection += not ahead.guesses_bonus
        return used

    async def _release(self, sessions: list[tuple[str, RequestState]]) -> None:
        """Free the draft sessions of (draft, request) pairs, and those the request drafted ahead
        from rejections in. What a request's own session leaves (a TABED ensemble's counts) comes
        back with the release, is checked (``ensemble_carry.released_counts``: another deployment's
        reply is input) and goes to ``on_carried``; a release that fails or is late costs only that."""
        by_draft: dict[str, list[str]] = {}
        leaving: dict[str, dict[str, RequestState]] = {}   # draft -> its requests' sessions, by id
        for draft, state in sessions:
            if draft in self.drafts and draft not in self._disabled:
                by_draft.setdefault(draft, []).append(state.id)
                leaving.setdefault(draft, {})[state.id] = state
            for name, session in self._outcome_sessions.pop(state.id, ()):
                if name in self.drafts and name not in self._disabled:
                    by_draft.setdefault(name, []).append(session)
        for name, ids in by_draft.items():
            # A request's own session learns from its final context (a TABED ensemble's last block).
            endings = {i: ending_of(state.context) for i, state in leaving.get(name, {}).items()}
            try:
                reply = await self.drafts[name].release(ids, endings)
            except Exception as err:  # noqa: BLE001 - releasing only frees a cache
                logger.info("draft %s: release failed (%s)", name, err)
                continue
            if self.on_carried is None or name not in leaving:
                continue
            for session_id, counts in released_counts(reply, list(leaving[name])).items():
                try:
                    self.on_carried(name, leaving[name][session_id].request, counts)
                except Exception:  # noqa: BLE001 - counting what a request left never fails a step
                    logger.exception("draft %s: the counts a finished request left were not taken", name)

    # ---- the loop ----------------------------------------------------------------------------

    def _deliver(self) -> None:
        """Hand the items sent so far to their requests (deque: appended on the model thread,
        taken here in order)."""
        while self._outbox:
            emit, item = self._outbox.popleft()
            emit(item)

    def unavailable(self) -> frozenset[str]:
        """Drafts that cannot propose now: disabled, a deployment marked down, or late with a
        call still running."""
        return frozenset({*self._disabled, *(n for n, d in self.drafts.items() if getattr(d, "down", False)),
                          *(n for n, task in self._inflight.items() if not task.done())})

    async def step(self) -> StepRecord | None:
        router = self.scheduler.router
        if router is not None and hasattr(router, "unavailable"):   # routed around before the plan
            router.unavailable = self.unavailable()
        plan = self.scheduler.plan()
        if plan.empty:
            self._deliver()
            return None
        if not self._asked_every_draft:
            await self._ask_every_draft()
        t0 = self._clock()
        self._draft_ms: dict[str, float] = {}
        proposals: dict[str, Proposal] = await self._take_ahead(plan) if self._ahead else {}
        asks = {name: rest for name, entries in plan.asks.items()
                if (rest := [(state, spec) for state, spec in entries if state.id not in proposals])}
        for name in plan.asks.keys() - asks.keys():
            self._draft_ms[name] = 0.0   # every proposal was drafted ahead: the step waited for none
        proposals.update(await self._proposals_in_time(asks))
        ahead = self._ahead_asks(plan, proposals)
        if ahead:   # the drafts start on their own hardware before this thread runs the forward
            self._start_ahead(ahead)
            await asyncio.sleep(0)
        t_verify = self._clock()
        work = self.worker.submit(self.scheduler.execute, plan, proposals, t_verify - t0, self._draft_ms)
        self._deliver()   # the previous step's tokens stream while this step's forward runs
        record = await work
        self._verify_s.append(self._clock() - t_verify)
        # Sessions of finished requests, and of drafts a request switched away from.
        sessions = [(s.request.draft, s) for s in plan.decode if s.done] + self.scheduler.released
        self.scheduler.released = []
        if sessions:
            await self._release_after_ahead(sessions)
        return record

    async def _proposals_in_time(self, asks: dict[str, list[tuple[RequestState, Speculation]]]) -> dict[str, Proposal]:
        """The step's proposals. A draft on the model thread is waited for (it runs there); one
        that runs apart, at most the longer of one verify's time and twice its usual call: later,
        its requests decode plainly this step, and it is not asked again until that call ends (its
        answer, for contexts gone by, is dropped), so a slow or stalled draft holds no step and
        gathers no queue of calls."""
        calls: dict[str, asyncio.Task] = {}
        for name, entries in asks.items():
            running = self._inflight.get(name)
            if running is not None and not running.done():
                self.late[name] = self.late.get(name, 0) + len(entries)
                continue
            calls[name] = asyncio.get_running_loop().create_task(self._propose(name, entries))
        self._deliver()
        if not calls:
            return {}
        limits = {name: self._wait_limit(name) for name in calls if self.runs_apart(name)}
        bounded = {name for name, limit in limits.items() if limit is not None}
        waited = [calls[name] for name in calls if name not in bounded]
        if waited:
            await asyncio.wait(waited)
        if bounded:
            await asyncio.wait([calls[name] for name in bounded], timeout=max(limits[name] for name in bounded))
        proposals: dict[str, Proposal] = {}
        for name, task in calls.items():
            if task.done():
                self._inflight.pop(name, None)
                proposals.update(task.result())
            else:
                self._inflight[name] = task
                self.late[name] = self.late.get(name, 0) + len(asks[name])
                self._draft_ms[name] = 1e3 * limits[name]
        return proposals

    async def _release_after_ahead(self, sessions: list[tuple[str, RequestState]]) -> None:
        """Free sessions now, or, where a draft ahead for the session is still running, once it
        answers (released first, the session would be made again by the late call)."""
        now, later = [], []
        for draft, state in sessions:
            running = [a.task for a in self._ahead.get(state.id, ()) if not a.task.done()]
            (later if running else now).append((draft, state))
        if now:
            await self._release(now)
        if later:
            tasks = {a.task for _, state in later for a in self._ahead[state.id] if not a.task.done()}
            chore = asyncio.get_running_loop().create_task(self._release_when(tasks, later))
            self._chores.add(chore)
            chore.add_done_callback(self._chores.discard)

    async def _release_when(self, tasks: set[asyncio.Task], sessions: list[tuple[str, RequestState]]) -> None:
        await asyncio.wait(tasks)
        await self._release(sessions)

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

