"""Target replicas of a node lend each other their cores: one busy alone runs on the idle ones'
threads, under load each on its own, and a replica gone quiet lends nothing."""

import torch

from specserve.replicas.core_share import CoreShare
from specserve.replicas.model_worker import ModelWorker


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replica:
    """A replica's share and whether it has requests."""

    def __init__(self, tmp_path, i, clock, most):
        self.busy = False
        self.share = CoreShare(1, f"replica-{i}", lambda: self.busy, tmp_path, most=most, read_every_s=0.0, clock=clock)

    def threads(self, busy: bool = True) -> int:
        self.busy = busy
        return self.share.threads()

    def beat(self):
        self.share.beat()

    def close(self):
        self.share.close()


def shares(tmp_path, clock, n=3, most=4):
    return [Replica(tmp_path, i, clock, most) for i in range(n)]


def test_a_replica_alone_runs_on_the_idle_replicas_cores_and_under_load_on_its_own(tmp_path):
    clock = Clock()
    a, b, c = shares(tmp_path, clock)
    assert a.threads() == 3                      # the others have not been asked for anything: idle
    assert b.threads() == 2                      # b turns busy: c's core, not busy a's...
    assert a.threads() == 2                      # ...and a borrows only c's core now
    c.threads()
    assert a.threads() == 1 and b.threads() == 1 and c.threads() == 1
    assert a.threads(busy=False) == 1            # idle: its own count, its cores lent
    assert b.threads() == 2


def test_never_more_threads_than_the_node_has_cores(tmp_path):
    clock = Clock()
    a, *_ = shares(tmp_path, clock, n=5, most=2)
    assert a.threads() == 2


def test_a_replica_that_went_quiet_lends_nothing_and_a_closed_one_leaves_the_books(tmp_path):
    clock = Clock()
    a, b, c = shares(tmp_path, clock)
    clock.now += 20.0
    b.beat()                                      # b's health check keeps its idle mark fresh
    clock.now += 15.0                             # c has not been heard from for 35 s (died idle)
    assert a.threads() == 2
    b.close()
    assert a.threads() == 1
    (tmp_path / "not-a-replica").write_text("garbage")
    assert a.threads() == 1                       # a file it cannot read lends nothing


def test_the_model_thread_runs_as_many_threads_as_the_share_allows(tmp_path):
    clock = Clock()
    mine, other = shares(tmp_path, clock, n=2, most=2)
    mine.busy = True
    worker = ModelWorker("target", threads=1, share=mine.share)
    try:
        assert worker.call(torch.get_num_threads) == 2
        other.threads()
        assert worker.call(torch.get_num_threads) == 1
        other.threads(busy=False)
        assert worker.call(torch.get_num_threads) == 2
        mine.busy = False          # housekeeping while idle: its own threads, and its cores lent
        assert worker.call(torch.get_num_threads) == 1
        assert other.threads() == 2
    finally:
        worker.close()
