"""The draft router's decisions on Ray's Prometheus endpoint (the Ray dashboard's metrics view,
and the Grafana dashboard in ``deploy/``), one update per finished request:

    specserve_router_decisions          requests by chosen draft and reason (predicted, explore,
                                        no-gain, pinned; ``none`` is the no-speculation choice)
    specserve_router_switches           mid-flight draft switches, by from and to draft
    specserve_router_predicted_alpha    histogram of the chosen draft's predicted α
    specserve_router_realised_alpha     histogram of the α each draft segment realised
    specserve_router_alpha_error        histogram of |predicted − realised| α of the first choice
    specserve_router_mean_accepted_len  histogram of each request's τ (emitted tokens per step)

Acceptance by position, windows and speculation switched off per step are the spec-decode
metrics (``policies/spec_metrics.py``). Ray prefixes every name with ``ray_``.
"""

from __future__ import annotations

from ray.serve import metrics

RATE_BOUNDARIES = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
LENGTH_BOUNDARIES = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]


class RouteMetrics:
    def __init__(self, target: str):
        self.target = target
        self.decisions = metrics.Counter("specserve_router_decisions", "Requests by the draft the router chose and why.",
                                         tag_keys=("target", "draft", "reason"))
        self.switches = metrics.Counter("specserve_router_switches", "Mid-flight draft switches.",
                                        tag_keys=("target", "from_draft", "to_draft"))
        self.predicted = metrics.Histogram("specserve_router_predicted_alpha", "Predicted alpha (acceptance rate) of the chosen draft.",
                                           boundaries=RATE_BOUNDARIES, tag_keys=("target", "draft"))
        self.realised = metrics.Histogram("specserve_router_realised_alpha", "Realised alpha (acceptance rate) of each draft segment.",
                                          boundaries=RATE_BOUNDARIES, tag_keys=("target", "draft"))
        self.error = metrics.Histogram("specserve_router_alpha_error", "|predicted - realised| alpha of the first choice.",
                                       boundaries=RATE_BOUNDARIES, tag_keys=("target", "draft"))
        self.accepted_len = metrics.Histogram("specserve_router_mean_accepted_len", "Emitted tokens per step per request.",
                                              boundaries=LENGTH_BOUNDARIES, tag_keys=("target", "draft"))

    def observe(self, outcome: dict) -> None:
        choice = outcome["choice"]
        tags = {"target": self.target, "draft": choice}
        self.decisions.inc(tags={**tags, "reason": outcome["reason"]})
        for switch in outcome.get("switches", ()):
            self.switches.inc(tags={"target": self.target, "from_draft": switch["from"], "to_draft": switch["to"]})
        predicted = outcome.get("predicted_alpha", {}).get(choice)
        if predicted is not None:
            self.predicted.observe(predicted, tags=tags)
        observations = outcome.get("observations") or []
        for seen in observations:
            self.realised.observe(seen["alpha"], tags={"target": self.target, "draft": seen["draft"]})
        if predicted is not None and observations and observations[0]["draft"] == choice:
            self.error.observe(abs(predicted - observations[0]["alpha"]), tags=tags)
        realised = outcome.get("realised") or {}
        if realised.get("steps"):
            self.accepted_len.observe(realised["mean_accepted_len"], tags={"target": self.target,
                                                                          "draft": outcome["final_draft"]})
