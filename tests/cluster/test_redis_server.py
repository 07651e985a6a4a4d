"""A real redis-server process: started on a free port with a password, answering only with it,
stopped for good."""

import os

import pytest
import redis

from specserve.cluster.redis_server import RedisServer, ping, redact


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


def test_a_connection_without_the_password_is_refused_and_one_with_it_works(tmp_path):
    server = RedisServer.start(tmp_path)
    try:
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").set("specserve:test", "1")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://:wrong@127.0.0.1:{port}/0").ping()
        assert not ping(f"redis://127.0.0.1:{port}/0")
        assert redis.Redis.from_url(server.url).ping()
        assert len(server.password) >= 32 and server.password not in " ".join(_command_line(server.pid))
        assert not list(tmp_path.glob("*.conf")), "the file the password was read from stays behind"
    finally:
        server.stop()


def test_a_server_restarted_with_its_password_answers_the_old_url(tmp_path):
    server = RedisServer.start(tmp_path)
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    server.stop()
    again = RedisServer.start(tmp_path, port=port, password=server.password)
    try:
        assert again.url == server.url and ping(server.url)
    finally:
        again.stop()


def test_redact_hides_the_password_and_nothing_else():
    assert redact("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact("rediss://user:s3cret@host:6380/1?ssl_ca_certs=/ca.pem") == "rediss://user:***@host:6380/1?ssl_ca_certs=/ca.pem"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def _command_line(pid: int) -> list[str]:
    return open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
