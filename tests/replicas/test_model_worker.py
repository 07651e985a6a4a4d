"""ModelWorker runs model work on one thread, and its health check fails only for stuck work."""

import asyncio
import os
import subprocess
import sys
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


def test_the_model_thread_runs_with_the_replicas_thread_count():
    # Ray sets OMP_NUM_THREADS to an actor's num_cpus; OpenMP teams are per OS thread, so the
    # worker sets torch's count in its own thread. In a fresh process (2 threads by default), a
    # worker told 1 runs its work with 1, and one told nothing keeps the default.
    script = (
        "import asyncio, torch\n"
        "from specserve.replicas.model_worker import ModelWorker\n"
        "print(asyncio.run(ModelWorker('w').run(torch.get_num_threads)),"
        " asyncio.run(ModelWorker('w', threads=1).run(torch.get_num_threads)))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "1"]
