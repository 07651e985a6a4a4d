"""ModelWorker runs model work on one thread, and its health check fails only for stuck work."""

import asyncio
import threading

import pytest
from manual_clock import ManualClock

from specserve.replicas.model_worker import ModelWorker


def test_work_runs_on_one_thread_off_the_event_loop():
    worker = ModelWorker("w")

    async def main():
        return await asyncio.gather(*(worker.run(threading.get_ident) for _ in range(4)))

    idents = asyncio.run(main())
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()


def test_health_fails_only_while_one_call_runs_too_long():
    clock = ManualClock()
    worker = ModelWorker("w", stuck_after_s=10, clock=clock)
    started, release = threading.Event(), threading.Event()

    def long_call():
        started.set()
        release.wait(5)

    async def main():
        task = asyncio.ensure_future(worker.run(long_call))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        clock.now = 5
        worker.check()                      # busy, but not for long: healthy
        clock.now = 11
        with pytest.raises(RuntimeError, match="has run for 11 s"):
            worker.check()
        release.set()
        await task
        worker.check()                      # idle again: healthy

    asyncio.run(main())
