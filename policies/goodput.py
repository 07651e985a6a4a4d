"""Speculation only where it pays at the replica's current load (goodput).

At batch 1 a CPU verifies 5 tokens for about the price of 1, so drafting is nearly free; at
batch 12 the forward feeds 60 tokens instead of 12 and costs several times more, while a draft
with α ≈ 0.3 adds only ~0.4 tokens per request per step. This policy wraps another one and, per
request and step, shrinks its window to the one that pays most at the replica's load, or to none:

    cost model     verify_ms ≈ a + b · forward_tokens      (least squares over recent steps of the
                                                             same load bucket, else over all of them)
                   d̂ = the draft's call per request that drafted with it and per drafted position
                       (recent steps' mean of its ms / its requests / the positions it drafted;
                       ~0 for prompt lookup)
    acceptance     α̂ per request over its own steps with its draft, Σn / (Σn + Σ1[n < γ]) (Eq. 2 of
                   "A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in Large
                   Language Models"), with a prior of ``request_prior_steps`` pseudo-steps: the α
                   the router chose the draft on for this prompt, else the cluster's α for the
                   prompt's task (its warm start's, ``SpecRequest.prior_alpha``), else the draft's
                   α̂ over the replica's recent steps, which mixes whatever tasks it is serving
    net(γ)         E(γ) − 1 − (1 + margin) · B / (a + b·B) · (b·γ + d̂·γ),   E(γ) = (1 − α̂^(γ+1)) / (1 − α̂)
    window         argmax over γ in 1..γ_asked of net(γ) if it is positive, else plain decoding

net(γ) is what one request's γ draft tokens add to the step: the tokens it emits beyond a plain
step's one, minus what the extra time (its γ tokens in the forward, its share of the draft's
call, which the whole step waits for) would have emitted decoding plainly at the step's rate.
The verify forward is flat (each request feeds only its own tokens, ``batch_kv``), so one
request's window costs b·γ and the others' rows are untouched; with every request speculating
at γ with one draft of call time d (d̂ = d / B) it is the whole-batch rule
E(γ)·B / (d + a + b·B·(1 + γ)) > B / (a + b·B) (without the margin). A request alone with a draft
model pays the whole call, because the whole step waits for the call it made. A busy step prices
every token at the step's high rate, so windows shrink with load and a large window needs a higher
α to pay than a small one. A tree is kept whole (priced at its node budget) or dropped.

The replica's start-up probe (``replicas/cost_probe.py``) gives the first verify points and draft
costs (``seed_costs``), so that the first requests are priced by measurement, not by nothing.

A request whose client pinned its window or tree keeps it. Until both are measured it speculates
(α̂ counts as measured after ``min_steps`` drafting steps of the draft, or at once when requests
bring the cluster's prior: one empty first step of prompt lookup must not switch it off, or a
short request would decode plainly to its end).

Exploring: once speculation is off, α̂ is no longer observed, and a draft that started to pay
(the workload changed) would stay off. So a request that decodes plainly earns credit,
``explore_share`` of its share of each step's time, and speculates at its asked window when the
credit covers that window's price (b·tokens fed + its share of the draft's call): at most that
share of the verify time goes to exploring, spread over the requests one at a time, because a
step that explores many requests at once is several times slower than its neighbours (figures:
docs/benchmarks.md §4.3).

Why a line per load bucket (b1, b4, b8, b8+ requests in the step, ``stats.load_bucket``): one line
through steps of every batch size underprices the extra tokens of a large batch, whose forward is
past the size at which the CPU's matrix products stop being flat (docs/benchmarks.md §4.3). Within
a bucket the line is local.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import replace

from specserve.policies.load_lines import LoadLines
from specserve.policies.window import estimate_alpha
from specserve.replicas.request import RequestState
from specserve.replicas.step import PLAIN, Speculation, StepRecord


def expected_emitted(alpha: float, window: int) -> float:
    """E(γ): tokens a chain step of γ drafts emits at per-token acceptance α (bonus included)."""
    if alpha >= 1.0:
        return window + 1.0
    return (1.0 - alpha ** (window + 1)) / (1.0 - alpha)


class GoodputPolicy:
    def __init__(self, base, history_steps: int = 64, explore_share: float = 0.01, alpha_max: float = 0.95,
                 min_steps: int = 8, margin: float = 0.1, rng: random.Random | None = None):
        self.base = base
        # Speculate only when the model predicts ``margin`` more tokens/s than plain decoding: its
        # cost model leaves out what grows with the tokens fed besides the forward (acceptance,
        # sampling, KV copies), so near break-even speculating loses to plain decoding under load.
        self.margin = margin
        self.min_steps = min_steps
        if not 0.0 <= explore_share < 1.0:
            raise ValueError(f"explore_share is a fraction of the verify time in [0, 1), got {explore_share}")
        self.explore_share = explore_share
        self._credit: dict[str, float] = {}   # request id -> exploring credit (ms), plainly decoding requests
        self.alpha_max = alpha_max
        self._lines = LoadLines(history_steps)   # verify ms by forward tokens, per load bucket
        self._outcomes: dict[str, deque[tuple[int, int]]] = {}                 # draft -> (n, γ) per step
        # draft -> per step, its call's ms per request that drafted with it and per drafted position
        self._draft_share: dict[str, deque[float]] = {}
        self._history = history_steps
        # A request's first credit is a random part of its window's price, so that requests that
        # arrived together do not all explore in the same step.
        self.rng = rng if rng is not None else random.Random()
        # The cluster's α per draft (from requests that came with the policy service's prior),
        # counted as ``prior_steps`` pseudo-steps: a replica's first unlucky steps do not switch
        # a good draft off.
        self._prior: dict[str, float] = {}
        self.prior_steps = 8
        # (request id, draft) -> (n, γ) per step: a request's own acceptance, because prompts
        # differ widely and a replica-wide α̂ would switch a draft off for the prompt the router
        # chose it for after another prompt it served badly.
        self._by_request: dict[tuple[str, str], deque[tuple[int, int]]] = {}
        self.request_prior_steps = 4

    def alpha(self, draft: str) -> float | None:
        prior = self._prior.get(draft)
        if prior is None and len(self._outcomes.get(draft, ())) < self.min_steps:
            return None
        return estimate_alpha(self._outcomes.get(draft, ()), self.alpha_max,
                              None if prior is None else (prior, self.prior_steps))

    def request_alpha(self, state: RequestState) -> float | None:
        """α̂ of ``state``'s draft for this request: its own steps, with the router's α for it,
        else its task's from the cluster, else the replica's α̂ as the prior; None while there is
        neither a prior nor ``min_steps`` of its own."""
        draft = state.request.draft
        own = self._by_request.get((state.id, draft), ())
        prior = next((a for a in (state.expected_alpha, state.request.prior_alpha) if a is not None), None)
        if prior is None:
            prior = self.alpha(draft)
        if prior is None:
            return estimate_alpha(own, self.alpha_max) if len(own) >= self.min_steps else None
        return estimate_alpha(own, self.alpha_max, (prior, self.request_prior_steps))

    def cost_model(self, batch_size: int | None = None) -> tuple[float, float] | None:
        """(a, b) of verify_ms ≈ a + b · tokens at ``batch_size``'s load bucket (``LoadLines``);
        None until recent steps have spanned two sizes."""
        return self._lines.line(batch_size)

    def gains(self, draft: str, window: int, batch_size: int, fed: int | None = None,
              alpha: float | None = None) -> list[float] | None:
        """net(γ) for γ = 1..``window`` (index γ - 1) for one request of a step of ``batch_size``;
        ``fed``: the tokens a window of ``window`` feeds (a tree's node budget; a chain's window);
        ``alpha``: the request's (default: the draft's over the replica). None while the policy
        has not measured α and the costs."""
        alpha, model = alpha if alpha is not None else self.alpha(draft), self.cost_model(batch_size)
        if alpha is None or model is None:
            return None
        a, b = model
        d = self.draft_ms_per_position(draft)
        step_rate = batch_size / (a + b * batch_size)     # tokens/ms of the step decoding plainly
        per_window_token = (fed or window) / window        # tokens fed per window position
        # Tokens this request gains over a plain step, minus what its extra time (g tokens fed,
        # its share of the draft's call) would emit decoding plainly.
        return [expected_emitted(alpha, g) - 1.0 - (1.0 + self.margin) * step_rate * (b * g * per_window_token + d * g)
                for g in range(1, window + 1)]

    def draft_ms_per_position(self, draft: str) -> float:
        """d̂: the ms of ``draft``'s call per request that drafted with it, per position drafted
        (recent steps' mean). A model draft runs one forward per position, so a shorter window
        drafts for less (a per-call price would make a long window look as cheap as a short one)."""
        measured = self._draft_share.get(draft)
        return sum(measured) / len(measured) if measured else 0.0

    def explores(self, request_id: str, draft: str, fed: int, positions: int, batch_size: int) -> bool:
        """Whether a request the costs switched off speculates this step anyway (it earns
        ``explore_share`` of its share of the step each time it is asked; a window of ``fed``
        tokens over ``positions`` drafted positions costs b·fed + its share of the draft's call)."""
        a, b = self.cost_model(batch_size) or (0.0, 0.0)
        price = b * fed + self.draft_ms_per_position(draft) * positions
        credit = self._credit[request_id] if request_id in self._credit else self.rng.random() * price
        credit += self.explore_share * (a + b * batch_size) / batch_size
        explore = self.explore_share > 0 and credit >= price
        self._credit[request_id] = credit - price if explore else credit
        return explore

    def window_for(self, draft: str, window: int, batch_size: int, alpha: float | None = None) -> int:
        """The chain window in 0..``window`` that pays most for one request (0: decode plainly)."""
        net = self.gains(draft, window, batch_size, alpha=alpha)
        if net is None:
            return window
        best = max(range(1, window + 1), key=lambda g: (net[g - 1], -g))
        return best if net[best - 1] > 0 else 0

    def pays(self, draft: str, window: int, batch_size: int) -> bool:
        return self.window_for(draft, window, batch_size) > 0

    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        spec = self.base.choose(state, batch_size)
        if spec.plain or state.request.pinned:
            return spec
        if state.request.prior_alpha is not None:
            self._prior[state.request.draft] = state.request.prior_alpha
        draft = state.request.draft
        alpha = self.request_alpha(state)
        if spec.tree is not None:   # a tree is not shrunk here: kept whole if it pays, else dropped
            shape = spec.tree
            net = self.gains(draft, shape.depth, batch_size, shape.budget, alpha)
            if net is None or net[-1] > 0:
                return spec
            fed, positions = shape.budget, shape.depth
        else:
            window = self.window_for(draft, spec.window, batch_size, alpha)
            if window > 0:
                return replace(spec, window=window)
            fed = positions = spec.window
        return spec if self.explores(state.id, draft, fed, positions, batch_size) else PLAIN

    def seed_costs(self, verify: tuple[tuple[int, float], ...], draft_ms_per_position: dict[str, float],
                   loaded: tuple = ()) -> None:
        """Costs measured before any step: batch-1 verify (forward tokens, ms) points, each draft's
        ms per drafted position, and ``loaded``: (batch size, verify points) pairs; the replica's
        steps push them out of the history."""
        for tokens, ms in verify:
            self._lines.add(1, tokens, ms)
        for batch_size, points in loaded:
            for tokens, ms in points:
                self._lines.add(batch_size, tokens, ms)
        for draft, ms in draft_ms_per_position.items():
            self._draft_share.setdefault(draft, deque(maxlen=self._history)).append(ms)

    def observe(self, record: StepRecord) -> None:
        self.base.observe(record)
        if record.batch_size:
            self._lines.add(record.batch_size, record.forward_tokens, record.verify_ms)
        # Credit belongs to requests still in the batch (a running request is in every step's record).
        running = {step.request_id for step in record.requests}
        self._credit = {i: c for i, c in self._credit.items() if i in running}
        self._by_request = {k: h for k, h in self._by_request.items() if k[0] in running}
        for step in record.requests:
            if step.max_depth > 0:
                outcome = (step.accepted, step.max_depth)
                self._outcomes.setdefault(step.draft, deque(maxlen=self._history)).append(outcome)
                self._by_request.setdefault((step.request_id, step.draft), deque(maxlen=self._history)).append(outcome)
        # Each draft's call (its own time when the record has it; a step's drafts propose
        # concurrently, so else the step's) shared by the requests that drafted with it, per
        # position: its requests draft in one batched forward per position, so the call lasts
        # as many forwards as the deepest proposal has positions.
        own = dict(record.draft_ms_by)
        users = Counter(s.draft for s in record.requests if s.max_depth > 0)
        for draft, n in users.items():
            ms = own.get(draft, record.draft_ms)
            positions = max(s.max_depth for s in record.requests if s.draft == draft)
            self._draft_share.setdefault(draft, deque(maxlen=self._history)).append(ms / n / positions)
