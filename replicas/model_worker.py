"""The one thread a replica runs model work on, and the health check that watches it.

One thread, because forwards of concurrent sessions must queue rather than fight over the cores
(two torch forwards on the same cores oversubscribe OpenMP and slow each other many times over),
and because the event loop must stay free to accept calls and answer health checks. A replica
whose forward has run far longer than any forward should is stuck (a wedged device, a deadlock):
``check`` raises, Ray Serve's health check fails, and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from specserve.replicas.core_share import CoreShare

T = TypeVar("T")


class ModelWorker:
    def __init__(self, name: str, threads: int | None = None, stuck_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, own_stream: bool = False,
                 share: CoreShare | None = None):
        """``threads``: torch's thread count for model work. OpenMP thread counts are per OS
        thread, and Ray sets ``OMP_NUM_THREADS`` to an actor's ``num_cpus``: set in the replica's
        constructor, it would not reach this thread, so it is set here, in the thread that runs
        the model. ``own_stream``: on a GPU, this
        thread's kernels go to a CUDA stream of their own (a draft beside the target's forward,
        not queued behind it); each call's kernels wait for the work its caller had queued when it
        called (what it hands over, e.g. the target's states cloned for a head), and the call
        waits for its own before it returns, so what it hands to another thread is complete. ``share``: the node's idle cores this thread may borrow
        for a call (``core_share``): its thread count is set before each call."""
        self.name = name
        self.threads = threads
        self.share = share
        self._running_threads = threads
        self._stream = own_stream and torch.cuda.is_available()
        self.stuck_after_s = stuck_after_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._init_thread)
        self._busy_since: float | None = None

    def _init_thread(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        if self._stream:
            torch.cuda.set_stream(torch.cuda.Stream())

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the model thread, waiting for it here: start-up work outside an event
        loop (the replica's constructor), timed with the thread count that serves."""
        return self._pool.submit(self._timed, fn, args, self._handed_over()).result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await self.submit(fn, *args)

    def close(self) -> None:
        """End the model thread once its work is done (a worker made for one job)."""
        self._pool.shutdown(wait=True)

    def submit(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        """Start ``fn(*args)`` on the model thread now; the caller awaits the future when it
        needs the result (the step loop streams the previous step's tokens meanwhile)."""
        return asyncio.get_running_loop().run_in_executor(self._pool, self._timed, fn, args, self._handed_over())

    def _handed_over(self) -> torch.cuda.Event | None:
        """On a stream of its own: a mark after the work the caller's stream holds now."""
        if not self._stream:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _timed(self, fn: Callable[..., T], args: tuple, handed_over: torch.cuda.Event | None = None) -> T:
        self._busy_since = self._clock()
        if handed_over is not None:
            torch.cuda.current_stream().wait_event(handed_over)
        if self.share is not None and (threads := self.share.threads()) != self._running_threads:
            torch.set_num_threads(threads)
            self._running_threads = threads
        try:
            out = fn(*args)
            if self._stream:
                torch.cuda.current_stream().synchronize()
            return out
        finally:
            self._busy_since = None

    def check(self) -> None:
        """Raise if one piece of model work has run for more than ``stuck_after_s``."""
        since = self._busy_since
        if since is not None and self._clock() - since > self.stuck_after_s:
            raise RuntimeError(f"{self.name}: one model call has run for {self._clock() - since:.0f} s "
                               f"(limit {self.stuck_after_s:.0f} s); the replica is stuck")


class InlineWorker:
    """Model work in the caller's thread: the in-process engine, where nothing else needs the
    event loop while a forward runs."""

    name = "inline"

    def call(self, fn: Callable[..., T], *args) -> T:
        return fn(*args)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return fn(*args)

    def submit(self, fn: Callable[..., T], *args) -> asyncio.Future[T]:
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # noqa: BLE001 - raised where the caller awaits, as with a thread
            future.set_exception(err)
        return future

    def check(self) -> None:
        pass
