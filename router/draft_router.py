"""The learned draft router: which draft (or none) serves a request fastest, decided where the
prefill happens (the target replica's scheduler) and revisited as the request runs.

At admission, from the request's features x (``router/features.py``: length, the target's
perplexity on the prompt from its own prefill, repetition, TF-IDF topics):

    α̂_d = θ_dᵀx                    each draft's acceptance model (``router/acceptance.py``)
    w_d  = sqrt(xᵀA_d⁻¹x)           LinUCB's width: how unlike the prompts seen so far x is
    G_d  = max_γ E(α̂_d + β·w_d, γ) / (γ·a_d + b(γ))     the objective (Eq. 1), measured costs
    G_none = 1 / b(0)                 plain decoding, no uncertainty
    choice = argmax over drafts and none

G and the α estimate below (Eq. 2) are those of "A Drop-in Solution for On-the-Fly Adaptation of
Speculative Decoding in Large Language Models", with the costs measured on the replica.

The exploration bonus ``β·w_d`` is LinUCB's (Li et al., 2010): only the chosen draft's α is ever
observed, so a draft that looks worse now but is uncertain gets tried, and as observations of
similar prompts accumulate its width shrinks and the choice becomes the predicted best. A draft
whose cost is not measured yet is explored the same way, priced as the dearest known draft
(``StepCosts.stand_in_ms``); prediction alone never chooses it, and with ``explore = 0`` nothing
is explored. A draft that cannot propose now (``unavailable``) is never chosen. The reason
recorded says which: ``predicted`` (the best prediction won), ``explore`` (the bonus, or the
stand-in price of an unmeasured draft, changed the choice), ``no-gain`` (no draft beats plain
decoding), ``pinned`` (the client named the draft: respected, and its α still teaches that
draft's model).

While the request runs, every ``revisit_every`` counted steps its realised α (the paper's Eq. 2
over its steps with this draft, the prediction as ``prior_steps`` pseudo-steps) replaces the
prediction: when another draft's predicted G beats the current draft's realised G by
``switch_margin``, the request switches draft (``Scheduler.set_draft``: the new draft builds its
own KV cache from the tokens), at most ``max_switches`` times. Each draft segment's realised α
updates that draft's model when the segment ends, weighted by how many steps measured it.

A step that asked the draft for tokens and got none (prompt lookup without a match) counts as a
rejection at the first position: the request emitted one token for it, which is what the
objective must price; steps where the window policy switched speculation off are not counted.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specserve.policies.window import estimate_alpha
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT, RequestState
from specserve.replicas.step import StepRecord
from specserve.router.acceptance import ROUTER_PRIOR_ALPHA, LinearAcceptance
from specserve.router.costs import StepCosts
from specserve.router.features import PromptFeatures, prompt_features
from specserve.router.topics import TopicBasis

logger = logging.getLogger("ray.serve")

PREDICTED, EXPLORE, NO_GAIN, PINNED, SWITCH = "predicted", "explore", "no-gain", "pinned", "switch"


@dataclass
class Segment:
    """One request's steps with one draft: what its realised α is measured from."""

    draft: str
    history: list[tuple[int, int]]   # (n, γ) per counted step
    predicted: float | None          # the model's α for this draft when the segment began
    since_revisit: int = 0


class LearnedDraftRouter:
    def __init__(self, drafts: Sequence[str], basis: TopicBasis | None = None, topic_dims: int = 8,
                 explore: float = 0.2, revisit_every: int = 8, switch_margin: float = 0.15,
                 max_switches: int = 1, prior_steps: int = 4, min_weight_steps: int = 16,
                 window_max: int = 8, alpha_max: float = 0.95, ridge: float = 1.0, log: bool = True,
                 clock: Callable[[], float] = time.time, recent: int = 256):
        self.drafts = [d for d in drafts if d not in (NO_DRAFT, AUTO_DRAFT)]
        self.basis = basis
        self.topic_dims = basis.dims if basis is not None else topic_dims
        # Models learned on one basis mean nothing on another: weights and outcomes carry its id.
        self.basis_id = f"none-d{self.topic_dims}" if basis is None else basis.fingerprint
        self.explore = explore
        self.revisit_every = revisit_every
        self.switch_margin = switch_margin
        self.max_switches = max_switches
        self.prior_steps = prior_steps
        self.min_weight_steps = min_weight_steps
        self.alpha_max = alpha_max
        self.costs = StepCosts(window_max=window_max)
        dims = len(PromptFeatures.names(self.topic_dims))
        self.models = {d: LinearAcceptance(dims, ridge, alpha_max, ROUTER_PRIOR_ALPHA) for d in self.drafts}
        self.log = log
        self._clock = clock
        self._segments: dict[str, Segment] = {}
        self._features: dict[str, tuple[float, ...]] = {}
        self._observed: dict[str, list[dict]] = {}   # request id -> its draft segments' observations
        self._named: dict[str, dict] = {}            # request id -> its features, readable
        self.recent: deque[dict] = deque(maxlen=recent)   # finished requests' decisions and outcomes
        # Who else learns from a finished request (metrics, the cluster's Redis stream).
        self.on_outcome: list[Callable[[dict], None]] = []
        # Drafts that cannot propose now (a deployment down, or late with a call still running),
        # set by the step loop before each step: priced at 0 tokens/s with and without the
        # exploration bonus, so none is chosen, and a request on one moves at its next revisit.
        self.unavailable: frozenset[str] = frozenset()

    # ---- the decision ------------------------------------------------------------------------

    def features(self, state: RequestState) -> PromptFeatures:
        return prompt_features(state.request.prompt_ids, self.basis, state.prompt_nll, state.prompt_scored,
                               self.topic_dims, constrained=state.request.grammar is not None)

    def scores(self, x: Sequence[float], batch_size: int) -> dict[str, dict]:
        """Per candidate: predicted α, its width, and tokens/s at the best window with and
        without the exploration bonus (a draft of unknown cost: 0 without it)."""
        out = {}
        # Pessimistic, so an unmeasured draft is tried only where its bonus pays for the worst
        # cost seen; without exploration there is nothing to try it for.
        stand_in = self.costs.stand_in_ms() if self.explore > 0 else None
        for draft, model in self.models.items():
            alpha, width = model.predict(x), model.width(x)
            optimistic = self._optimistic(alpha, width)
            tps, window = self.costs.best(alpha, draft, batch_size)
            ucb = self.costs.best(optimistic, draft, batch_size, unknown_ms=stand_in)[0]
            if draft in self.unavailable:
                tps = ucb = 0.0
            out[draft] = {"alpha": round(alpha, 4), "width": round(width, 4), "window": window,
                          "tokens_per_s": round(tps, 2), "ucb_tokens_per_s": round(ucb, 2)}
        plain = round(self.costs.plain(batch_size), 2)
        out[NO_DRAFT] = {"tokens_per_s": plain, "ucb_tokens_per_s": plain}
        return out

    def choose(self, scores: dict[str, dict]) -> tuple[str, str]:
        """(draft, reason) from ``scores``."""
        def best(key: str) -> str:
            # Ties go to the cheaper choice: none first, then drafts in configured order.
            return max([NO_DRAFT, *self.drafts], key=lambda d: scores[d][key])
        choice, exploit = best("ucb_tokens_per_s"), best("tokens_per_s")
        if choice == NO_DRAFT:
            return choice, NO_GAIN
        return choice, PREDICTED if choice == exploit else EXPLORE

    def route(self, state: RequestState, batch_size: int) -> str:
        features = self.features(state)
        x = features.vector()
        self._features[state.id] = x
        self._named[state.id] = features.to_dict()
        pinned = state.request.draft != AUTO_DRAFT
        scores = self.scores(x, batch_size)
        draft, reason = (state.request.draft, PINNED) if pinned else self.choose(scores)
        state.routing = {
            "choice": draft, "reason": reason, "batch_size": batch_size,
            "predicted_alpha": {d: scores[d]["alpha"] for d in self.drafts},
            "tokens_per_s": {d: s["tokens_per_s"] for d, s in scores.items()},
            "switches": [],
        }
        self._begin(state.id, draft, scores.get(draft, {}).get("alpha"))
        state.expected_alpha = self._chosen_on(scores, draft, reason)
        if self.log:
            self._log("decision", state.id, features=features.to_dict(), scores=scores, choice=draft, reason=reason)
        return draft

    def _chosen_on(self, scores: dict[str, dict], draft: str, reason: str) -> float | None:
        """The α the choice rests on: the prediction plus the exploration bonus (the choice is
        the best of the optimistic scores; the bonus fades as the model grows confident). The
        load-aware policy must let a draft chosen on it draft, or its α is never observed.
        None when pinned or plain."""
        if draft not in self.models or reason == PINNED:
            return None
        return self._optimistic(scores[draft]["alpha"], scores[draft]["width"])

    def _optimistic(self, alpha: float, width: float) -> float:
        """LinUCB's α: the prediction plus the exploration bonus, capped."""
        return min(self.alpha_max, alpha + self.explore * width)

    # ---- while the request runs --------------------------------------------------------------

    def _begin(self, request_id: str, draft: str, predicted: float | None) -> None:
        self._segments[request_id] = Segment(draft, [], predicted)

    def observe(self, record: StepRecord) -> None:
        """Every step's record (a scheduler observer): costs, and each request's counted steps."""
        self.costs.observe(record)
        for step in record.requests:
            segment = self._segments.get(step.request_id)
            if segment is None or segment.draft != step.draft or segment.draft == NO_DRAFT:
                continue
            asked = step.asked.window if step.asked.tree is None else step.asked.tree.depth
            if step.max_depth > 0:
                segment.history.append((step.accepted, step.max_depth))
            elif asked > 0:   # asked, nothing proposed: the step emitted one token
                segment.history.append((0, asked))
            else:
                continue
            segment.since_revisit += 1

    def realised_alpha(self, segment: Segment, with_prior: bool = False) -> float | None:
        prior = None
        if with_prior and segment.predicted is not None:
            prior = (segment.predicted, self.prior_steps)
        return estimate_alpha(segment.history, self.alpha_max, prior)

    def revisit(self, state: RequestState, batch_size: int) -> str | None:
        segment = self._segments.get(state.id)
        routing = state.routing
        if (segment is None or routing is None or routing["reason"] == PINNED or segment.draft == NO_DRAFT
                or segment.since_revisit < self.revisit_every or len(routing["switches"]) >= self.max_switches):
            return None
        segment.since_revisit = 0
        realised = self.realised_alpha(segment, with_prior=True)
        current = 0.0 if segment.draft in self.unavailable else self.costs.best(realised, segment.draft, batch_size)[0]
        x = self._features[state.id]
        candidates = {d: self.costs.best(m.predict(x), d, batch_size)[0]
                      for d, m in self.models.items() if d != segment.draft and d not in self.unavailable}
        candidates[NO_DRAFT] = self.costs.plain(batch_size)
        best = max(candidates, key=candidates.get)
        if candidates[best] <= (1.0 + self.switch_margin) * current:
            return None
        self._learn(state.id, segment)
        routing["switches"].append({"from": segment.draft, "to": best, "step": state.stats.steps,
                                    "realised_alpha": round(realised, 4),
                                    "tokens_per_s": {"from": round(current, 2), "to": round(candidates[best], 2)}})
        self._begin(state.id, best, self.models[best].predict(x) if best in self.models else None)
        state.expected_alpha = self._segments[state.id].predicted
        if self.log:
            self._log("switch", state.id, **routing["switches"][-1])
        return best

    # ---- learning ----------------------------------------------------------------------------

    def _learn(self, request_id: str, segment: Segment) -> dict | None:
        """The segment's realised α into its draft's model; returns the observation."""
        x = self._features.get(request_id)
        alpha = self.realised_alpha(segment)
        if x is None or alpha is None or segment.draft not in self.models:
            return None
        weight = min(1.0, len(segment.history) / self.min_weight_steps)
        self.models[segment.draft].update(x, alpha, weight)
        observation = {"draft": segment.draft, "alpha": round(alpha, 4), "steps": len(segment.history),
                       "weight": round(weight, 4)}
        self._observed.setdefault(request_id, []).append(observation)
        return observation

    def finish(self, state: RequestState) -> None:
        segment = self._segments.pop(state.id, None)
        observed = None if segment is None else self._learn(state.id, segment)
        x = self._features.pop(state.id, None)
        observations = self._observed.pop(state.id, [])
        named = self._named.pop(state.id, None)
        if segment is None or state.routing is None:
            return
        outcome = {
            "request_id": state.id, "at": self._clock(), **state.routing,
            "features": list(x) if x is not None else None, "features_named": named, "basis": self.basis_id,
            "final_draft": segment.draft, "observed": observed, "observations": observations,
            "realised": {"acceptance_rate": round(state.stats.acceptance_rate, 4),
                         "mean_accepted_len": round(state.stats.mean_accepted_len, 4),
                         "steps": state.stats.steps, "tokens": len(state.out),
                         "finish_reason": state.finish_reason},
        }
        self.recent.append(outcome)
        if self.log:
            self._log("outcome", state.id, final_draft=segment.draft, observed=observed, realised=outcome["realised"])
        for hook in self.on_outcome:
            hook(outcome)

    def _log(self, event: str, request_id: str, **fields) -> None:
        # One JSON object per line, so the Ray dashboard's log view and `grep` both read it.
        logger.info("specserve.routing %s", json.dumps({"event": event, "request_id": request_id, **fields},
                                                       sort_keys=True, default=str))

    # ---- weights -----------------------------------------------------------------------------

    def weights(self) -> dict:
        """The acceptance models as JSON-ready data (the policy service publishes these)."""
        return {d: m.to_dict() for d, m in self.models.items()}

    def load_weights(self, weights: dict) -> None:
        """Replace the models of the drafts ``weights`` has (the cluster's, retrained)."""
        for draft, data in weights.items():
            if draft in self.models:
                model = LinearAcceptance.from_dict(data)
                if model.dims == self.models[draft].dims:
                    self.models[draft] = model
