"""The cluster's router weights, retrained from every replica's routing outcomes.

The policy service calls ``retrain`` with the capped Redis stream of finished requests (each with
its features, the topic basis they were computed on, and the realised α of every draft segment it
ran) and publishes the result as the ``router`` document; replicas load it
(``routing/route_learning.py``). Ridge over all observations is exactly what each replica's online
model would hold had it seen them all, so a replica starts from the whole cluster's experience.
Weights are grouped by (target, basis): features of one topic basis mean nothing on another.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from specserve.routing.acceptance import ROUTER_PRIOR_ALPHA, LinearAcceptance

WEIGHTS_FORMAT = 1


def retrain(outcomes: Iterable[dict], ridge: float = 1.0, alpha_max: float = 0.95, now: float | None = None) -> dict:
    models: dict[tuple[str, str, str], LinearAcceptance] = {}
    counted = 0
    for outcome in outcomes:
        x, target, basis = outcome.get("features"), outcome.get("target"), outcome.get("basis")
        if not x or not target or not basis:
            continue
        counted += 1
        for seen in outcome.get("observations") or ():
            key = (target, basis, seen["draft"])
            model = models.setdefault(key, LinearAcceptance(len(x), ridge, alpha_max, ROUTER_PRIOR_ALPHA))
            if model.dims == len(x):
                model.update(x, float(seen["alpha"]), float(seen.get("weight", 1.0)))
    return {
        "format": WEIGHTS_FORMAT, "computed_at": time.time() if now is None else now, "outcomes": counted,
        "models": [{"target": t, "basis": b, "draft": d, "model": m.to_dict()} for (t, b, d), m in sorted(models.items())],
    }


def weights_for(document: dict | None, target: str, basis: str) -> dict[str, dict]:
    """From a published weights document, the models of one target on one basis, by draft."""
    if not document or document.get("format") != WEIGHTS_FORMAT:
        return {}
    return {m["draft"]: m["model"] for m in document.get("models", ())
            if m.get("target") == target and m.get("basis") == basis}
