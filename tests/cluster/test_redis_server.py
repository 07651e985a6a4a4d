"""A real redis-server process: started on a free port, answering, stopped for good."""

import os

import redis

from specserve.cluster.redis_server import RedisServer, ping


def test_start_use_and_stop(tmp_path):
    server = RedisServer.start(tmp_path)
    try:
        client = redis.Redis.from_url(server.url)
        client.set("specserve:test", "1")
        assert client.get("specserve:test") == b"1"
    finally:
        server.stop()
    assert not ping(server.url)
    try:
        os.kill(server.pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, f"redis-server pid {server.pid} still runs after stop()"
