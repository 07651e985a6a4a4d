"""What a target replica learns from and with: its statistics collector and speculation metrics,
and with a Redis URL the exporter of its counts, the cache of the policy service's snapshot,
from which new requests start (warm start), and the exchange of finished outputs with the
target's other replicas (the suffix draft's cluster index, ``output_exchange``).

Built by the application (``cluster/app.py``) as a factory and called inside each target replica
with the target's name, so that the replica (``replicas/``) needs nothing from this layer but
these calls: ``observers``, ``start``, ``finish``, ``share_output``, ``receive_outputs``,
``background``, ``carry``, ``carry_draft`` and the factory itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace

from specserve.policies.carry import LEARNED
from specserve.policies.output_exchange import OutputExchange
from specserve.policies.priors import warm_start
from specserve.policies.redis_schema import MAX_TOP_K, MAX_TREE_DEPTH
from specserve.policies.redis_stats import RedisStats
from specserve.policies.snapshot_cache import SnapshotCache
from specserve.policies.spec_metrics import SpecMetrics
from specserve.policies.stats import StatsCollector, request_bucket
from specserve.policies.stats_exporter import RedisExporter
from specserve.replicas.drafts.ensemble_carry import cluster_sums
from specserve.replicas.request import SpecRequest
from specserve.replicas.step import StepRecord, TreeShape


def neighbour_shapes(tree: TreeShape) -> list[tuple[int, int]]:
    """The (depth, top-k) shapes one move from ``tree``'s: depth halved or doubled, top-k halved or
    doubled, within its node budget and the shapes a snapshot may carry (``redis_schema``)."""
    moves = ((tree.depth // 2, tree.top_k), (tree.depth * 2, tree.top_k),
             (tree.depth, tree.top_k // 2), (tree.depth, tree.top_k * 2))
    return [(d, k) for d, k in dict.fromkeys(moves)
            if 1 <= d <= min(tree.budget, MAX_TREE_DEPTH) and 1 <= k <= min(tree.budget, MAX_TOP_K)
            and (d, k) != (tree.depth, tree.top_k)]


class ReplicaLearning:
    """``tree_explore``: the share of tree requests (not pinned) that start one move away from the
    shape they would start from (``neighbour_shapes``), so that the policy service prices the
    shapes around the best one measured: it can only price shapes some request used, and a tree
    rule's own walk uses the shapes its state favours, not a fair sample of them."""

    def __init__(self, target: str, redis_url: str | None = None, redis_prefix: str = "specserve",
                 tree_explore: float = 0.0, rng: random.Random | None = None):
        if not 0.0 <= tree_explore <= 1.0:
            raise ValueError(f"tree_explore is a share of tree requests in [0, 1], got {tree_explore}")
        self.target = target
        self.tree_explore = tree_explore
        self.rng = rng if rng is not None else random.Random()
        self.collector = StatsCollector(target)
        self.metrics = SpecMetrics(target)
        self.exporter = self.snapshots = self.outputs = None
        self._receive: Callable[[str | None, object], None] | None = None
        if redis_url:
            store = RedisStats(redis_url, redis_prefix)
            self.exporter, self.snapshots = RedisExporter(self.collector, store), SnapshotCache(store)
            self.outputs = OutputExchange(redis_url, redis_prefix, target)

    @property
    def observers(self) -> list[Callable[[StepRecord], None]]:
        """What the scheduler hands every step's record to."""
        return [self.collector.observe, self.metrics.observe]

    def background(self) -> list[Coroutine]:
        """The replica's background tasks: flushing counts, refreshing the snapshot, and with a
        receiver of outputs, exchanging them."""
        if self.exporter is None:
            return []
        exchange = [] if self._receive is None else [self.outputs.run_forever(self._receive)]
        return [self.exporter.run_forever(), self.snapshots.run_forever(), *exchange]

    def share_output(self, cache_salt: str | None, tokens) -> None:
        """A finished output for the target's other replicas (nothing without Redis)."""
        if self.outputs is not None and self._receive is not None:
            self.outputs.share(cache_salt, tokens)

    def receive_outputs(self, receive: Callable[[str | None, object], None], vocab_size: int | None = None) -> None:
        """Exchange outputs, handing the other replicas' to ``receive`` (called off the event
        loop: it must only queue). Without a receiver the replica shares none. ``vocab_size``:
        the target's vocabulary; received token ids outside it are dropped (default: any int32 ≥ 0)."""
        self._receive = receive
        if self.outputs is not None and vocab_size:
            self.outputs.vocab_size = min(vocab_size, self.outputs.vocab_size)

    def start(self, request: SpecRequest, batch_size: int = 1) -> tuple[SpecRequest, dict | None]:
        """Count the request, and start it from the cluster's prior (``priors.warm_start``, at the
        load of ``batch_size`` running requests) unless the client pinned its window or tree or
        asked for no speculation: a chain's window, a tree's shape (its node budget stays the
        request's), the draft's α and the rules' carried sums; returns the request to run and the
        prior it started from (None: cold). A pinned request keeps what it asked and starts cold,
        with only its draft's own carried sums (a TABED ensemble's) from the cluster. With cluster learning on, a ``tree_explore`` share of
        tree requests starts one move away from that shape (``explored_tree`` in the prior)."""
        start = None
        snapshot = None if self.snapshots is None else self.snapshots.current()
        if snapshot is not None and not (request.pinned or request.speculation.plain):
            start = warm_start(snapshot, self.target, request.draft, request_bucket(request), batch_size)
            if start is not None:
                learned = {"version": start["version"], "sums": start.pop("learned")}
                request = replace(request, prior_alpha=start["alpha"], prior_learned=learned)
                if request.tree is None:
                    request = replace(request, window=start["window"])
                elif start["tree"] is not None:
                    depth, top_k = start["tree"]
                    request = replace(request, tree=replace(request.tree, depth=depth, top_k=top_k))
            shapes = [] if request.tree is None else neighbour_shapes(request.tree)
            if shapes and self.rng.random() < self.tree_explore:
                depth, top_k = self.rng.choice(shapes)
                request = replace(request, tree=replace(request.tree, depth=depth, top_k=top_k))
                start = {**(start or {"version": snapshot.get("version")}), "explored_tree": (depth, top_k)}
        elif snapshot is not None and not request.speculation.plain:
            # A pinned window or tree stays as asked, but the draft's own carried state (a TABED
            # ensemble's hits, ``ensemble_carry``) is the draft's, not the policy's: it still
            # starts from the cluster's.
            pinned = warm_start(snapshot, self.target, request.draft, request_bucket(request), batch_size)
            sums = None if pinned is None else cluster_sums({"sums": pinned.get("learned")})
            if sums:
                request = replace(request, prior_learned={"version": pinned["version"], "sums": sums})
        self.collector.start(request.request_id, request.draft, request_bucket(request))
        return request, start

    def carry(self, draft: str, bucket: str, counts: dict[str, int]) -> None:
        """A finished request's carried rule state (``carry.py``), counted for Redis with its statistics."""
        self.collector.carry(draft, bucket, counts)

    def carry_draft(self, draft: str, request: SpecRequest, counts: dict[str, int]) -> None:
        """What ``request``'s session of ``draft`` left when it was released (a TABED ensemble's
        hits, ``replicas/drafts/ensemble_carry.py``), counted under that draft and the request's
        task bucket like the rules' carried state. Only carried names and positive integers are
        kept (the step loop checked them already; the statistics are written to Redis)."""
        kept = {name: n for name, n in counts.items()
                if isinstance(name, str) and LEARNED.fullmatch(name) and type(n) is int and n > 0}
        if kept:
            self.carry(draft, request_bucket(request), kept)

    def finish(self, request_id: str) -> None:
        self.collector.finish(request_id)


@dataclass(frozen=True)
class ReplicaLearningFactory:
    """Picklable (Serve ships it to each replica); called there with the target's name."""

    redis_url: str | None = None
    redis_prefix: str = "specserve"
    tree_explore: float = 0.0

    def __call__(self, target: str) -> ReplicaLearning:
        return ReplicaLearning(target, self.redis_url, self.redis_prefix, self.tree_explore)
