"""Learned rule state that outlives its request: what a finished request leaves to the next ones,
on its replica and, through Redis, on every replica.

A rule that carries (``CarriedRule``) says what a finished request adds as integer counts
(``counts(state)``: the Q-table's visited entries, the depth SAGE's history settled at, the tree
ADT-Tree walked to) and starts a request from sums of such counts (``start(request, carried)``).
Counts add, so a request starts from the cluster's sums (the policy service's decayed sums of
every replica's, which the request brings from the snapshot: ``SpecRequest.prior_learned``) plus
what this replica's requests added since that snapshot was computed: the same formula whether one
replica learns alone or a cluster learns together, and never an average of averages.

The sums go to Redis with the acceptance counters (``stats.StatsCollector.carry``), keyed by
target, draft and task bucket, and come back in the snapshot's prior for the request's bucket (its
``learned``). A replica forgets its own counts when a newer snapshot arrives: the snapshot holds
them once they were flushed, and those made in between reach the next one (a delay of one
publication, never a count twice for longer than that).

A TABED ensemble's draft carries too, though it is no rule: its session's per-candidate hits come
back from the draft when the target releases the session (``replicas/drafts/ensemble_carry.py``)
and go to the statistics alone (``ReplicaLearning.carry_draft``), since the draft's own prior holds
the replica's recent positions; a request brings the cluster's sums to its draft with its first ask.

What comes back from Redis is input: the snapshot's schema (``redis_schema.Prior.learned``) admits
only the counter names below, finite and non-negative, and each rule brings what it derives within
its own bounds (a window in 0..γ_max, a tree within the rule's limits), so a bad sum costs a poor
start, never a failed request. A snapshot older than the cache's bound is not used at all
(``snapshot_cache``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from specserve.policies.stats import request_bucket
from specserve.replicas.drafts import ensemble_carry
from specserve.replicas.request import SpecRequest

# The counts a carrying rule may write, one pattern each (``redis_schema.COUNTER_NAME`` admits
# exactly these): Q-table visits and visit-weighted values (milli-reward), the end states of the
# tree rules, and a TABED ensemble's per-candidate hits, which its draft keeps (not a rule: the
# target hands them from the draft's release to the statistics, ``ReplicaLearning.carry_draft``).
LEARNED_COUNTERS = (r"q_(n|mq)_([0-9]|1[0-6])_([0-9]|1[0-6])",
                    r"sage_(requests|max_depth)", r"adt_(requests|depth|top_k)", r"eagle2_(requests|depth)",
                    ensemble_carry.COUNTERS)
LEARNED = re.compile("|".join(LEARNED_COUNTERS))   # fullmatch: a carried sum's name


@runtime_checkable
class CarriedRule(Protocol):
    """A window or tree rule whose learned state carries across requests."""

    def counts(self, state: Any) -> dict[str, int]:
        """What a finished request with this state adds to the carried sums (non-negative integers)."""

    def start(self, request: SpecRequest, carried: Mapping[str, float] | None = None) -> Any:
        """The state of a new request, from the carried sums (None or empty: the rule's cold start)."""


# Where a finished request's counts go besides the replica's own sums: (draft, task bucket, counts).
CarrySink = Callable[[str, str, dict[str, int]], None]


class CarriedSums:
    """A policy's carried sums per draft: the cluster snapshot's a request brings, plus this
    replica's counts added since that snapshot (``carry`` docstring)."""

    def __init__(self) -> None:
        self.local: dict[str, Counter] = {}
        self.base: dict[str, int] = {}   # draft -> the snapshot version the local counts follow
        self.sinks: list[CarrySink] = []

    def __getstate__(self) -> dict:
        # Sinks are this process's callbacks (a replica's statistics, behind a lock): a copy, or
        # Serve scanning a replica's arguments for handles, takes the sums without them.
        return {**self.__dict__, "sinks": []}

    def for_request(self, request: SpecRequest) -> dict[str, float]:
        """The sums a new request of ``request.draft`` starts from."""
        prior = request.prior_learned or {}
        version = prior.get("version")
        if version is not None and version > self.base.get(request.draft, -1):
            self.base[request.draft] = version
            self.local.pop(request.draft, None)   # the newer snapshot holds them, or the next will
        sums: dict[str, float] = dict(prior.get("sums") or {})
        for name, n in self.local.get(request.draft, Counter()).items():
            sums[name] = sums.get(name, 0.0) + n
        return sums

    def start(self, rule: Any, request: SpecRequest) -> Any:
        """``rule``'s state for a new request: from these sums when the rule carries."""
        return rule.start(request, self.for_request(request)) if isinstance(rule, CarriedRule) else rule.start(request)

    def finish(self, rule: Any, request: SpecRequest, state: Any) -> None:
        """A request with ``state`` finished: what it leaves, when the rule carries."""
        if isinstance(rule, CarriedRule):
            self.add(request, rule.counts(state))

    def add(self, request: SpecRequest, counts: dict[str, int]) -> None:
        """A finished request's counts, kept here and handed to every sink (Redis)."""
        counts = {name: int(n) for name, n in counts.items() if n > 0}
        if not counts:
            return
        self.local.setdefault(request.draft, Counter()).update(counts)
        for sink in self.sinks:
            sink(request.draft, request_bucket(request), counts)
