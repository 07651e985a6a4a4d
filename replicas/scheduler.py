"""The step scheduler of a target replica: every step verifies all of its running requests in one
target forward (continuous batching).

Requests are state machines with no threads of their own::

    waiting --admit (a free KV slot)--> prefilling --prompt cached--> running --EOS/max_tokens/cancel--> finished

Each step is split so that the same scheduler serves ``specserve generate``, ``bench engine`` and
the served replica (``replicas/step_loop.py`` drives it):

- ``plan()`` (cheap, no model work): retire finished requests, admit waiting ones into free slots,
  choose the prefill chunks of this step within ``prefill_chunk`` tokens, and ask the ``policy``
  for each running request's speculation; the plan lists what each draft must propose.
- the drafts propose (one call per draft per step, for all of its requests);
- ``execute(plan, proposals)`` (model work): prefill chunks, then ONE forward that verifies every
  running request, acceptance per request, tokens streamed to each request, a ``StepRecord``
  handed to the policy.

Prefill chunks run as their own forward rather than as rows of the verify forward: the verify
step is flat (no padding) only for feeds of up to ``cpu_attention.MAX_NEW_TOKENS`` (64) tokens; a
256-token chunk takes the padded layout, where beside twelve 5-token verify rows it would make
the forward compute 13 x 256 positions instead of 316. A decoding request waits at most one chunk.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from specserve.replicas.drafts.ensemble_carry import cluster_sums
from specserve.replicas.grammar import GrammarError, GrammarState
from specserve.replicas.model.kv_session import common_prefix_len
from specserve.replicas.request import (AUTO_DRAFT, NO_DRAFT, DraftRouter, Policy, RequestState, SpecRequest, StepError,
                                        StreamItem)
from specserve.replicas.step import PLAIN, Proposal, ProposeRequest, RequestStep, Speculation, StepRecord
from specserve.replicas.target import DEFAULT_FEATURE_LAYERS, GuideRow, Target, VerifyItem

logger = logging.getLogger("ray.serve")

# Prompt positions whose next token each prefill chunk scores, for the draft router's perplexity
# feature (``Target.prefill``).
PERPLEXITY_ROWS = 64
# A replica with this many requests in its batch (prefilling or decoding, the scored one
# included) scores none, and the router sees the perplexity as missing (a feature of its own):
# the output layer over 64 rows is a sizeable part of a one-thread prefill that every running
# request waits for (docs/benchmarks.md §2.2), and under load the goodput policy switches most
# speculation off whatever the router chose.
PERPLEXITY_BUSY = 4
# Tokens a grammar forces proposed in one step at most (a window's bound, ``openai_api.MAX_WINDOW``).
MAX_FORCED = 16


@dataclass
class StepPlan:
    prefill: list[tuple[RequestState, int]] = field(default_factory=list)   # (request, chunk tokens)
    decode: list[RequestState] = field(default_factory=list)
    speculation: dict[str, Speculation] = field(default_factory=dict)       # by request id
    asks: dict[str, list[tuple[RequestState, Speculation]]] = field(default_factory=dict)  # by draft
    copies: list[tuple[int, int, int]] = field(default_factory=list)   # (from slot, to slot, positions)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, target: Target, policy: Policy, eos_token_ids: frozenset[int] | set[int] = frozenset(),
                 prefill_chunk: int = 512, max_running: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, router: DraftRouter | None = None,
                 default_draft: str = NO_DRAFT, observers: Iterable[Callable[[StepRecord], None]] = (),
                 on_draft: Iterable[Callable[[RequestState, str | None], None]] = (),
                 grammar_tokenizer: Callable[[], object] | None = None, grammar_draft: bool = True):
        """``max_running``: requests in the batch at once (default: every slot); slots beyond it
        keep finished requests' caches as a prefix cache. ``router`` chooses the draft of
        ``AUTO_DRAFT`` requests; without one they get ``default_draft``. ``observers``: besides
        the policy and the router, whoever learns from every step's record (statistics, metrics).
        ``on_draft``: called with a request and its previous draft (None: its first) each time its
        draft is set or switched (the replica's warm start, statistics). ``grammar_tokenizer``:
        llguidance's tokenizer for requests with a grammar (``grammar.grammar_tokenizer``), made
        when the first such request comes; None: such requests are refused. ``grammar_draft``:
        the tokens a grammar forces are proposed as the step's draft."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target = target
        self.policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.max_running = min(max_running or target.slots, target.slots)
        self._clock = clock
        self.waiting: deque[RequestState] = deque()
        self.slots: list[RequestState | None] = [None] * target.slots
        self.records: deque[StepRecord] = deque(maxlen=256)
        self.router = router
        self.observers = [*([] if router is None else [router.observe]), *observers]
        self.default_draft = default_draft
        self.on_draft = list(on_draft)
        # (draft, request) whose draft sessions the step loop should free: the draft a request
        # switched away from keeps no KV cache.
        self.released: list[tuple[str, RequestState]] = []
        self.grammar_tokenizer = grammar_tokenizer
        self.grammar_draft = grammar_draft

    # ---- requests in and out ------------------------------------------------------------------

    def add(self, request: SpecRequest, emit: Callable[[StreamItem], None] | None = None) -> RequestState:
        limit = self.target.kv.max_len
        if len(request.prompt_ids) + request.max_tokens > limit:
            # Checked here too (the ingress checks first): admitted, it would fail every step it is in.
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) "
                             f"exceed this replica's limit of {limit} tokens; shorten the prompt or lower max_tokens")
        if request.guidance is not None:
            # Its unconditional row takes a second slot of the batch (and as many cache positions).
            if self.max_running < 2:
                raise ValueError("classifier-free guidance needs two rows of the batch; this replica runs one")
            if len(request.guidance.prompt_ids) + request.max_tokens > limit:
                raise ValueError(f"the unconditional prompt ({len(request.guidance.prompt_ids)} tokens) + max_tokens "
                                 f"({request.max_tokens}) exceed this replica's limit of {limit} tokens")
        state = RequestState(request, self.eos_token_ids, self.target.model.device, emit)
        if request.grammar is not None:
            if self.grammar_tokenizer is None:
                raise ValueError("this replica serves no structured output (it was given no grammar tokenizer)")
            produced = request.prompt_ids[len(request.prompt_ids) - request.resumed_tokens:]
            state.grammar = GrammarState(request.grammar, self.grammar_tokenizer(), produced,
                                         ends=state.stop_ids | self.eos_token_ids)
        self.waiting.append(state)
        self._caption(state)
        return state

    def _caption(self, state: RequestState) -> None:
        """A request drafted through a caption view: the VLM captions the pictures of its prompt
        it has not captioned yet, each an internal request queued now (``captions.py``)."""
        captions = getattr(self.target.images, "captions", None)
        if captions is not None and state.request.draft in captions.readers:
            for caption, sink in captions.requests(state.request.prompt_ids):
                self.waiting.append(RequestState(caption, self.eos_token_ids, self.target.model.device, sink))

    def set_draft(self, state: RequestState, draft: str) -> None:
        """``state`` speculates with ``draft`` from its next step (NO_DRAFT: plain decoding). The
        new draft starts its own session from the tokens (it was sent none of the target's
        states); the old one's session is freed, and with it the old draft's cluster prior."""
        old = state.request.draft
        if draft == old:
            return
        state.request = replace(state.request, draft=draft)
        if old != AUTO_DRAFT:   # the cluster's prior was the old draft's: none for the new one
            state.request = replace(state.request, prior_alpha=None, prior_learned=None)
        state.stats.draft = draft
        state.speculating = not state.request.speculation.plain
        state.features_sent = 0
        state.carried_sent = False
        if old not in (NO_DRAFT, AUTO_DRAFT):
            self.released.append((old, state))
        self._caption(state)
        for hook in self.on_draft if not state.request.internal else ():   # statistics count clients' requests
            hook(state, None if old == AUTO_DRAFT else old)

    def _route(self, decode: list[RequestState]) -> None:
        """Each request's draft once its prefill is done (the router's choice for ``AUTO_DRAFT``,
        the client's otherwise, which the router records), and the switches it asks for later.
        A router that fails costs the choice, never the request."""
        for state in decode:
            if not state.routed:
                state.routed = True
                draft = state.request.draft
                if self.router is not None and not state.request.internal:
                    draft = self._ask(self.router.route, state, len(decode)) or draft
                self.set_draft(state, self.default_draft if draft == AUTO_DRAFT else draft)
            elif self.router is not None and not state.request.internal:
                switch = self._ask(self.router.revisit, state, len(decode))
                if switch is not None:
                    self.set_draft(state, switch)

    @staticmethod
    def _ask(method, state: RequestState, batch_size: int) -> str | None:
        try:
            return method(state, batch_size)
        except Exception:  # noqa: BLE001 - routing is an optimisation: the request goes on without it
            logger.exception("draft router failed for request %s; it keeps its draft", state.id)
            return None

    def cancel(self, request_id: str, reason: str = "abort") -> None:
        """The request leaves at the next ``plan`` (a client gone, a deadline passed)."""
        for state in [*self.waiting, *self.running]:
            if state.id == request_id:
                state.finish(reason)

    @property
    def running(self) -> list[RequestState]:
        """Requests holding slots, each once (a guided request holds two)."""
        return [s for i, s in enumerate(self.slots) if s is not None and s.slot == i]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    # ---- planning -----------------------------------------------------------------------------

    def _retire(self) -> None:
        for i, state in enumerate(self.slots):
            if state is not None and state.done:
                self.slots[i] = None
                if self.router is not None and not state.request.internal and state.slot == i:
                    self._ask(lambda s, _: self.router.finish(s), state, 0)
        self.waiting = deque(s for s in self.waiting if not s.done)
        # Keep busy slots dense from 0: the verify forward's batch is the range of busy slots.
        while True:
            free = [i for i, s in enumerate(self.slots) if s is None]
            busy = [i for i, s in enumerate(self.slots) if s is not None]
            if not free or not busy or free[0] > busy[-1]:
                return
            self._move(busy[-1], free[0])

    def _move(self, src: int, dst: int) -> None:
        state = self.slots[src]
        self.target.swap(src, dst)
        self.slots[dst], self.slots[src] = state, None
        if state.slot == src:
            state.slot = dst
        else:   # its unconditional row
            state.guide_slot = dst

    def _admit(self) -> None:
        while self.waiting:
            free = [i for i, s in enumerate(self.slots) if s is None]
            rows = self.waiting[0].rows
            if len(free) < rows or len(self.slots) - len(free) + rows > self.max_running:
                return
            state = self.waiting.popleft()
            # The free slot whose cache shares the longest prefix with the prompt is a prefix
            # cache (a follow-up turn, a repeated prompt, a shared system prompt); bring it to the
            # lowest free slot so busy slots stay dense, the cache there going where it was.
            # Only a cache of the same salt counts; another salt's is cleared, never read. With
            # nothing shared, the slot holding least is given up (an empty one first), so that a
            # new prompt does not push out a longer cache.
            kv, salt = self.target.kv, state.request.cache_salt

            def shared(i: int) -> int:
                return common_prefix_len(kv.tokens[i], state.context) if kv.salts[i] == salt else 0

            best = max(free, key=lambda i: (shared(i), -len(kv.tokens[i]), -i))
            if best != free[0]:
                self.target.swap(best, free[0])
            kv.claim(free[0], salt)
            state.slot = free[0]
            self.slots[free[0]] = state
            if state.request.guidance is not None:   # its unconditional row: the next free slot
                guide = free[1]
                kv.claim(guide, salt)
                state.guide_slot = guide
                self.slots[guide] = state

    def plan(self) -> StepPlan:
        self._retire()
        self._admit()
        plan = StepPlan()
        budget = self.prefill_chunk
        prefilling: list[RequestState] = []   # requests ahead in this step whose prefill is under way
        copied: set[int] = set()
        for state in self.running:
            if state.prefilled:
                plan.decode.append(state)
                continue
            if state.cached_tokens is None and self._waits_or_copies(state, prefilling, copied, plan):
                continue
            prefilling.append(state)
            if budget > 0:
                plan.prefill.append((state, budget))
                budget -= min(budget, len(state.context) - 1)
        self._route(plan.decode)
        for state in plan.decode:
            spec = self._within_cache(state, state.cap(self.policy.choose(state, len(plan.decode))))
            plan.speculation[state.id] = spec
            if not spec.plain:
                plan.asks.setdefault(state.request.draft, []).append((state, spec))
        return plan

    def _within_cache(self, state: RequestState, spec: Speculation) -> Speculation:
        """A tree's nodes hold cache positions past the context until the verify keeps their
        accepted path: at most as many as the slot has left (a chain's window, capped by the
        tokens left to generate, always fits), or the step would fail for every request in it."""
        if spec.tree is None:
            return spec
        used = len(state.context) if state.guide_slot is None else max(len(state.context), len(state.guide_context))
        left = self.target.kv.max_len - used
        if left < 1:
            return PLAIN
        if spec.tree.budget <= left:
            return spec
        return Speculation(0, replace(spec.tree, budget=left, depth=min(spec.tree.depth, left)))

    def _waits_or_copies(self, state: RequestState, prefilling: list[RequestState], copied: set[int],
                         plan: StepPlan) -> bool:
        """A prompt is prefilled once however many requests share it (a request's ``n`` choices, a
        repeated prompt, a long common system prompt): a request about to start its prefill takes
        the longest prefix of its prompt that a running request's slot holds (a copy of those KV
        rows, far cheaper than computing them), and waits (True) while a request ahead of it is
        still prefilling at least half of what it would compute. Only a cache of the same salt
        counts; a request that wants every prompt row's log-probabilities computes its own."""
        if state.request.prompt_logprobs is not None or state.request.guidance is not None:
            return False
        kv, salt = self.target.kv, state.request.cache_salt
        prompt = state.context[:-1]
        donor, best = None, common_prefix_len(kv.tokens[state.slot], prompt)
        for other in self.running:
            if other is not state and other.slot not in copied and kv.salts[other.slot] == salt:
                shared = common_prefix_len(kv.tokens[other.slot], prompt)
                if shared > best:
                    donor, best = other.slot, shared
        ahead = max((common_prefix_len(other.context[:-1], prompt) for other in prefilling
                     if other.request.cache_salt == salt), default=0)
        if ahead - best >= max(1, (len(prompt) - best) // 2):
            return True
        if donor is not None:
            plan.copies.append((donor, state.slot, best))
            copied.add(state.slot)
        return False

    def propose_request(self, state: RequestState, spec: Speculation, features_from: int | None = None,
                        feature_layers=DEFAULT_FEATURE_LAYERS) -> ProposeRequest:
        """The ask for ``state``'s draft; a hidden-state-reuse draft also gets the target states
        of ``feature_layers`` (its config's, side by side) from ``features_from`` (None: no states),
        and until the draft has answered one, an ensemble the cluster's carried sums."""
        features = None
        start = 0
        if features_from is not None:
            start = features_from
            features = self.target.features(state.context, start, state.slot, feature_layers)
        carried = None if state.carried_sent else cluster_sums(state.request.prior_learned)
        return ProposeRequest(state.id, state.context, spec.window, spec.tree, state.request.params,
                              state.draft_seed, features, start, state.request.cache_salt,
                              state.request.image_placeholder, carried)

    # ---- model work ---------------------------------------------------------------------------

    @staticmethod
    def _guide(state: RequestState) -> GuideRow | None:
        guidance = state.request.guidance
        if guidance is None:
            return None
        return GuideRow(state.guide_slot, state.guide_context, guidance.scale, guidance.vocab)

    def _grammar_drafts(self, live: list[RequestState], proposals: dict[str, Proposal]) -> dict[str, int]:
        """Where a request's grammar forces its next tokens, those are its proposal
        (``GrammarState.with_forced``); returns how many each such proposal holds."""
        forced: dict[str, int] = {}
        for state in live:
            wanted = state.request.grammar_draft
            if state.grammar is None or state.room <= 0 or not (self.grammar_draft if wanted is None else wanted):
                continue
            try:
                proposal, n = state.grammar.with_forced(proposals.get(state.id, Proposal.empty()),
                                                        min(MAX_FORCED, state.room))
            except GrammarError:   # the verify fails this request alone, with the reason
                continue
            if n:
                proposals[state.id], forced[state.id] = proposal, n
        return forced

    def execute(self, plan: StepPlan, proposals: dict[str, Proposal], draft_s: float = 0.0,
                draft_ms_by: dict[str, float] | None = None) -> StepRecord:
        """Prefill chunks, then one forward verifying every running request; streams each
        request's new tokens and hands the step's record to the policy."""
        t0 = self._clock()
        prefilled = 0
        # The router's perplexity feature costs an output layer over PERPLEXITY_ROWS rows in the
        # prefill, which every running request waits for: a busy replica scores none.
        score_rows = PERPLEXITY_ROWS if self.router is not None and len(self.running) < PERPLEXITY_BUSY else 0
        for src, dst, length in plan.copies:
            self.target.copy_prefix(src, dst, length)
        for state, chunk in plan.prefill:
            if state.done:
                continue
            scored = 0 if state.request.draft == NO_DRAFT else score_rows   # no draft: no router choice to feed
            asked = state.request.prompt_logprobs
            began = self._clock()
            if asked is not None and state.cached_tokens is None:
                # Every prompt position's row is wanted: a cached prefix would skip them.
                self.target.kv.crop(state.slot, 0)
            done = self.target.prefill(state.slot, state.context[:-1], chunk, state.context[-1], scored, asked)
            guide_left = 0
            if state.guide_slot is not None:   # the unconditional row's prompt, chunk for chunk
                guide = state.guide_context
                guide_left = self.target.prefill(state.guide_slot, guide[:-1], chunk, guide[-1]).left
            if asked is not None:
                state.prompt_logprobs.extend(done.logprobs)
            prefilled += done.fed
            if state.cached_tokens is None:   # the first chunk: what the slot already held
                state.cached_tokens = len(state.context) - 1 - done.fed - done.left
            state.prompt_nll += done.nll
            state.prompt_scored += done.scored
            state.prefilled = done.left == 0 and guide_left == 0
            state.stats.prefill_s += self._clock() - began
        t1 = self._clock()
        live = [s for s in plan.decode if not s.done]
        forced = self._grammar_drafts(live, proposals)
        items = [VerifyItem(s.slot, s.context, proposals.get(s.id, Proposal.empty()), s.request.params, s.generator,
                            s.processors, s.request.logprobs, s.grammar, self._guide(s), s.request.lantern) for s in live]
        forward_tokens = 0
        results = self.target.verify(items) if items else []
        t2 = self._clock()
        steps: list[RequestStep] = []
        per_request_draft_s = draft_s / len(live) if live else 0.0
        for state, item, result in zip(live, items, results):
            forward_tokens += 1 + len(item.proposal)
            if result.error is not None:   # its own rows could not be sampled: it fails, the step goes on
                logger.warning("request %s failed alone: %s", state.id, result.error)
                state.fail(StepError(result.error, request_fault=True))
                continue
            state.stats.draft_s += per_request_draft_s
            state.stats.verify_s += t2 - t1
            if result.proposal_error is not None:
                state.stats.proposal_errors += 1
            asked = plan.speculation.get(state.id, PLAIN)
            if asked.tree is not None:   # the response's spec says which trees the policy asked for
                state.stats.trees.append([asked.tree.depth, asked.tree.top_k, asked.tree.budget])
            if forced.get(state.id):   # the grammar's tokens, not the draft's: its statistics do not see them
                state.stats.forced += forced[state.id]
                state.stats.forced_accepted += result.accepted
                result = replace(result, proposed=0, accepted=0, accepted_path=[], max_depth=0)
            new = state.advance(result)
            logprobs = None if result.logprobs is None else result.logprobs[:len(new)]
            if logprobs is not None:
                state.logprobs.extend(logprobs)
            prompt_logprobs = None
            if state.prompt_logprobs is not None and not state.prompt_logprobs_sent:
                prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
            state.send(StreamItem(new, state.finish_reason, cached_tokens=(state.cached_tokens or 0) if state.done else 0,
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs))
            steps.append(RequestStep(
                request_id=state.id, draft=state.request.draft, asked=plan.speculation.get(state.id, PLAIN),
                proposed=result.proposed, accepted=result.accepted, max_depth=result.max_depth,
                draft_token_probs=tuple(item.proposal.token_probs) if item.proposal.token_probs else None,
                draft_root_probs=tuple(item.proposal.root_probs) if item.proposal.root_probs else None,
            ))
        record = StepRecord(
            batch_size=len(live), forward_tokens=forward_tokens, prefill_tokens=prefilled,
            draft_ms=1e3 * draft_s, verify_ms=1e3 * (t2 - t1), prefill_ms=1e3 * (t1 - t0), requests=tuple(steps),
            draft_ms_by=tuple(sorted((draft_ms_by or {}).items())),
        )
        self.records.append(record)
        self.policy.observe(record)
        for observe in self.observers:
            observe(record)
        return record

