"""The cores a node's target replicas lend each other: a replica that runs alone on its node runs
its forward on the idle replicas' cores too; under load each runs on its own.

Why: a decode step of a small model is bound by memory bandwidth, which one core alone does not
saturate on every CPU, so one stream decodes faster on two threads than on one
(docs/benchmarks.md §2.0c). But the layout that serves load best is one one-thread replica per
core: an OpenMP team spanning every core stalls at each barrier whenever another process needs a
core (docs/design.md §6). So the thread count follows the load, step by step: a replica's model
thread runs ``own`` threads plus those of every target replica on the node that is idle, up to the
node's cores.

How the replicas of a node know of each other: each keeps a small file in a directory on the
node's shared memory (``/dev/shm``), rewritten when it turns busy or idle, every ``beat_s`` while
busy and at each health check while idle. A mark older than ``stale_s`` lends nothing (a replica
that died, busy or idle, must not make the others run more threads than there are cores). Ray
places replicas on nodes; this only lends what Ray gave to a replica that is not using it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# Where the replicas of a node publish whether they are busy.
SHARE_DIR = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / "specserve-cores"
# A file that has not been touched for this long belongs to a replica that is gone.
FORGOTTEN_S = 3600.0


def node_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


class CoreShare:
    def __init__(self, own: int, replica: str, busy: Callable[[], bool], directory: Path = SHARE_DIR,
                 most: int | None = None, beat_s: float = 0.5, stale_s: float = 30.0, read_every_s: float = 0.05,
                 clock: Callable[[], float] = time.time):
        """``own``: the threads Ray gave this replica (its num_cpus); ``busy``: whether it has
        requests to serve (its model thread also runs housekeeping while idle); ``most``: the
        node's cores. ``clock``: wall time, shared by the node's processes."""
        self.own = own
        self.busy = busy
        self.most = max(own, most if most is not None else node_cores())
        self.path = directory / replica
        self.directory = directory
        self.beat_s, self.stale_s, self.read_every_s = beat_s, stale_s, read_every_s
        self._clock = clock
        self._busy = False
        self._written_at = -float("inf")
        self._read_at = -float("inf")
        self._lent = 0
        self._lock = threading.Lock()   # the model thread and the event loop (health checks) both write
        directory.mkdir(parents=True, exist_ok=True)
        self._write(False, clock())     # idle until its first step: a replica not yet asked lends its cores

    def threads(self) -> int:
        """Publish whether this replica is busy; the threads its next model call may run."""
        busy = bool(self.busy())
        now = self._clock()
        if busy != self._busy or (busy and now - self._written_at >= self.beat_s):
            self._write(busy, now)
        if now - self._read_at >= self.read_every_s:
            self._lent = self._idle_cores(now)
            self._read_at = now
        return min(self.most, self.own + self._lent) if busy else self.own

    def beat(self) -> None:
        """Keep this replica's mark fresh (an idle replica's, from its health check)."""
        self._write(bool(self._busy), self._clock())

    def close(self) -> None:
        """Leave the node's books (the replica is shutting down)."""
        self.path.unlink(missing_ok=True)

    def _write(self, busy: bool, now: float) -> None:
        with self._lock:
            partial = self.path.with_name(f".{self.path.name}.partial")
            partial.write_text(f"{int(busy)} {self.own} {now:.3f}")
            os.replace(partial, self.path)   # readers never see half a file
            self._busy, self._written_at = busy, now

    def _idle_cores(self, now: float) -> int:
        """The threads of the node's other target replicas that are idle now."""
        idle = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0
        for entry in entries:
            if entry.name == self.path.name or entry.name.startswith("."):
                continue
            try:
                busy, own, at = Path(entry.path).read_text().split()
                busy, own, at = int(busy), int(own), float(at)
            except (OSError, ValueError):
                continue   # being replaced, or not ours: lend nothing on its account
            if now - at > FORGOTTEN_S:
                Path(entry.path).unlink(missing_ok=True)   # a replica long gone
            elif not busy and now - at <= self.stale_s:
                idle += max(0, own)
        return idle
