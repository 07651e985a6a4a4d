"""Stopping a server process that ``specserve up`` started (Redis, Prometheus)."""

from __future__ import annotations

import os
import signal
import time


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not gone after ``timeout_s``; reaped if it is our child."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # Reap it if it is our child; otherwise just watch for it to go.
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
