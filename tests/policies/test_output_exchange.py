"""Finished outputs between replicas through a real Redis: each replica gets the others' (never
its own back), a new replica reads the whole capped stream, and an outage loses no queued output."""

import numpy as np
import pytest

from specserve.cluster.redis_server import RedisServer
from specserve.policies.output_exchange import OutputExchange
from specserve.policies.replica_learning import ReplicaLearning


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


def collect():
    got = []
    return got, lambda salt, tokens: got.append((salt, tokens.tolist()))


def test_replicas_receive_each_others_outputs_with_their_salt_and_a_new_one_reads_them_all(server):
    a, b = OutputExchange(server.url, "app", "t"), OutputExchange(server.url, "app", "t")
    got_a, receive_a = collect()
    got_b, receive_b = collect()
    a.share(None, [1, 2, 3])
    a.share("tenant", np.array([40000, 5], dtype=np.int64))
    assert a.exchange_once(receive_a) == 0 and got_a == []          # its own are skipped
    assert b.exchange_once(receive_b) == 2
    assert got_b == [(None, [1, 2, 3]), ("tenant", [40000, 5])]
    b.share(None, [7, 8])
    b.exchange_once(receive_b)
    a.exchange_once(receive_a)
    assert got_a == [(None, [7, 8])] and len(got_b) == 2              # only what is new
    late, (got_late, receive_late) = OutputExchange(server.url, "app", "t"), collect()
    assert late.exchange_once(receive_late) == 3                        # the snapshot: the whole stream
    other, (got_other, receive_other) = OutputExchange(server.url, "app", "other-target"), collect()
    assert other.exchange_once(receive_other) == 0                      # one stream per target


def test_the_stream_is_capped(server):
    a, b = OutputExchange(server.url, "app", "t", max_outputs=10), OutputExchange(server.url, "app", "t")
    for i in range(500):
        a.share(None, [i, i + 1])
    a.exchange_once(lambda *_: None)
    assert b.exchange_once(lambda *_: None) < 200                       # MAXLEN ~ 10: whole nodes of ~100


def test_outputs_queued_while_redis_is_away_arrive_after(tmp_path):
    server = RedisServer.start(tmp_path)
    port, password = server.url.rsplit(":", 1)[1].split("/")[0], server.password
    a = OutputExchange(server.url, "app", "t", timeout_s=0.3)
    server.stop()
    a.share(None, [1, 2])
    assert a.exchange_once(lambda *_: None) == 0 and a.sent == 0
    server = RedisServer.start(tmp_path, port=int(port), password=password)
    try:
        a.exchange_once(lambda *_: None)
        got, receive = collect()
        OutputExchange(server.url, "app", "t").exchange_once(receive)
        assert a.sent == 1 and got == [(None, [1, 2])]
    finally:
        server.stop()


def test_a_replica_shares_outputs_only_when_it_receives_them(server):
    learning = ReplicaLearning("t", server.url, "app")
    learning.share_output(None, [1, 2, 3])                              # no suffix draft: nothing queued
    tasks = learning.background()
    assert len(tasks) == 2 and not learning.outputs._unsent
    for task in tasks:
        task.close()
    got, receive = collect()
    learning.receive_outputs(receive)
    learning.share_output(None, [1, 2, 3])
    tasks = learning.background()
    assert len(tasks) == 3 and len(learning.outputs._unsent) == 1
    for task in tasks:
        task.close()
