"""What specserve reads back from Redis, checked before anything uses it.

Redis is shared input: another application under a wrong prefix, an operator's ``redis-cli``, a
bug in an older version or an attacker with the password can leave any value under any key. So
every value read back is parsed into a bounded model first (finite numbers within ranges, bounded
lengths, versions that are integers); a value that does not parse is skipped: the reader keeps its
last good value or its default, never raises into a request and never allocates from an untrusted
number. Each one skipped is counted on Ray's metrics endpoint,

    specserve_redis_rejected_values   values read from Redis and skipped, by ``family`` (the kind of
                                      key: policy_snapshot, router_weights, version, stats,
                                      router_outcome, output) and ``reason`` (type: another Redis
                                      type, e.g. WRONGTYPE; size: over its bound; json: not JSON;
                                      schema: JSON of the wrong shape or out of range)

and logged at most once a minute per family and reason (a bad key is read every few seconds).
``REJECTED`` keeps the same counts in the process, for tests and status pages.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Annotated, Literal, TypeVar

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specserve.policies.carry import LEARNED_COUNTERS
from specserve.policies.stats import LOAD_BUCKETS
from specserve.replicas.drafts.ensemble_carry import MAX_CANDIDATES as MAX_ENSEMBLE_CANDIDATES

logger = logging.getLogger("ray.serve")

# Bounds. Windows and tree shapes as the API allows them (ingress/openai_api.py); a count is exact
# in a JSON double below 2^53; a millisecond cost beyond 10^6 (a quarter of an hour per step) is
# garbage, not a measurement.
MAX_WINDOW = 16
MAX_TREE_DEPTH = 16
MAX_TOP_K = 64
MAX_COUNT = 2 ** 53
MAX_VERSION = 2 ** 53
MAX_MS = 1e6
MAX_TIME_S = 1e11          # unix seconds, year 5138: far enough, and finite
MAX_NAME = 256             # target, draft and bucket names
MAX_PRIORS = 4096
MAX_DOCUMENT_BYTES = 8 * 2 ** 20
LOG_EVERY_S = 60.0

Family = Literal["policy_snapshot", "router_weights", "version", "stats", "router_outcome", "output"]
Reason = Literal["type", "size", "json", "schema"]

REJECTED: Counter = Counter()   # (family, reason) -> values skipped in this process
_lock = threading.Lock()
_last_logged: dict[tuple[str, str], float] = {}
_metric = None


def _counter():
    # Created on first use, inside the replica that rejects (outside Ray it records nothing).
    global _metric
    if _metric is None:
        from ray.serve import metrics

        _metric = metrics.Counter("specserve_redis_rejected_values", "Values read from Redis that failed their schema and were skipped.",
                                  tag_keys=("family", "reason"))
    return _metric


def reject(family: Family, reason: Reason, key: str, detail: object = "") -> None:
    """Count and (rate-limited) log one value skipped; the caller goes on without it."""
    now = time.monotonic()
    with _lock:
        REJECTED[(family, reason)] += 1
        last = _last_logged.get((family, reason))
        log = last is None or now - last >= LOG_EVERY_S
        if log:
            _last_logged[(family, reason)] = now
    _counter().inc(tags={"family": family, "reason": reason})
    if log:
        logger.warning("Redis key %s holds a bad %s value (%s: %s); skipped and counted on "
                       "specserve_redis_rejected_values (logged once a minute)", key, family, reason, str(detail)[:300])


def is_wrong_type(err: redis.ResponseError) -> bool:
    return "WRONGTYPE" in str(err)   # also as a script's error, which wraps Redis's own


# A stream's entries with every field value longer than ARGV[3] bytes left on the server: such an
# entry comes back as {oversize: <bytes>}. ARGV[4] = 1: the newest ARGV[2] entries, newest first;
# else those after the id ARGV[1], oldest first.
_STREAM_RANGE = """
local entries
if ARGV[4] == '1' then
  entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[2])
else
  entries = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
end
local limit = tonumber(ARGV[3])
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for i = 2, #fields, 2 do
    if string.len(fields[i]) > limit then
      entry[2] = {'oversize', tostring(string.len(fields[i]))}
      break
    end
  end
end
return entries
"""
OVERSIZE = "oversize"


def stream_range(client: redis.Redis, key: str, count: int, max_field_bytes: int, after: str | bytes = "0-0",
                 newest: bool = False) -> list[tuple]:
    """``(id, fields)`` of up to ``count`` stream entries (after the id ``after``, or the newest
    first), no field longer than ``max_field_bytes`` ever transferred: XRANGE would send a value of
    up to 512 MB whole before a reader could check it. An entry with a longer field comes back as
    ``{"oversize": <bytes>}`` (keys of the client's type) for the caller to count. Raises
    ``redis.ResponseError`` for a key of another type (``is_wrong_type``)."""
    script = getattr(client, "_specserve_stream_range", None)
    if script is None:
        script = client._specserve_stream_range = client.register_script(_STREAM_RANGE)
    after = after.decode() if isinstance(after, bytes) else after
    entries = script(keys=[key], args=[after, count, max_field_bytes, 1 if newest else 0])
    return [(entry_id, dict(zip(fields[::2], fields[1::2]))) for entry_id, fields in entries]


def get_bounded(client: redis.Redis, key: str, family: Family, max_bytes: int = MAX_DOCUMENT_BYTES) -> str | bytes | None:
    """A string value of at most ``max_bytes``, or None (absent, another type, or larger: those
    two counted). ``GETRANGE`` never transfers more than the bound, however large the value."""
    try:
        raw = client.getrange(key, 0, max_bytes)
    except redis.ResponseError as err:
        if not is_wrong_type(err):
            raise
        reject(family, "type", key, err)
        return None
    if not raw:
        return None
    if len(raw) > max_bytes:
        reject(family, "size", key, f"over {max_bytes} bytes")
        return None
    return raw


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: str | bytes, family: Family, key: str) -> M | None:
    """``raw`` JSON as ``model``, or None (counted)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        reason = "json" if any(e["type"] == "json_invalid" for e in err.errors()) else "schema"
        reject(family, reason, key, err)
        return None


def valid(model: type[BaseModel], items: list, family: Family, key: str, most: int) -> list:
    """The ``items`` (dicts about to be written) that ``model`` accepts, at most ``most``: a
    writer keeps what its readers would refuse out of its document, so that one bad entry does not
    make every reader refuse the whole of it. The rest are counted."""
    kept = []
    for item in items:
        try:
            model.model_validate(item)
        except ValidationError as err:
            reject(family, "schema", key, err)
            continue
        if len(kept) == most:
            reject(family, "size", key, f"over {most} entries")
            break
        kept.append(item)
    return kept


# ---- the policy snapshot ------------------------------------------------------------------------

class Strict(BaseModel):
    """Finite floats only; fields not named here are dropped (a newer writer's additions)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Rate = Annotated[float, Field(ge=0.0, le=1.0)]
Ms = Annotated[float, Field(ge=0.0, le=MAX_MS)]
SignedMs = Annotated[float, Field(ge=-MAX_MS, le=MAX_MS)]   # a fitted line's intercept may be negative
Amount = Annotated[float, Field(ge=0.0, le=MAX_COUNT)]
Window = Annotated[int, Field(ge=0, le=MAX_WINDOW)]
LoadBucket = Literal[LOAD_BUCKETS]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Time = Annotated[float, Field(ge=0.0, le=MAX_TIME_S)]
VerifyLine = Annotated[list[SignedMs], Field(min_length=2, max_length=2)]   # b0, b1 of b(γ) = b0 + b1·γ


class LoadCosts(Strict):
    draft_ms_per_token: Ms
    verify_ms: VerifyLine
    windows: list[Window] = Field(min_length=1, max_length=MAX_WINDOW + 1)
    verify_ms_by_window: dict[Annotated[str, Field(pattern=r"^([0-9]|1[0-6])$")], Ms] = Field(
        default_factory=dict, max_length=MAX_WINDOW + 1)


# A carried sum's name (``carry.LEARNED_COUNTERS``), and how many a prior holds at most: a full
# Q-table's two counts per entry, the tree rules' few, and two TABED ensembles' candidate sets (a
# changed config's counts beside the new one's until they age out).
LearnedName = Annotated[str, Field(pattern="^(" + "|".join(LEARNED_COUNTERS) + ")$")]
MAX_LEARNED = 2 * (MAX_WINDOW + 1) ** 2 + 16 + 2 * (MAX_ENSEMBLE_CANDIDATES + 1)


class BestTree(Strict):
    depth: int = Field(ge=1, le=MAX_TREE_DEPTH)
    top_k: int = Field(ge=1, le=MAX_TOP_K)
    tokens_per_ms: Amount


class Prior(Strict):
    target: Name
    draft: Name
    bucket: Name
    steps: Amount
    requests: Amount = 0.0
    alpha: Rate
    mean_accepted_len: float = Field(ge=0.0, le=MAX_TREE_DEPTH + 1)
    acceptance_by_position: list[Rate] = Field(default_factory=list, max_length=MAX_TREE_DEPTH)
    draft_ms_per_token: Ms
    verify_ms: VerifyLine
    latency_ratio: Amount | None = None
    best_window: Window
    costs_by_load: dict[LoadBucket, LoadCosts] = Field(default_factory=dict)
    best_window_by_load: dict[LoadBucket, Window] = Field(default_factory=dict)
    plain_share: Rate = 0.0
    best_tree: BestTree | None = None
    best_tree_by_load: dict[LoadBucket, BestTree] = Field(default_factory=dict)
    learned: dict[LearnedName, Amount] = Field(default_factory=dict, max_length=MAX_LEARNED)


class PolicySnapshot(Strict):
    """``priors.compute_snapshot``'s document as ``RedisStats.publish_snapshot`` stamped it."""

    version: Version
    published_at: Time
    format: int = Field(1, ge=0, le=1000)
    computed_at: Time | None = None
    half_life_s: float | None = Field(None, gt=0.0, le=MAX_TIME_S)
    min_steps: int | None = Field(None, ge=0, le=MAX_COUNT)
    priors: list[Prior] = Field(default_factory=list, max_length=MAX_PRIORS)


class Versioned(Strict):
    """Any published document, read for its version alone."""

    version: Version
    published_at: Time


# ---- counters -----------------------------------------------------------------------------------

class StatsIdentity(BaseModel):
    """The identity fields of a counters hash (``RedisStats.flush``)."""

    target: Name = Field(alias="_target")
    draft: Name = Field(alias="_draft")
    bucket: Name = Field(alias="_bucket")
    window: int = Field(alias="_window", ge=0, le=int(MAX_TIME_S))


# A counter's name: the fields ``stats.counts_from_record`` writes, with windows, positions and
# tree shapes within the API's limits (``priors`` turns the numbers in them into loops).
_W = r"([0-9]|1[0-6])"
_LOAD = "(" + "|".join(b.replace("+", r"\+") for b in LOAD_BUCKETS) + ")"
COUNTER_NAME = (r"^(drafts|draft_tokens|accepted_tokens|rejections|emitted|plain_steps|draft_us|verify_us|requests"
                rf"|accepted_pos_{_W}|window_{_W}|verify_us_w{_W}"
                rf"|load_{_LOAD}_(steps_w{_W}|verify_us_w{_W}|draft_us|draft_tokens)"
                rf"|(load_{_LOAD}_)?tree_([1-9]|1[0-6])x([1-9]|[1-5][0-9]|6[0-4])_(steps|emitted|us)"
                rf"|{'|'.join(LEARNED_COUNTERS)})$")
# HINCRBY's canonical decimal, at most MAX_COUNT.
COUNTER_VALUE = r"^(0|[1-9][0-9]{0,15})$"

