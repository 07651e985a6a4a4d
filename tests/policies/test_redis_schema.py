"""Redis is input too: every key the policies layer reads back, overwritten with garbage, oversized
and wrongly typed values on a real redis-server. The reader skips the value (last good or
default), counts it on the rejection metric, raises nothing, and the policy service keeps
publishing."""

import json
import re
import time
from collections import Counter

import numpy as np
import pytest
import redis

from specserve.cluster.redis_server import RedisServer
from specserve.policies import redis_schema
from specserve.policies.output_exchange import MAX_OUTPUT_TOKENS, OutputExchange
from specserve.policies.policy_service import PolicyService
from specserve.policies.priors import compute_snapshot, warm_start
from specserve.policies.redis_schema import REJECTED, MAX_DOCUMENT_BYTES
from specserve.policies.redis_stats import MAX_STATS_FIELDS, RedisStats
from specserve.policies.snapshot_cache import SnapshotCache
from specserve.policies.stats import StatsKey
from counters import counts

Service = PolicyService.func_or_class   # the class behind the Serve deployment
# Counters of this minute: within the service's horizon, undecayed.
RECENT = StatsKey("t", "pl", "p64", int(time.time()) // 60 * 60)


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def raw(server):
    return redis.Redis.from_url(server.url)


class Rejected:
    """What the rejection counter counted while the block ran, by (family, reason)."""

    def __enter__(self):
        self.before = REJECTED.copy()
        return self

    def __exit__(self, *exc):
        self.counted = REJECTED - self.before

    def __getitem__(self, key):
        return self.counted[key]


def good_counts():
    # α = 0.9 over γ = 2 and 6 at flat verify cost (as in test_replica_learning).
    return counts(900, 100, window=2) + counts(900, 100, window=6)


def publish_good(store: RedisStats) -> dict:
    return store.publish_snapshot(compute_snapshot({StatsKey("t", "pl", "p64", 0): good_counts()}, now=0.0))


# ---- the policy snapshot ----------------------------------------------------------------------

BAD_SNAPSHOTS = {
    "not JSON": ("json", "garbage"),
    "the reported one": ("schema", json.dumps({"version": 99, "published_at": "x", "priors": "garbage"})),
    "a JSON string": ("schema", json.dumps("a string")),
    "NaN published_at": ("schema", '{"version": 99, "published_at": NaN, "priors": []}'),
    "Infinity alpha": ("schema", '{"version": 99, "published_at": 1.0, "priors": [{"alpha": Infinity}]}'),
    "a huge version": ("schema", json.dumps({"version": 10 ** 30, "published_at": 1.0, "priors": []})),
    "a negative version": ("schema", json.dumps({"version": -1, "published_at": 1.0, "priors": []})),
    "10^6 priors": ("schema", json.dumps({"version": 99, "published_at": 1.0, "priors": [0] * 10 ** 6})),
    "alpha above 1": ("schema", None),
    "a window of 40000": ("schema", None),
    "an empty costs window list": ("schema", None),
    "a carried sum of another name": ("schema", None),
    "a negative carried sum": ("schema", None),
}


def bad_prior_snapshot(case: str, good: dict) -> str:
    doc = json.loads(json.dumps(good))
    doc["version"] = good["version"] + 1
    prior = doc["priors"][0]
    if case == "alpha above 1":
        prior["alpha"] = 1.5
    elif case == "a window of 40000":
        prior["best_window"] = 40000
    elif case == "a carried sum of another name":
        prior["learned"] = {"q_n_99_0": 1.0}   # a Q-table entry beyond any window
    elif case == "a negative carried sum":
        prior["learned"] = {"adt_requests": 1.0, "adt_depth": -50.0}
    else:   # window_for takes the max of the windows measured
        prior["costs_by_load"] = {"b1": {"draft_ms_per_token": 1.0, "verify_ms": [10.0, 0.0], "windows": []}}
    return json.dumps(doc)


@pytest.mark.parametrize("case", BAD_SNAPSHOTS)
def test_a_bad_snapshot_is_skipped_and_counted_and_the_replica_keeps_the_last_good_one(server, raw, case):
    store = RedisStats(server.url, "app")
    good = publish_good(store)
    cache = SnapshotCache(store)
    assert cache.refresh()["version"] == good["version"]
    reason, value = BAD_SNAPSHOTS[case]
    raw.set(store.snapshot_key, value if value is not None else bad_prior_snapshot(case, good))
    with Rejected() as rejected:
        assert cache.refresh()["version"] == good["version"]
        assert warm_start(cache.current(), "t", "pl", "p64")["window"] == 6
        assert store.read_snapshot() is None
    assert rejected[("policy_snapshot", reason)] == 2


def test_a_snapshot_read_by_a_new_replica_that_is_bad_leaves_it_at_the_defaults(server, raw):
    store = RedisStats(server.url, "app")
    raw.set(store.snapshot_key, json.dumps({"version": 99, "published_at": "x", "priors": "garbage"}))
    cache = SnapshotCache(store)
    with Rejected() as rejected:
        assert cache.refresh() is None and cache.current() is None
    assert rejected[("policy_snapshot", "schema")] == 1


def test_a_snapshot_key_of_another_type_or_too_large_is_skipped_without_reading_it_all(server, raw):
    store = RedisStats(server.url, "app")
    cache = SnapshotCache(store)
    raw.rpush(store.snapshot_key, "a", "list")                            # WRONGTYPE
    with Rejected() as rejected:
        assert cache.refresh() is None
    assert rejected[("policy_snapshot", "type")] == 1
    raw.delete(store.snapshot_key)
    raw.set(store.snapshot_key, b" " * (MAX_DOCUMENT_BYTES + 10))
    with Rejected() as rejected:
        assert cache.refresh() is None
    assert rejected[("policy_snapshot", "size")] == 1


def test_the_policy_service_reads_no_bad_snapshot_for_its_status(server, raw):
    service = Service(server.url, "app")
    raw.set(RedisStats(server.url, "app").snapshot_key, '{"version": 1, "published_at": NaN}')
    import asyncio

    async def read():
        service._ensure_running = lambda: None   # no publishing loop: only the read under test
        return await service.snapshot()

    assert asyncio.run(read()) is None


# ---- the version counter ----------------------------------------------------------------------

def break_version(raw, key: str, how: str) -> None:
    raw.delete(key)
    if how == "list":
        raw.rpush(key, "x")
    else:
        raw.set(key, how)


@pytest.mark.parametrize("how, reason", [("x", "schema"), ("1.5", "schema"), ("list", "type"),
                                         (str(2 ** 63 - 1), "schema"), ("-5", "size"), (str(2 ** 60), "size")])
def test_the_policy_service_keeps_publishing_when_the_version_counter_is_broken(server, raw, how, reason):
    store = RedisStats(server.url, "app")
    store.flush("r", 1, {RECENT: good_counts()})
    service = Service(server.url, "app")
    first = service.publish()
    assert first["priors"]
    break_version(raw, "app:policy:version", how)
    with Rejected() as rejected:
        second = service.publish()
    assert rejected[("version", reason)] == 1
    # Reset to one past the larger of its own last version and the stored snapshot's.
    assert second["version"] == first["version"] + 1
    # The same priors (their step counts decay with the clock between the two publications).
    same = lambda snapshot: [(p["bucket"], p["alpha"], p["best_window"]) for p in snapshot["priors"]]  # noqa: E731
    assert same(second) == same(first)
    assert int(raw.get("app:policy:version")) == second["version"]
    assert service.publish()["version"] == second["version"] + 1        # sane again: INCR as before
    cache = SnapshotCache(store)
    assert cache.refresh()["version"] == second["version"] + 1


def test_a_new_policy_service_repairs_the_counter_past_the_stored_snapshot(server, raw):
    store = RedisStats(server.url, "app")
    for _ in range(3):
        publish_good(store)
    raw.set("app:policy:version", "x")
    assert Service(server.url, "app").publish()["version"] == 4        # it has published nothing itself


# ---- statistics counters ----------------------------------------------------------------------

def test_bad_counters_are_skipped_and_the_good_ones_still_count(server, raw):
    store = RedisStats(server.url, "app")
    key = StatsKey("t", "pl", "p64", 60)
    store.flush("r", 1, {key: Counter(drafts=30, accepted_tokens=50, window_4=30)})
    name = store._stats_key(key)
    raw.hset(name, mapping={"drafts_extra": 1, "rejections": "x", "emitted": "-7", "draft_us": "1.5",
                            "verify_us": str(10 ** 20), "window_100000000": 1, "window_x": 1, "tree_4xq_steps": 2})
    with Rejected() as rejected:
        assert store.read() == {key: Counter(drafts=30, accepted_tokens=50, window_4=30)}
    assert rejected[("stats", "schema")] == 1                          # one per hash, not per field


def test_counters_hashes_that_cannot_be_ours_leave_the_index(server, raw):
    store = RedisStats(server.url, "app")
    key = StatsKey("t", "pl", "p64", 60)
    store.flush("r", 1, {key: Counter(drafts=3)})
    raw.set("app:stats:60:astring", "x")                                 # another type: WRONGTYPE
    raw.hset("app:stats:60:wide", mapping={f"f{i}": 1 for i in range(MAX_STATS_FIELDS + 1)})
    raw.hset("app:stats:60:ident", mapping={"_target": "t", "_draft": "pl", "_bucket": "p64", "_window": "x", "drafts": 1})
    raw.hset("other:stats:60:x", mapping={"_target": "t", "_draft": "pl", "_bucket": "p64", "_window": 60, "drafts": 1})
    for name in ("app:stats:60:astring", "app:stats:60:wide", "app:stats:60:ident", "other:stats:60:x"):
        raw.zadd(store.index_key, {name: 60})
    with Rejected() as rejected:
        assert store.read() == {key: Counter(drafts=3)}
    assert rejected[("stats", "type")] == 1 and rejected[("stats", "size")] == 1
    assert rejected[("stats", "schema")] == 2
    assert raw.zrange(store.index_key, 0, -1) == [store._stats_key(key).encode()]   # read once, not every time


def test_an_index_of_another_type_is_counted_and_removed_so_flushes_work_again(server, raw):
    store = RedisStats(server.url, "app")
    raw.set(store.index_key, "garbage")
    with Rejected() as rejected:
        assert store.read() == {}
    assert rejected[("stats", "type")] == 1
    key = StatsKey("t", "pl", "p64", 60)
    assert store.flush("r", 1, {key: Counter(drafts=3)})
    assert store.read() == {key: Counter(drafts=3)}


def test_the_policy_service_publishes_from_the_good_counters_among_bad_ones(server, raw):
    store = RedisStats(server.url, "app")
    store.flush("r", 1, {RECENT: good_counts()})
    raw.hset(store._stats_key(RECENT), mapping={"window_99999999": 5, "verify_us_w3": "NaN"})
    service = Service(server.url, "app")
    snapshot = service.publish()
    assert [p["bucket"] for p in snapshot["priors"]] == ["all", "p64"]
    assert SnapshotCache(store).refresh()["version"] == snapshot["version"]


# ---- routing outcomes as the store reads them ------------------------------------------------

def test_outcome_entries_that_are_not_bounded_json_objects_are_skipped(server, raw):
    store = RedisStats(server.url, "app")
    store.add_routes("r", 1, [{"request_id": "good"}])
    for value in ("garbage", "[" * 60_000, '{"a": NaN}', '"a string"', "[" * 100_000, json.dumps({"x": "y" * 70_000})):
        raw.xadd(store.routes_key, {"o": value})
    store.add_routes("r", 2, [{"request_id": "last"}])
    with Rejected() as rejected:
        assert [o["request_id"] for o in store.read_routes()] == ["good", "last"]
    assert rejected[("router_outcome", "json")] == 2 and rejected[("router_outcome", "schema")] == 2
    assert rejected[("router_outcome", "size")] == 2
    raw.delete(store.routes_key)
    raw.set(store.routes_key, "not a stream")
    with Rejected() as rejected:
        assert store.read_routes() == []
    assert rejected[("router_outcome", "type")] == 1


# ---- shared outputs --------------------------------------------------------------------------

def test_output_entries_out_of_bounds_are_skipped_and_the_good_ones_received(server, raw):
    reader = OutputExchange(server.url, "app", "t", vocab_size=1000)
    key = reader.key
    good = np.array([1, 2, 999], dtype="<i4").tobytes()
    raw.xadd(key, {"r": "other", "t": good})
    raw.xadd(key, {"r": "other", "t": b"\x01\x02\x03\x04\x05"})                               # not whole int32s
    raw.xadd(key, {"r": "other", "t": np.array([-1, 5], dtype="<i4").tobytes()})               # negative
    raw.xadd(key, {"r": "other", "t": np.array([1000], dtype="<i4").tobytes()})                # beyond the vocabulary
    raw.xadd(key, {"r": "other", "t": np.zeros(MAX_OUTPUT_TOKENS + 1, dtype="<i4").tobytes()})  # too long
    raw.xadd(key, {"r": "other", "t": good, "s": b"\xff\xfe"})                                 # a salt not UTF-8
    raw.xadd(key, {"r": "other", "t": good, "s": "s" * 1000})                                 # a salt too long
    raw.xadd(key, {"r": "other", "t": good, "s": "tenant"})
    got = []
    with Rejected() as rejected:
        assert reader.exchange_once(lambda salt, tokens: got.append((salt, tokens.tolist()))) == 2
    assert got == [(None, [1, 2, 999]), ("tenant", [1, 2, 999])]
    assert rejected[("output", "size")] == 3 and rejected[("output", "schema")] == 3


def test_one_exchange_reads_at_most_max_outputs_entries(server, raw):
    reader = OutputExchange(server.url, "app", "t", max_outputs=100)
    pipe = raw.pipeline()
    for _ in range(1000):   # written without the cap
        pipe.xadd(reader.key, {"r": "other", "t": np.array([1], dtype="<i4").tobytes()})
    pipe.execute()
    assert reader.exchange_once(lambda *_: None) == 100
    assert reader.exchange_once(lambda *_: None) == 100


def test_an_output_stream_of_another_type_is_counted_not_taken_for_an_outage(server, raw):
    reader = OutputExchange(server.url, "app", "t")
    raw.set(reader.key, "x")
    with Rejected() as rejected:
        assert reader.exchange_once(lambda *_: None) == 0
    assert rejected[("output", "type")] == 1 and reader._down_since is None


# ---- the metric --------------------------------------------------------------------------------

def test_a_rejection_is_counted_on_the_ray_metric_with_family_and_reason(monkeypatch):
    recorded = []

    class FakeCounter:
        def inc(self, value=1.0, tags=None):
            recorded.append((value, tags))

    monkeypatch.setattr(redis_schema, "_metric", FakeCounter())
    redis_schema.reject("policy_snapshot", "json", "app:policy:snapshot", "garbage")
    assert recorded == [(1.0, {"family": "policy_snapshot", "reason": "json"})]


def test_the_metric_is_made_outside_ray_and_named_for_prometheus(monkeypatch):
    monkeypatch.setattr(redis_schema, "_metric", None)
    redis_schema.reject("stats", "schema", "k")
    assert redis_schema._metric._name == "specserve_redis_rejected_values"
    assert {"family", "reason"} <= set(redis_schema._metric._tag_keys)


def test_bytes_that_are_not_utf8_are_skipped_not_raised(server, raw):
    store = RedisStats(server.url, "app")
    good = publish_good(store)
    cache = SnapshotCache(store)
    assert cache.refresh()["version"] == good["version"]
    raw.set(store.snapshot_key, b'{"version": \xff\xfe}')
    key = StatsKey("t", "pl", "p64", 60)
    store.flush("r", 1, {key: Counter(drafts=3)})
    raw.hset(store._stats_key(key), mapping={b"\xff": b"\xfe"})
    with Rejected() as rejected:
        assert cache.refresh()["version"] == good["version"]
        assert store.read() == {key: Counter(drafts=3)}
    assert rejected[("policy_snapshot", "json")] == 1 and rejected[("stats", "schema")] == 1


def test_the_policy_service_leaves_out_a_prior_its_readers_would_refuse(server, monkeypatch):
    # One prior out of bounds (a fitted intercept near 0 makes a huge latency ratio) must not make
    # every replica refuse the whole snapshot.
    from specserve.policies import policy_service

    def one_bad(*args, **kwargs):
        snapshot = compute_snapshot(*args, **kwargs)
        snapshot["priors"][0] = {**snapshot["priors"][0], "latency_ratio": 1e300}
        return snapshot

    store = RedisStats(server.url, "app")
    store.flush("r", 1, {RECENT: good_counts()})
    monkeypatch.setattr(policy_service, "compute_snapshot", one_bad)
    with Rejected() as rejected:
        published = Service(server.url, "app").publish()
    assert len(published["priors"]) == 1 and rejected[("policy_snapshot", "schema")] == 1
    assert SnapshotCache(store).refresh()["version"] == published["version"]


def test_stream_entries_with_a_field_over_the_bound_are_left_on_the_server(server, raw):
    # One 4 MB outcome and one 1 MB output are counted, never read; the entries around them are.
    from specserve.policies.redis_stats import MAX_OUTCOME_BYTES

    store = RedisStats(server.url, "app")
    raw.xadd(store.routes_key, {"o": json.dumps({"n": 1})})
    raw.xadd(store.routes_key, {"o": "x" * (4 << 20)})
    raw.xadd(store.routes_key, {"o": json.dumps({"n": 2})})
    exchange = OutputExchange(server.url, "app", "t", max_outputs=8)
    raw.xadd(exchange.key, {"r": b"other", "t": np.arange(3, dtype="<i4").tobytes()})
    raw.xadd(exchange.key, {"r": b"other", "t": b"\0" * (4 * MAX_OUTPUT_TOKENS + 4)})
    raw.xadd(exchange.key, {"r": b"other", "t": np.arange(5, dtype="<i4").tobytes()})
    received = []
    sent_before = raw.info("stats")["total_net_output_bytes"]
    with Rejected() as rejected:
        assert store.read_routes() == [{"n": 1}, {"n": 2}]
        exchange.exchange_once(lambda salt, tokens: received.append(len(tokens)))
    assert received == [3, 5]
    assert raw.info("stats")["total_net_output_bytes"] - sent_before < 64 * 1024   # the server sent neither
    assert rejected[("router_outcome", "size")] == 1 and rejected[("output", "size")] == 1
    assert MAX_OUTCOME_BYTES < 4 << 20


def test_a_prior_carries_an_ensembles_hits_and_refuses_their_names_out_of_bounds():
    # Names say the views (indexes in VIEWS) and the grid; j below the 300 candidates carried.
    from pydantic import ValidationError

    prior = compute_snapshot({StatsKey("t", "pl", "p64", 0): good_counts()}, now=0.0)["priors"][0]
    good = {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_0": 3.0, "tabed_0123_g10_hits_285": 1.0}
    assert redis_schema.Prior.model_validate({**prior, "learned": good}).learned == good
    counter = re.compile(redis_schema.COUNTER_NAME)
    assert all(counter.match(name) for name in good)
    for name in ("tabed_01_g10_hits_300", "tabed_01_g0_positions", "tabed_01_g300_positions", "tabed_6_g10_positions",
                 "tabed_0123456_g10_positions", "tabed_01_g10_hits_01", "tabed_01_g10_misses_3", "tabed_positions"):
        assert not counter.match(name), name
        with pytest.raises(ValidationError):
            redis_schema.Prior.model_validate({**prior, "learned": {name: 1.0}})
    with pytest.raises(ValidationError):
        redis_schema.Prior.model_validate({**prior, "learned": {"tabed_01_g10_positions": -1.0}})
    # A full Q-table and two ensembles' largest candidate sets fit in one prior.
    full = {f"q_{k}_{s}_{a}": 1.0 for k in ("n", "mq") for s in range(17) for a in range(17)}
    for views in ("0123", "0124"):
        full.update({f"tabed_{views}_g10_hits_{j}": 1.0 for j in range(300)} | {f"tabed_{views}_g10_positions": 9.0})
    assert len(redis_schema.Prior.model_validate({**prior, "learned": full}).learned) == len(full)
