"""Speculation metrics on Ray's Prometheus endpoint (the Ray dashboard's metrics view reads it),
named after vLLM's spec-decode counters so that existing dashboards carry over:

    specserve_spec_decode_num_drafts                    request-steps that drafted
    specserve_spec_decode_num_draft_tokens              tokens (tree nodes) proposed
    specserve_spec_decode_num_accepted_tokens           draft tokens accepted
    specserve_spec_decode_num_accepted_tokens_per_pos   ... by position (tag ``position``)
    specserve_spec_decode_speculation_off               request-steps of a request with a draft where
                                                        nothing was drafted (the policy switched
                                                        speculation off, or the draft had nothing)
    specserve_spec_decode_window                        histogram of the longest path offered per step

Ray prefixes every name with ``ray_``. Counts are aggregated per step and draft before they are
recorded: one call per counter per draft per step, not per token.
"""

from __future__ import annotations

from collections import Counter

from ray.serve import metrics

from specserve.policies.stats import counts_from_record
from specserve.replicas.step import StepRecord

WINDOW_BOUNDARIES = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5, 32.5, 64.5]


class SpecMetrics:
    def __init__(self, target: str):
        tags = ("target", "draft")
        self.target = target
        self.drafts = metrics.Counter("specserve_spec_decode_num_drafts", "Request-steps that drafted.", tag_keys=tags)
        self.draft_tokens = metrics.Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed.", tag_keys=tags)
        self.accepted = metrics.Counter("specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.", tag_keys=tags)
        self.accepted_per_pos = metrics.Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
            tag_keys=(*tags, "position"))
        self.off = metrics.Counter("specserve_spec_decode_speculation_off",
                                   "Request-steps of a speculating request where nothing was drafted.", tag_keys=tags)
        self.window = metrics.Histogram("specserve_spec_decode_window", "Longest draft path offered per request-step.",
                                        boundaries=WINDOW_BOUNDARIES, tag_keys=tags)

    def observe(self, record: StepRecord) -> None:
        # The collector's own counting rules (stats.counts_from_record), summed per draft.
        per_draft: dict[str, Counter] = {}
        drafts = {step.request_id: step.draft for step in record.requests}
        for request_id, counts in counts_from_record(record).items():
            per_draft.setdefault(drafts[request_id], Counter()).update(counts)
        for draft, c in per_draft.items():
            if draft == "none":
                continue
            tags = {"target": self.target, "draft": draft}
            for field, counter in (("drafts", self.drafts), ("draft_tokens", self.draft_tokens),
                                   ("accepted_tokens", self.accepted), ("plain_steps", self.off)):
                if c[field]:
                    counter.inc(c[field], tags=tags)
            for field, n in c.items():
                if field.startswith("accepted_pos_"):
                    self.accepted_per_pos.inc(n, tags={**tags, "position": field.removeprefix("accepted_pos_")})
                elif field.startswith("window_"):
                    for _ in range(n):
                        self.window.observe(int(field.removeprefix("window_")), tags=tags)
