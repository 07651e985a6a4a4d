"""A target replica's learning: warm starts from a real Redis snapshot, counts of its requests."""

from collections import Counter

import pytest

from specserve.cluster.redis_server import RedisServer
from specserve.policies.priors import compute_snapshot
from specserve.policies.redis_stats import RedisStats
from specserve.policies.replica_learning import ReplicaLearning, ReplicaLearningFactory
from specserve.policies.stats import StatsKey
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import SpecRequest
from specserve.replicas.step import TreeShape
from counters import counts
from test_stats import record, step


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


def request(window=4, pinned=False, tree=None, draft="pl"):
    return SpecRequest([1, 2, 3], 16, SamplingParams(), draft, window, tree, "r", pinned)


def test_a_new_request_starts_from_the_snapshot_unless_pinned(server):
    store = RedisStats(server.url, "app")
    # α = 0.9 over γ = 2 and 6 at flat verify cost: the best measured window is 6.
    c = counts(900, 100, window=2) + counts(900, 100, window=6)
    store.publish_snapshot(compute_snapshot({StatsKey("t", "pl", "p64", 0): c}, now=0.0))
    learning = ReplicaLearningFactory(server.url, "app")("t")
    assert learning.start(request())[1] is None           # the snapshot is not read yet: cold
    learning.snapshots.refresh()
    warm, prior = learning.start(request())
    assert (warm.window, warm.prior_alpha) == (6, prior["alpha"]) and prior["version"] == 1
    for cold in (request(pinned=True), request(window=0, draft="none")):
        assert learning.start(cold) == (cold, None)
    # An unpinned tree request takes the draft's α and carried sums; its shape too once a tree
    # was measured (none here), its window never.
    tree, prior = learning.start(request(tree=TreeShape(3, 2, 6)))
    assert (tree.tree, tree.window, tree.prior_alpha) == (TreeShape(3, 2, 6), 4, prior["alpha"])
    assert tree.prior_learned == {"version": 1, "sums": {}} and prior["tree"] is None


def test_the_observers_count_the_replicas_requests():
    learning = ReplicaLearning("t")           # no Redis: it learns alone, metrics and counts only
    assert learning.background() == []
    learning.start(request())
    for observe in learning.observers:
        observe(record(step("r", "pl", accepted=2)))
    learning.finish("r")
    (counted,) = learning.collector.drain().values()
    assert counted["requests"] == 1 and counted["accepted_tokens"] == 2 and isinstance(counted, Counter)


def test_what_a_drafts_session_left_is_counted_under_that_draft_and_the_requests_bucket():
    learning = ReplicaLearning("t")
    left = {"tabed_01_g10_positions": 6, "tabed_01_g10_hits_3": 5}
    # A request that switched away from the ensemble leaves its counts under the draft it left.
    learning.carry_draft("tabed", request(draft="pl"), {**left, "q_n_99_0": 1, "tabed_01_g10_hits_4": -2,
                                                         "tabed_01_g10_hits_5": 1.5, 7: 1})
    (key, counted), = learning.collector.drain().items()
    assert (key.draft, key.bucket) == ("tabed", "p64") and counted == Counter(left)
    learning.carry_draft("tabed", request(), {"q_n_99_0": 1})   # nothing carried: nothing counted
    assert learning.collector.drain() == {}
