"""Which target replica serves a request: the one that last took a prompt with the same start,
while the load allows (a Ray Serve request router, set on the target deployment in
``cluster/app.py``).

A target replica keeps finished requests' KV caches in its free slots (``replicas/scheduler.py``):
a repeated prompt, the next turn of a chat or a long shared system prompt finds its prefix there
and skips that much prefill. Serve's default router (power of two choices) sends a request to
either of two random replicas, so with n replicas only about 1/n of such requests land where
their prefix is. Like Ray Serve LLM's ``PrefixCacheAffinityRouter`` (which keeps a prefix tree of
text in a shared actor), this router remembers which replica last received each prompt prefix,
but of token ids, in blocks, in the ingress's own process: the ingress is the target's only
caller, and a routing decision costs no remote call.

Per request: the prompt's whole blocks of ``block_tokens`` ids are hashed as a chain (a block's
key covers everything before it), and the request goes to the replica that owns the longest chain
of its blocks, if that covers at least ``min_match`` of the prompt and that replica has at most
``max_imbalance`` more requests in flight (from this router) than the least loaded candidate.
Otherwise the candidate with the fewest requests in flight from this router: with one ingress
replica that is join-the-shortest-queue (a request counts from the moment it is chosen, so a burst's
choices see each other), where power of two choices probes queue lengths that a burst arriving
at once has not raised yet, and can split it unevenly. A replica that is full (``max_ongoing_requests``) is passed over by Serve
itself, which then tries the next rank. Either way the chosen replica becomes the owner of the
request's blocks.

What the router remembers is a hint, never a promise (docs/design.md §7): a replica that has dropped
the cache recomputes it from the tokens, so affinity only ever saves prefill.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict, deque
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

ROUTER_CLASS = "specserve.ingress.prefix_affinity:PrefixAffinityRouter"


def prompt_and_salt(request: PendingRequest | None) -> tuple[list[int] | None, str | None]:
    """The prompt token ids and cache salt of a target request (its ``SpecRequest`` argument)."""
    for arg in [*request.args, *request.kwargs.values()] if request is not None else []:
        ids = getattr(arg, "prompt_ids", None)
        if isinstance(ids, list):
            return ids, getattr(arg, "cache_salt", None)
    return None, None


def block_keys(ids: list[int], block_tokens: int, salt: str | None = None) -> list[int]:
    """One key per whole block of ``ids``; key i stands for ``ids[: (i + 1) * block_tokens]`` (and
    the request's cache salt: a replica holds a prefix for that salt only)."""
    keys: list[int] = []
    key = hash(salt)
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(ids[start:start + block_tokens])))
        keys.append(key)
    return keys


class PrefixAffinityRouter(RequestRouter):
    # No FIFOMixin: it hands a chosen replica to the oldest pending request, and the choice here
    # is for one request's prefix (Ray's own prefix router leaves it out for the same reason).

    def initialize_state(self, block_tokens: int = 32, max_blocks: int = 200_000, max_imbalance: int = 2,
                         min_match: float = 0.25, **_: Any) -> None:
        """``max_blocks``: block keys remembered (least recently routed forgotten first): 200k
        keys of ~100 bytes is ~20 MB in the ingress for ~6M prompt tokens."""
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.max_imbalance = max_imbalance
        self.min_match = min_match
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        # Requests in flight per replica, counted when chosen (a burst's choices see each other;
        # Serve reports the routing only after the replica accepted) and moved if Serve sent the
        # request elsewhere. A choice Serve never reports (the caller gave up before dispatch) is
        # dropped after ``unconfirmed_s``; completions that overtake their routing report are
        # remembered a while, so a late report cannot count a finished request forever.
        self.unconfirmed_s = 30.0
        self._in_flight: Counter[ReplicaID] = Counter()
        self._routed: dict[str, tuple[ReplicaID, bool]] = {}   # request -> (replica, reported by Serve)
        self._unconfirmed: deque[tuple[float, str]] = deque()
        self._completed: OrderedDict[str, None] = OrderedDict()
        self.affinity_hits = 0   # requests sent where their prefix was (for tests and logs)

    def _least_loaded(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """The candidate with the fewest requests in flight from this router (ties at random),
        then the others: Serve takes the first that has room."""
        shuffled = random.sample(candidates, len(candidates))
        ranked = sorted(shuffled, key=lambda r: self._in_flight[r.replica_id])
        return [ranked[:1], ranked[1:]]

    def prefix_owner(self, ids: list[int], candidates: list[RunningReplica],
                     salt: str | None = None) -> tuple[RunningReplica | None, int]:
        """The candidate that owns the longest chain of ``ids``'s blocks, and how many tokens it covers."""
        by_id = {r.replica_id: r for r in candidates}
        keys = block_keys(ids, self.block_tokens, salt)
        for i in range(len(keys) - 1, -1, -1):
            owner = self._owner.get(keys[i])
            if owner in by_id:
                return by_id[owner], (i + 1) * self.block_tokens
        return None, 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        self._drop_unconfirmed()
        ranks = self._choose(candidate_replicas, pending_request)
        if pending_request is not None and ranks and ranks[0]:
            self._count(pending_request.metadata.internal_request_id, ranks[0][0].replica_id, reported=False)
        return ranks

    def _choose(self, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        fallback = self._least_loaded(candidate_replicas)
        ids, salt = prompt_and_salt(pending_request)
        if not ids:
            return fallback
        owner, matched = self.prefix_owner(ids, candidate_replicas, salt)
        if owner is None or matched < self.min_match * len(ids):
            return fallback
        least = min(self._in_flight[r.replica_id] for r in candidate_replicas)
        if self._in_flight[owner.replica_id] - least > self.max_imbalance:
            return fallback
        self.affinity_hits += 1
        return [[owner], [r for r in candidate_replicas if r is not owner]]

    def _count(self, request_id: str, replica_id: ReplicaID, reported: bool) -> None:
        """``request_id`` is in flight on ``replica_id`` (moved there if counted elsewhere)."""
        if request_id in self._completed:
            return
        previous = self._routed.get(request_id)
        if previous is not None:
            self._uncount(previous[0])
        self._routed[request_id] = (replica_id, reported)
        self._in_flight[replica_id] += 1
        if not reported:
            self._unconfirmed.append((time.monotonic(), request_id))

    def _drop_unconfirmed(self) -> None:
        deadline = time.monotonic() - self.unconfirmed_s
        while self._unconfirmed and self._unconfirmed[0][0] < deadline:
            _, request_id = self._unconfirmed.popleft()
            entry = self._routed.get(request_id)
            if entry is not None and not entry[1]:
                del self._routed[request_id]
                self._uncount(entry[0])

    def _uncount(self, replica_id: ReplicaID) -> None:
        self._in_flight[replica_id] -= 1
        if self._in_flight[replica_id] <= 0:
            del self._in_flight[replica_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._count(pending_request.metadata.internal_request_id, replica_id, reported=True)
        ids, salt = prompt_and_salt(pending_request)
        for key in block_keys(ids or [], self.block_tokens, salt):
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self._routed.pop(internal_request_id, None)
        if routed is not None:
            self._uncount(routed[0])
        self._completed[internal_request_id] = None
        while len(self._completed) > 4096:
            self._completed.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # Its block keys stay until overwritten or forgotten: prefix_owner only answers with a
        # current candidate, and a scan of every key here would stall the router's loop.
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
