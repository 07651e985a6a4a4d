"""The Redis statistics store: counters in, cluster snapshots out. JSON and integers only.

Layout, all under one key prefix per application (two applications can share a Redis):

    <prefix>:stats:<window>:<id>    hash: counter -> integer (``HINCRBY``), plus the key's identity
                                    (_target, _draft, _bucket, _window); expires after ``ttl_s``
    <prefix>:stats:index            sorted set: stats hash -> window start (what the reader scans)
    <prefix>:flushed:<flusher>:<n>  "flush n of this replica was applied" (exactly-once, below)
    <prefix>:policy:snapshot        the policy service's latest snapshot (a JSON document)
    <prefix>:policy:version         the snapshot version counter
    <prefix>:router:outcomes        stream, capped: finished requests' routing decisions, features and
                                    realised acceptance (one JSON field ``o`` per entry)
    <prefix>:router:weights         the draft router's acceptance models, retrained by the policy
                                    service from that stream (a JSON document, versioned like the
                                    snapshot: ``<prefix>:router:version``)

**Exactly once.** A flush (of counters, or of routing outcomes) is one Lua script: it sets the flush's marker with ``NX`` and applies
the increments only if the marker was new, atomically. A replica whose flush times out retries
the *same* flush (same number, same counts) until Redis answers, so a flush whose reply was lost
is not counted twice and a flush that never arrived is not lost. (The script names keys it was
not passed in ``KEYS``, so it needs a single Redis, not Redis Cluster.)

Clients use bounded timeouts and no retry loop of their own: callers decide (the exporter keeps
its batch; the snapshot reader keeps its last snapshot).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter

import redis

from specserve.policies.stats import StatsKey

_FLUSH = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
local batch = cjson.decode(ARGV[2])
for _, entry in ipairs(batch) do
  local key = entry[1]
  for field, n in pairs(entry[2]) do redis.call('HINCRBY', key, field, n) end
  redis.call('HSET', key, '_target', entry[3], '_draft', entry[4], '_bucket', entry[5], '_window', entry[6])
  redis.call('EXPIRE', key, ARGV[3])
  redis.call('ZADD', ARGV[4], entry[6], key)
end
return 1
"""
_ROUTES = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
for _, outcome in ipairs(cjson.decode(ARGV[2])) do
  redis.call('XADD', ARGV[3], 'MAXLEN', '~', ARGV[4], '*', 'o', outcome)
end
return 1
"""
_IDENTITY = ("_target", "_draft", "_bucket", "_window")


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for ``redis://`` or ``rediss://`` (TLS) URLs, password in the URL; every call is
    bounded by ``timeout_s``."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                decode_responses=True, retry_on_timeout=False)


class RedisStats:
    def __init__(self, url: str, prefix: str = "specserve", ttl_s: int = 7 * 24 * 3600, timeout_s: float = 0.5):
        if not prefix or any(c in prefix for c in " \n"):
            raise ValueError(f"a Redis key prefix must be a non-empty word, got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.client = connect(url, timeout_s)
        self._flush = self.client.register_script(_FLUSH)
        self._routes = self.client.register_script(_ROUTES)

    # ---- keys ---------------------------------------------------------------------------------

    def _stats_key(self, key: StatsKey) -> str:
        ident = hashlib.sha1(f"{key.target}\0{key.draft}\0{key.bucket}".encode()).hexdigest()[:16]
        return f"{self.prefix}:stats:{key.window_start}:{ident}"

    @property
    def index_key(self) -> str:
        return f"{self.prefix}:stats:index"

    @property
    def snapshot_key(self) -> str:
        return f"{self.prefix}:policy:snapshot"

    # ---- counters -----------------------------------------------------------------------------

    def flush(self, flusher: str, number: int, counts: dict[StatsKey, Counter]) -> bool:
        """Apply one flush; False when this (flusher, number) was applied before. Raises
        ``redis.RedisError`` / ``OSError`` when Redis does not answer: retry the same flush."""
        batch = [[self._stats_key(k), {f: int(n) for f, n in c.items() if n}, k.target, k.draft, k.bucket, k.window_start]
                 for k, c in counts.items()]
        marker = f"{self.prefix}:flushed:{flusher}:{number}"
        return bool(self._flush(keys=[marker], args=[self.ttl_s, json.dumps(batch), self.ttl_s, self.index_key]))

    def read(self, since: float | None = None) -> dict[StatsKey, Counter]:
        """Every counter hash whose window starts at or after ``since`` (unix s; default: all kept)."""
        names = self.client.zrangebyscore(self.index_key, "-inf" if since is None else since, "+inf")
        if not names:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        out: dict[StatsKey, Counter] = {}
        stale = []
        for name, fields in zip(names, pipe.execute()):
            if not fields or "_target" not in fields:
                stale.append(name)   # expired: drop it from the index
                continue
            key = StatsKey(fields["_target"], fields["_draft"], fields["_bucket"], int(fields["_window"]))
            out.setdefault(key, Counter()).update({f: int(v) for f, v in fields.items() if f not in _IDENTITY})
        if stale:
            self.client.zrem(self.index_key, *stale)
        return out

    # ---- snapshots ----------------------------------------------------------------------------

    def publish_snapshot(self, snapshot: dict, name: str = "policy") -> dict:
        """Stamp ``snapshot`` with the next version and the time, store it, return it. ``name``:
        which document (``policy``: the priors; ``router``: the router's weights)."""
        version = int(self.client.incr(f"{self.prefix}:{name}:version"))
        stamped = {**snapshot, "version": version, "published_at": time.time()}
        self.client.set(self._document_key(name), json.dumps(stamped))
        return stamped

    def read_snapshot(self, name: str = "policy") -> dict | None:
        key = self._document_key(name)
        raw = self.client.get(key)
        if raw is None:
            return None
        snapshot = json.loads(raw)
        if not isinstance(snapshot, dict) or "version" not in snapshot:
            raise ValueError(f"{key} does not hold a versioned {name} document")
        return snapshot

    def _document_key(self, name: str) -> str:
        return self.snapshot_key if name == "policy" else f"{self.prefix}:{name}:weights"

    # ---- routing outcomes ---------------------------------------------------------------------

    @property
    def routes_key(self) -> str:
        return f"{self.prefix}:router:outcomes"

    def add_routes(self, flusher: str, number: int, outcomes: list[dict], maxlen: int = 20000) -> bool:
        """Append finished requests' routing outcomes to the capped stream, exactly once per
        (flusher, number) like ``flush``; raises when Redis does not answer: retry the same batch."""
        marker = f"{self.prefix}:flushed-routes:{flusher}:{number}"
        encoded = json.dumps([json.dumps(o, sort_keys=True) for o in outcomes])
        return bool(self._routes(keys=[marker], args=[self.ttl_s, encoded, self.routes_key, maxlen]))

    def read_routes(self, count: int | None = None) -> list[dict]:
        """The stream's outcomes, oldest first: all of them, or the newest ``count``."""
        if count is None:
            entries = self.client.xrange(self.routes_key)
        else:
            entries = list(reversed(self.client.xrevrange(self.routes_key, count=count)))
        out = []
        for _, fields in entries:
            try:
                outcome = json.loads(fields.get("o", ""))
            except json.JSONDecodeError:
                continue   # not ours: skip, never fail the reader
            if isinstance(outcome, dict):
                out.append(outcome)
        return out
