"""The router learning with the cluster through a real redis-server: outcomes into the capped
stream exactly once, the policy service's retrained weights picked up by another replica's
router, a Redis outage that loses nothing, and weights of another topic basis left alone."""

import os
import signal

import pytest
import torch

from specserve.cluster.redis_server import RedisServer, ping
from specserve.policies.policy_service import PolicyService
from specserve.policies.redis_stats import RedisStats
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import RequestState, SpecRequest
from specserve.replicas.step import RequestStep, Speculation, StepRecord
from specserve.router.draft_router import LearnedDraftRouter
from specserve.router.retrain import retrain, weights_for
from specserve.router.route_learning import RouteLearning
from specserve.router.router_factory import RouterFactory

from conftest import wait_until

Service = PolicyService.func_or_class
REPETITIVE = [5, 6, 7, 8] * 10
VARIED = list(range(100, 140))


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


def serve_one(router, prompt, draft, accepted, request_id, steps=16, window=4):
    """One pinned request through the router: ``steps`` drafting steps accepting ``accepted`` of ``window``."""
    state = RequestState(SpecRequest(list(prompt), 64, SamplingParams(), draft, window, request_id=request_id),
                         frozenset(), torch.device("cpu"))
    router.route(state, 1)
    for _ in range(steps):
        router.observe(StepRecord(1, window + 1, 0, 0.5, 20.0, 0.0,
                                  (RequestStep(request_id, draft, Speculation(window), window, accepted, window, None),)))
    state.finish_reason = "length"
    router.finish(state)


def replica(server, prefix="app"):
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    return router, RouteLearning(router, "t", RedisStats(server.url, prefix))


def test_two_replicas_outcomes_train_the_cluster_weights_a_third_router_loads(server):
    (a, la), (b, lb) = replica(server), replica(server)
    for i in range(6):
        serve_one(a, REPETITIVE, "lookup", 4, f"a{i}")     # lookup: every token accepted on repetitive prompts
        serve_one(b, VARIED, "lookup", 0, f"b{i}")         # ... none on varied ones
    assert la.flush_once() and lb.flush_once()
    assert not la.outcomes.pending and not lb.outcomes.pending
    store = RedisStats(server.url, "app")
    outcomes = store.read_routes()
    assert len(outcomes) == 12 and {o["target"] for o in outcomes} == {"t"}
    service = Service(server.url, "app", router_retrain=retrain)
    service.publish()
    assert service.router_latest["outcomes"] == 12
    fresh, learning = replica(server)
    assert learning.load_weights()
    x_rep = fresh.features(RequestState(SpecRequest(REPETITIVE, 8), frozenset(), torch.device("cpu"))).vector()
    x_var = fresh.features(RequestState(SpecRequest(VARIED, 8), frozenset(), torch.device("cpu"))).vector()
    assert fresh.models["lookup"].predict(x_rep) > 0.7 > 0.2 > fresh.models["lookup"].predict(x_var)
    assert not learning.load_weights()                     # same version: nothing to do


def test_redis_down_outcomes_wait_and_arrive_once(server, tmp_path):
    router, learning = replica(server)
    os.kill(server.pid, signal.SIGKILL)
    assert not wait_until(lambda: ping(server.url), lambda up: not up, timeout=10)
    for i in range(5):
        serve_one(router, REPETITIVE, "lookup", 3, f"r{i}")
    assert not learning.flush_once() and not learning.flush_once()   # kept, retried as the same batch
    assert not learning.load_weights()                               # keeps what it has
    restarted = RedisServer.start(tmp_path / "again", port=int(server.url.rsplit(":", 1)[1].split("/")[0]),
                               password=server.password)
    try:
        serve_one(router, VARIED, "lm", 1, "late")                   # waits behind the pending batch
        assert learning.flush_once() and learning.flush_once()
        ids = [o["request_id"] for o in RedisStats(restarted.url, "app").read_routes()]
        assert sorted(ids) == sorted([f"r{i}" for i in range(5)] + ["late"])
    finally:
        restarted.stop()


def test_weights_of_another_target_or_basis_are_not_loaded(server):
    document = retrain([{"target": "t", "basis": "other-basis", "features": [1.0] * 13,
                         "observations": [{"draft": "lookup", "alpha": 0.9, "weight": 1.0}]}])
    assert weights_for(document, "t", "other-basis") and not weights_for(document, "t", "none-d8")
    assert not weights_for(document, "u", "other-basis")
    assert weights_for({"format": 99, "models": []}, "t", "x") == {}


def test_recent_routes_read_newest_last_and_skip_foreign_entries(server):
    store = RedisStats(server.url, "app")
    store.client.xadd(store.routes_key, {"o": "not json"})
    assert store.add_routes("f", 1, [{"request_id": str(i)} for i in range(5)])
    assert not store.add_routes("f", 1, [{"request_id": "dup"}])    # the same batch again: once
    assert [o["request_id"] for o in store.read_routes(3)] == ["2", "3", "4"]
    assert len(store.read_routes()) == 5


def test_the_factory_hands_the_replica_its_router_with_the_learning_to_run_beside_it(server):
    alone = RouterFactory(metrics=False)("t", ["lookup", "lm"], tokenizer=None)   # no corpus: no tokenizer needed
    assert alone.learning is None and alone.background() == []
    built = RouterFactory(redis_url=server.url, redis_prefix="app", metrics=False)("t", ["lookup", "lm"], tokenizer=None)
    assert built.learning.router is built.router and built.router.on_outcome == [built.learning.add]
    tasks = built.background()   # sending outcomes, loading weights: coroutines the replica starts
    assert len(tasks) == 2
    for task in tasks:
        task.close()
