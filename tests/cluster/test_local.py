"""``specserve up`` / ``down``: the Redis ``up`` starts requires its password (kept in a state file
only the owner reads, never shown). That ``down`` leaves nothing behind in a process that keeps
running is tested end to end (``tests/e2e/test_serve_imagegen.py``)."""

from __future__ import annotations

import socket
import stat

import pytest
import redis

from specserve.cluster import local
from specserve.cluster.redis_server import free_port, ping
from specserve.cluster.serve_config import app_serve_config, local_serve_config


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(local, "_ray_running", lambda: False)   # these tests start no Ray
    yield tmp_path / "home"
    local.down()


def test_up_starts_a_redis_that_refuses_connections_without_its_password(home):
    state = local.LocalState()
    local.ensure_redis(state)
    assert state.redis_pid and ping(state.redis_url)
    port = state.redis_url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").keys()
    saved = local.LocalState.load()
    assert saved.redis_url == state.redis_url                          # the app and the CLI reach it through it
    assert stat.S_IMODE(local.LocalState.path().stat().st_mode) == 0o600
    password = state.redis_url.split("@")[0].rsplit(":", 1)[1]
    assert password not in str(local.redact(state.redis_url))
    again = local.LocalState.load()
    local.ensure_redis(again)                                          # still answers: the same server
    assert again.redis_pid == state.redis_pid
    assert local.down() == [f"redis-server pid {state.redis_pid}"] and not ping(state.redis_url)


def test_the_state_file_is_owner_only_even_when_an_older_one_was_not(home):
    path = local.LocalState.path()
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    path.chmod(0o644)
    local.LocalState(redis_url="redis://:s3cret@127.0.0.1:1/0").save()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_given_redis_that_does_not_answer_is_named_without_its_password(home):
    with pytest.raises(ConnectionError) as err:
        local.ensure_redis(local.LocalState(), "redis://:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in str(err.value) and "127.0.0.1:1" in str(err.value)


def test_the_head_starts_with_the_grpc_proxys_message_cap(monkeypatch):
    # Serve's gRPC proxy reads its largest message from the head's environment only.
    seen: dict = {}

    def ray(*args, env=None, **_):
        seen.update(env or {})
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(local, "_ray", ray)
    monkeypatch.setattr(local, "auth_token", lambda: "token")
    monkeypatch.setattr(local, "DASHBOARD_PORT", free_port())   # whatever this host runs
    config = app_serve_config({**local_serve_config()["applications"][0]["args"], "max_body_bytes": 1 << 20})
    local._start_ray(metrics_port=1, num_cpus=2, prometheus_url="http://127.0.0.1:9", env=local.proxy_env(config))
    assert seen == {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(1 << 20), "RAY_PROMETHEUS_HOST": "http://127.0.0.1:9"}


def test_the_targets_kv_capacity_comes_from_one_replicas_load_or_is_none(monkeypatch):
    from ray import serve

    load = {"running": 0, "kv_slots": 12, "kv_max_len": 2048, "kv_capacity_tokens": 24576,
            "kv_sized_by": "device memory", "kv_bytes_allocated": 1}

    class Handle:   # handle.load.remote().result(timeout_s=...), answered by ``answer``
        def __init__(self, answer):
            self.load, self.answer = self, answer

        def remote(self):
            return self

        def result(self, timeout_s):
            return self.answer(timeout_s)

    def gone(timeout_s):
        raise TimeoutError(f"no replica answered in {timeout_s} s")

    asked = []
    monkeypatch.setattr(serve, "get_deployment_handle",
                        lambda name, app: asked.append((name, app)) or Handle(lambda _: load))
    assert local.target_kv("app") == {"kv_slots": 12, "kv_max_len": 2048, "kv_capacity_tokens": 24576,
                                      "kv_sized_by": "device memory"}
    assert asked == [("target", "app")]
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: Handle(gone))
    assert local.target_kv("app") is None


class RayCli:
    """Stands in for the ``ray`` command: answers each ``start`` and ``status`` with the next of
    ``answers`` (returncode, what it printed) and keeps each call's subcommand."""

    def __init__(self, *answers: tuple[int, str]):
        self.answers, self.calls = list(answers), []

    def __call__(self, *args, **_):
        self.calls.append(args[0])
        code, said = self.answers.pop(0) if args[0] in ("start", "status") else (0, "")
        return type("Done", (), {"returncode": code, "stdout": said, "stderr": ""})()


@pytest.mark.parametrize(("code", "said", "running"), [
    (0, "Node status ...", True),
    (1, "ConnectionError: Could not find any running Ray instance. Please specify ...", False),
    (1, "Failed to get node info b'RPC error: Deadline Exceeded'", True),   # there, but not answering
])
def test_only_rays_own_no_instance_answer_means_no_cluster(monkeypatch, code, said, running):
    monkeypatch.setattr(local, "_ray", RayCli((code, said)))
    assert local._ray_running() is running


def test_a_held_dashboard_port_is_refused_before_ray_starts(monkeypatch):
    ray = RayCli()
    monkeypatch.setattr(local, "_ray", ray)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(RuntimeError, match=f"port {holder.getsockname()[1]}"):
            local.start_head(dashboard_port=holder.getsockname()[1])
    assert ray.calls == []


def test_a_failed_head_start_leaves_nothing_and_only_rays_own_timeout_is_tried_again(monkeypatch):
    port = free_port()
    timed_out = (1, "Exception: The current node timed out during startup. This could happen because ...")
    ray = RayCli(timed_out, (0, "Ray runtime started."))
    monkeypatch.setattr(local, "_ray", ray)
    local.start_head(dashboard_port=port)
    assert ray.calls == ["start", "stop", "start"]

    ray = RayCli((1, "ValueError: bad --resources"))
    monkeypatch.setattr(local, "_ray", ray)
    with pytest.raises(RuntimeError, match="bad --resources"):
        local.start_head(dashboard_port=port)
    assert ray.calls == ["start", "stop"]

    ray = RayCli(timed_out, timed_out)
    monkeypatch.setattr(local, "_ray", ray)
    with pytest.raises(RuntimeError, match="timed out during startup"):
        local.start_head(dashboard_port=port)
    assert ray.calls == ["start", "stop", "start", "stop"]
