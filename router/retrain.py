"""The cluster's router weights, retrained from every replica's routing outcomes.

The policy service calls ``retrain`` with the capped Redis stream of finished requests (each with
its features, the topic basis they were computed on, and the realised α of every draft segment it
ran) and publishes the result as the ``router`` document; replicas load it
(``router/route_learning.py``). Ridge over all observations is exactly what each replica's online
model would hold had it seen them all, so a replica starts from the whole cluster's experience.
Weights are grouped by (target, basis, number of features): features of one topic basis mean
nothing on another, and a replica takes only models of its own feature count.

Both directions read Redis, so both are checked (``policies/redis_schema.py``): an outcome whose
fields fail ``RouteOutcome`` is skipped and counted before it reaches a model, and a weights
document that fails ``WeightsDocument`` is skipped by the replica, which keeps the weights it has.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Annotated

from pydantic import Field, ValidationError, model_validator

from specserve.policies.redis_schema import MAX_COUNT, Name, Rate, Strict, Time, Version, reject
from specserve.router.acceptance import MAX_FEATURES, ROUTER_PRIOR_ALPHA, LinearAcceptance

WEIGHTS_FORMAT = 1
# A feature is scaled to about [-2, 2] (``features.py``); far beyond is not one of ours.
MAX_FEATURE = 100.0
# Draft segments per request: the first choice and its switches.
MAX_OBSERVATIONS = 16
# Models per document: targets × topic bases × drafts, with room.
MAX_MODELS = 1024
# All models' A matrices together, in floats: what the retrainer holds and what the document
# carries (~20 bytes a float as JSON, within the readers' MAX_DOCUMENT_BYTES). Outcomes name their
# own targets, bases and drafts, so without it they would say how much is allocated.
MAX_MODEL_FLOATS = 1 << 18

Feature = Annotated[float, Field(ge=-MAX_FEATURE, le=MAX_FEATURE)]


class Observation(Strict):
    draft: Name
    alpha: Rate
    weight: Rate = 1.0


class RouteOutcome(Strict):
    """The fields of a routing outcome (``LearnedDraftRouter.finish``) that retraining reads."""

    target: Name | None = None
    basis: Name | None = None
    features: list[Feature] | None = Field(None, min_length=1, max_length=MAX_FEATURES)
    observations: list[Observation] | None = Field(None, max_length=MAX_OBSERVATIONS)


class ModelWeights(Strict):
    """``LinearAcceptance.to_dict``, bounded: dims first, so that A is never sized from garbage."""

    dims: int = Field(ge=1, le=MAX_FEATURES)
    ridge: float = Field(gt=0.0, le=1e6)
    alpha_max: Rate = 0.95
    prior_alpha: Rate = 0.0
    observations: float = Field(0.0, ge=0.0, le=MAX_COUNT)
    A: list[list[float]] = Field(max_length=MAX_FEATURES)
    b: list[float] = Field(max_length=MAX_FEATURES)

    @model_validator(mode="after")
    def _square(self) -> "ModelWeights":
        if len(self.b) != self.dims or len(self.A) != self.dims or any(len(row) != self.dims for row in self.A):
            raise ValueError(f"A must be {self.dims}x{self.dims} and b of {self.dims}")
        return self


class PublishedModel(Strict):
    target: Name
    basis: Name
    draft: Name
    model: ModelWeights


class WeightsDocument(Strict):
    """The ``router`` document as ``RedisStats.publish_snapshot`` stamped it."""

    version: Version
    published_at: Time
    format: int = Field(ge=0, le=1000)
    computed_at: Time | None = None
    outcomes: int = Field(0, ge=0, le=MAX_COUNT)
    models: list[PublishedModel] = Field(default_factory=list, max_length=MAX_MODELS)


def retrain(outcomes: Iterable[dict], ridge: float = 1.0, alpha_max: float = 0.95, now: float | None = None) -> dict:
    usable: list[RouteOutcome] = []
    for raw in outcomes:
        try:
            outcome = RouteOutcome.model_validate(raw)
        except ValidationError as err:
            reject("router_outcome", "schema", "router:outcomes", err)
            continue
        if outcome.features and outcome.target and outcome.basis:
            usable.append(outcome)
    # The most observed models first, within MAX_MODELS and MAX_MODEL_FLOATS.
    seen_by_key = Counter((o.target, o.basis, len(o.features), seen.draft) for o in usable for seen in o.observations or ())
    chosen, floats = set(), 0
    for key, _ in seen_by_key.most_common():
        if len(chosen) == MAX_MODELS or floats + key[2] ** 2 > MAX_MODEL_FLOATS:
            reject("router_outcome", "size", "router:outcomes", f"{len(seen_by_key) - len(chosen)} models left out")
            break
        chosen.add(key)
        floats += key[2] ** 2
    models: dict[tuple[str, str, int, str], LinearAcceptance] = {}
    for outcome in usable:
        x = outcome.features
        for seen in outcome.observations or ():
            key = (outcome.target, outcome.basis, len(x), seen.draft)
            if key not in chosen:
                continue
            if key not in models:
                models[key] = LinearAcceptance(len(x), ridge, alpha_max, ROUTER_PRIOR_ALPHA)
            models[key].update(x, seen.alpha, seen.weight)
    counted = len(usable)
    return {
        "format": WEIGHTS_FORMAT, "computed_at": time.time() if now is None else now, "outcomes": counted,
        "models": [{"target": t, "basis": b, "draft": d, "model": m.to_dict()} for (t, b, _, d), m in sorted(models.items())],
    }


def weights_for(document: dict | None, target: str, basis: str, dims: int | None = None) -> dict[str, dict]:
    """From a published weights document, the models of one target on one basis (of ``dims``
    features when given), by draft."""
    if not document or document.get("format") != WEIGHTS_FORMAT:
        return {}
    return {m["draft"]: m["model"] for m in document.get("models", ())
            if m.get("target") == target and m.get("basis") == basis
            and (dims is None or m["model"].get("dims") == dims)}
