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

**Everything read back is checked** (``redis_schema``): counters, documents, version counters and
outcomes that fail their schema or bounds are skipped and counted, never raised to the caller;
only Redis not answering raises.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter

import redis
from pydantic import BaseModel, JsonValue, TypeAdapter, ValidationError

from specserve.policies.redis_schema import (
    COUNTER_NAME,
    COUNTER_VALUE,
    MAX_COUNT,
    MAX_VERSION,
    OVERSIZE,
    PolicySnapshot,
    StatsIdentity,
    Versioned,
    get_bounded,
    is_wrong_type,
    parse,
    reject,
    stream_range,
)
from specserve.policies.stats import StatsKey

logger = logging.getLogger("ray.serve")

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
_COUNTER_NAME, _COUNTER_VALUE = re.compile(COUNTER_NAME), re.compile(COUNTER_VALUE)
_JSON_OBJECT = TypeAdapter(dict[str, JsonValue])
# Bounds of what one read takes in: counters hashes (a week of 60 s windows for ~100 keys each),
# fields per hash (every counter name there is), routing outcomes and one outcome's size.
MAX_STATS_HASHES = 250_000
MAX_STATS_FIELDS = 4096
MAX_ROUTES = 50_000
MAX_OUTCOME_BYTES = 64 * 1024


def connect(url: str, timeout_s: float = 0.5) -> redis.Redis:
    """A client for ``redis://`` or ``rediss://`` (TLS) URLs, password in the URL; every call is
    bounded by ``timeout_s``. Bytes that are not UTF-8 decode to U+FFFD instead of raising: such a
    value then fails its schema and is skipped like any other bad one."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                decode_responses=True, encoding_errors="replace", retry_on_timeout=False)


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
        self._versions: dict[str, int] = {}   # document -> the last version this writer published

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
        """Every counter hash whose window starts at or after ``since`` (unix s; default: all kept).
        Hashes and counters that fail their schema (``redis_schema``) are skipped and counted;
        index entries that cannot be counters hashes (another type, another prefix, too many
        fields) leave the index, so that they are not read again."""
        try:
            names = self.client.zrangebyscore(self.index_key, "-inf" if since is None else since, "+inf",
                                              start=0, num=MAX_STATS_HASHES)
        except redis.ResponseError as err:
            if not is_wrong_type(err):
                raise
            # Nothing in a key of another type can be counters, and the flushes' ZADD fails on it.
            reject("stats", "type", self.index_key, err)
            self.client.delete(self.index_key)
            return {}
        if not names:
            return {}
        mine = f"{self.prefix}:stats:"
        unusable = {n for n in names if not n.startswith(mine) or n == self.index_key}
        for name in unusable:
            reject("stats", "schema", self.index_key, f"index entry {name[:100]!r} is not a counters hash of {self.prefix}")
        names = [n for n in names if n not in unusable]
        sizes = self._pipelined("hlen", names)
        unusable, readable = list(unusable), []
        for name, size in zip(names, sizes):
            if isinstance(size, redis.ResponseError):
                reject("stats", "type", name, size)
                unusable.append(name)
            elif size > MAX_STATS_FIELDS:
                reject("stats", "size", name, f"{size} fields")
                unusable.append(name)
            else:
                readable.append(name)
        out: dict[StatsKey, Counter] = {}
        stale = list(unusable)
        for name, fields in zip(readable, self._pipelined("hgetall", readable)):
            if isinstance(fields, redis.ResponseError) or not fields or "_target" not in fields:
                stale.append(name)   # expired (or replaced since): drop it from the index
                continue
            try:
                ident = StatsIdentity.model_validate({f: fields.get(f) for f in _IDENTITY})
            except ValidationError as err:
                reject("stats", "schema", name, err)
                stale.append(name)
                continue
            counts, bad = Counter(), []
            for field, value in fields.items():
                if field in _IDENTITY:
                    continue
                if _COUNTER_NAME.match(field) and _COUNTER_VALUE.match(value) and int(value) <= MAX_COUNT:
                    counts[field] = int(value)
                else:
                    bad.append(field)
            if bad:   # the good counters of the hash still count
                reject("stats", "schema", name, f"counters {', '.join(f[:40] for f in bad[:5])}")
            key = StatsKey(ident.target, ident.draft, ident.bucket, ident.window)
            out.setdefault(key, Counter()).update(counts)
        if stale:
            self.client.zrem(self.index_key, *stale)
        return out

    def _pipelined(self, command: str, names: list[str]) -> list:
        """``command`` on every key in one round trip; a key's error is its answer, not raised."""
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            getattr(pipe, command)(name)
        return pipe.execute(raise_on_error=False)

    # ---- snapshots ----------------------------------------------------------------------------

    def publish_snapshot(self, snapshot: dict, name: str = "policy") -> dict:
        """Stamp ``snapshot`` with the next version and the time, store it, return it. ``name``:
        which document (``policy``: the priors; ``router``: the router's weights)."""
        stamped = {**snapshot, "version": self._next_version(name), "published_at": time.time()}
        self.client.set(self._document_key(name), json.dumps(stamped))
        return stamped

    def _next_version(self, name: str) -> int:
        """``INCR`` of the version counter. A counter that is not an integer in 1..2^53 (INCR
        fails, or counts from garbage) is counted and reset to one past the larger of this
        writer's last version and the stored document's: publishing goes on at once, and versions
        still increase for whoever compares them (replicas only ask for a different one). Only
        the policy service writes this key, so the reset races no other writer."""
        key = f"{self.prefix}:{name}:version"
        try:
            version = int(self.client.incr(key))
            if 1 <= version <= MAX_VERSION:
                self._versions[name] = version
                return version
            reject("version", "size", key, f"INCR gave {version}")
        except redis.ResponseError as err:   # not an integer, out of range, or another type
            reject("version", "type" if is_wrong_type(err) else "schema", key, err)
        stored = self.read_snapshot(name, Versioned)
        version = max(self._versions.get(name, 0), stored["version"] if stored else 0) + 1
        self.client.set(key, version)
        logger.warning("Redis key %s reset to %d", key, version)
        self._versions[name] = version
        return version

    def read_snapshot(self, name: str = "policy", schema: type[BaseModel] | None = None) -> dict | None:
        """The stored document checked against ``schema`` (the policy snapshot's by default), or
        None: absent, or a value that fails it (counted, ``redis_schema``). Raises only when
        Redis does not answer."""
        key = self._document_key(name)
        family = "policy_snapshot" if name == "policy" else "router_weights"
        raw = get_bounded(self.client, key, family)
        if raw is None:
            return None
        document = parse(schema or (PolicySnapshot if name == "policy" else Versioned), raw, family, key)
        return None if document is None else document.model_dump()

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
        """The stream's outcomes, oldest first: the newest ``count``, at most ``MAX_ROUTES``.
        Entries that are not a bounded JSON object of finite numbers are skipped and counted;
        what an outcome's fields mean the router checks (``router/retrain.py``)."""
        count = MAX_ROUTES if count is None else max(0, min(count, MAX_ROUTES))
        try:
            entries = list(reversed(stream_range(self.client, self.routes_key, count, MAX_OUTCOME_BYTES, newest=True)))
        except redis.ResponseError as err:
            if not is_wrong_type(err):
                raise
            reject("router_outcome", "type", self.routes_key, err)
            return []
        out = []
        for _, fields in entries:
            if OVERSIZE in fields:   # left on the server
                reject("router_outcome", "size", self.routes_key, f"a field of {fields[OVERSIZE]} bytes")
                continue
            raw = fields.get("o", "")
            try:
                outcome = _JSON_OBJECT.validate_json(raw)
                json.dumps(outcome, allow_nan=False)   # NaN and Infinity are not JSON to a client
            except ValidationError as err:
                reason = "json" if any(e["type"] == "json_invalid" for e in err.errors()) else "schema"
                reject("router_outcome", reason, self.routes_key, err)
                continue
            except ValueError as err:
                reject("router_outcome", "schema", self.routes_key, err)
                continue
            out.append(outcome)
        return out
