"""Statistics through a real redis-server: exactly-once flushes, two replicas into one snapshot,
a Redis killed and restarted, the policy service restarted, snapshots and their staleness."""

import os
import signal
import subprocess
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import redis

from specserve.cluster.redis_server import RedisServer, free_port, ping, redis_server_binary
from specserve.policies import policy_service
from specserve.policies.policy_service import PolicyService
from specserve.policies.redis_stats import RedisStats
from specserve.policies.snapshot_cache import SnapshotCache
from specserve.policies.stats import StatsCollector, StatsKey, task_bucket
from specserve.policies.stats_exporter import RedisExporter
from conftest import wait_until
from test_stats import Clock, record, step

Service = PolicyService.func_or_class   # the class behind the Serve deployment


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


def kill(server: RedisServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    assert not wait_until(lambda: ping(server.url), lambda up: not up, timeout=10)


def collector_with_steps(target="t", draft="pl", steps=30, accepted=3, window=4, prompt=10, request="r"):
    c = StatsCollector(target)
    c.start(request, draft, task_bucket(prompt))
    for _ in range(steps):
        c.observe(record(step(request, draft, proposed=window, accepted=accepted, max_depth=window)))
    return c


def total(store: RedisStats, field: str) -> int:
    return sum(c[field] for c in store.read().values())


def test_a_flush_applies_once_even_when_retried(server):
    store = RedisStats(server.url, "app")
    counts = {StatsKey("t", "pl", "p64", 60): Counter(drafts=3, accepted_tokens=5)}
    assert store.flush("replica-1", 1, counts)
    assert not store.flush("replica-1", 1, counts)          # the same flush again: a lost reply, retried
    assert store.flush("replica-1", 2, counts)
    assert store.flush("replica-2", 1, counts)               # another replica's flush 1 is its own
    assert store.read() == {StatsKey("t", "pl", "p64", 60): Counter(drafts=9, accepted_tokens=15)}
    assert store.read(since=61) == {}


def test_prefixes_keep_two_applications_apart(server):
    a, b = RedisStats(server.url, "app-a"), RedisStats(server.url, "app-b")
    a.flush("r", 1, {StatsKey("t", "pl", "p64", 0): Counter(drafts=1)})
    assert b.read() == {} and b.read_snapshot() is None
    a.publish_snapshot({"priors": []})
    assert b.read_snapshot() is None and a.read_snapshot()["version"] == 1


def test_a_password_in_the_url(tmp_path):
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--requirepass", "s3cret"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://:s3cret@127.0.0.1:{port}/0"
        up = wait_until(lambda: ping(url), lambda up: up or proc.poll() is not None, timeout=10)
        assert up and proc.poll() is None, "redis-server with a password did not start"
        with pytest.raises(redis.AuthenticationError):
            RedisStats(f"redis://127.0.0.1:{port}/0").read()
        store = RedisStats(url)
        store.flush("r", 1, {StatsKey("t", "pl", "p64", 0): Counter(drafts=2)})
        assert total(store, "drafts") == 2
    finally:
        proc.kill()
        proc.wait()


def test_two_replicas_collectors_make_one_snapshot(server):
    store = RedisStats(server.url, "app")
    good = collector_with_steps(draft="pl", accepted=4, request="a")    # every token accepted
    poor = collector_with_steps(draft="pl", accepted=0, request="b")    # none
    for i, c in enumerate((good, poor)):
        assert RedisExporter(c, store, flusher=f"replica-{i}").flush_once()
    service = Service(server.url, "app", min_steps=20, half_life_s=1e9)   # no decay: exact sums
    snapshot = service.publish()
    (prior, pooled) = sorted(snapshot["priors"], key=lambda p: p["bucket"] == "all")
    assert prior["bucket"] == "p64" and pooled["bucket"] == "all"
    assert prior["steps"] == pytest.approx(60, rel=1e-3) and prior["requests"] == pytest.approx(2, rel=1e-3)
    # Eq. 2 over both replicas: 120 accepted / (120 accepted + 30 broken chains).
    assert prior["alpha"] == pytest.approx(120 / 150, abs=1e-3)
    assert prior["acceptance_by_position"] == [0.5, 0.5, 0.5, 0.5]
    assert snapshot["version"] == 1 and store.read_snapshot() == snapshot


def test_too_few_steps_publish_no_prior(server):
    store = RedisStats(server.url, "app")
    RedisExporter(collector_with_steps(steps=5), store).flush_once()
    assert Service(server.url, "app", min_steps=20).publish()["priors"] == []


def test_redis_killed_counts_wait_and_arrive_once_after_restart(server, tmp_path):
    store = RedisStats(server.url, "app")
    c = collector_with_steps(steps=10, request="a")
    exporter = RedisExporter(c, store)
    kill(server)
    assert not exporter.flush_once()                       # Redis gone: the batch is kept
    c.observe(record(step("a", "pl", accepted=1)))          # and counting goes on meanwhile
    assert not exporter.flush_once()
    restarted = RedisServer.start(tmp_path, port=int(server.url.rsplit(":", 1)[1].split("/")[0]), password=server.password)
    try:
        assert exporter.flush_once() and exporter.flush_once()   # the kept batch, then what came since
        assert total(store, "drafts") == 11 and total(store, "requests") == 1
        assert not exporter.flush_once() or total(store, "drafts") == 11   # nothing counted twice
    finally:
        restarted.stop()


def test_the_policy_service_restarted_publishes_the_next_version_from_the_same_counts(server, monkeypatch):
    store = RedisStats(server.url, "app")
    RedisExporter(collector_with_steps(), store).flush_once()
    # Counts decay with wall time: both publishes read the same instant, so only a difference in
    # what the service kept could tell them apart.
    now = time.time()
    monkeypatch.setattr(policy_service, "time", SimpleNamespace(time=lambda: now))
    first = Service(server.url, "app").publish()
    second = Service(server.url, "app").publish()     # a new replica of the service: no state of its own
    assert second["version"] == first["version"] + 1
    assert second["priors"] == first["priors"]


def test_the_snapshot_cache_keeps_the_last_snapshot_through_an_outage_until_stale(server):
    store = RedisStats(server.url, "app")
    clock = Clock(time.time())
    cache = SnapshotCache(store, max_age_s=600, clock=clock)
    assert cache.refresh() is None and cache.current() is None      # nothing published yet: defaults
    published = store.publish_snapshot({"priors": []})
    assert cache.refresh()["version"] == published["version"]
    kill(server)
    assert cache.refresh()["version"] == published["version"]       # Redis gone: the last one stays
    assert cache.current()["version"] == published["version"]
    clock.t += 601
    assert cache.current() is None                                   # too old: back to defaults


def test_a_rediss_url_with_a_password_speaks_tls_and_checks_the_servers_certificate(server, tmp_path):
    """``redis_url`` may be ``rediss://:password@host:port/db?ssl_ca_certs=...``: the statistics go
    through TLS, verified against the given CA, with the password; a client that cannot verify the
    server's certificate does not fall back to plain text."""
    from urllib.parse import urlparse

    from specserve.policies.redis_stats import connect
    from tls_relay import TlsRelay, self_signed_cert

    redis.Redis.from_url(server.url).config_set("requirepass", "s3cret")
    cert, key = self_signed_cert(tmp_path)
    relay = TlsRelay(urlparse(server.url).port, cert, key)
    try:
        url = f"rediss://:s3cret@127.0.0.1:{relay.port}/0?ssl_ca_certs={cert}"
        store = RedisStats(url, "tls")
        counts = {StatsKey("t", "pl", "p64", 60): Counter(drafts=2, accepted_tokens=3)}
        assert store.flush("replica-1", 1, counts)
        assert store.read() == counts
        assert relay.handshakes >= 1

        with pytest.raises(redis.ConnectionError, match="(?i)certificate"):   # the CA not given: refused
            connect(f"rediss://:s3cret@127.0.0.1:{relay.port}/0", timeout_s=2).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(f"rediss://:wrong@127.0.0.1:{relay.port}/0?ssl_ca_certs={cert}", timeout_s=2).ping()
    finally:
        relay.close()
