"""Redis is input too, for the router: routing outcomes and published weights overwritten with
garbage, oversized and wrongly shaped values on a real redis-server. Retraining skips bad outcomes,
a replica keeps its weights when the document or a model is bad, nothing is sized from an
untrusted number, and every value skipped is counted."""

import json
import math
import time
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from specserve.cluster.redis_server import RedisServer
from specserve.policies.policy_service import PolicyService
from specserve.policies.redis_schema import REJECTED
from specserve.policies.redis_stats import RedisStats
from specserve.router.acceptance import LinearAcceptance
from specserve.router.draft_router import LearnedDraftRouter
from specserve.router.retrain import retrain, weights_for
from specserve.router.route_learning import RouteLearning

Service = PolicyService.func_or_class
DIMS = 14   # the router's features without a topic basis: 6 + 8 topic dimensions


@pytest.fixture
def server(tmp_path):
    s = RedisServer.start(tmp_path)
    yield s
    s.stop()


def rejected_since(before):
    return REJECTED - before


def outcome(features=None, alpha=0.9, **fields):
    return {"target": "t", "basis": "none-d8", "features": [0.5] * DIMS if features is None else features,
            "observations": [{"draft": "lookup", "alpha": alpha, "weight": 1.0}], **fields}


# ---- outcomes --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    outcome(features=[0.5] * 40000),                    # longer than any router's features
    outcome(features=[0.5] * (DIMS - 1) + [math.nan]),
    outcome(features=[0.5] * (DIMS - 1) + [1e300]),
    outcome(features="garbage"),
    outcome(alpha=5.0),
    outcome(alpha="x"),
    {**outcome(), "observations": [{"draft": "lookup", "alpha": 0.5}] * 10 ** 6},
    {**outcome(), "target": 7},
])
def test_a_bad_outcome_is_skipped_and_counted_and_the_good_ones_still_train(bad):
    before = REJECTED.copy()
    document = retrain([outcome(), bad, outcome()])
    assert rejected_since(before)[("router_outcome", "schema")] == 1
    assert document["outcomes"] == 2
    (model,) = document["models"]
    assert model["model"]["dims"] == DIMS and model["model"]["observations"] == 2.0


def test_outcomes_of_another_feature_count_make_their_own_model_which_no_replica_takes():
    """A group's feature count is part of its name: one outcome of another length cannot keep the
    genuine outcomes of that (target, basis, draft) out of their model."""
    document = retrain([outcome(features=[0.5] * 7), outcome(), outcome()])
    models = weights_for(document, "t", "none-d8", DIMS)
    assert models["lookup"]["dims"] == DIMS and models["lookup"]["observations"] == 2.0


def test_the_policy_service_retrains_from_the_good_outcomes_of_a_poisoned_stream(server):
    store = RedisStats(server.url, "app")
    store.add_routes("r", 1, [outcome(), outcome(features=[1.0] * 40000), outcome(alpha=-1.0), outcome()])
    store.client.xadd(store.routes_key, {"o": json.dumps(outcome())[:-5]})   # cut short
    before = REJECTED.copy()
    service = Service(store.url, "app", router_retrain=retrain)
    service.publish()
    counted = rejected_since(before)
    assert counted[("router_outcome", "size")] == 1                  # 40000 features: over an entry's bound
    assert counted[("router_outcome", "schema")] == 1 and counted[("router_outcome", "json")] == 1
    assert service.router_latest["outcomes"] == 2


# ---- published weights -----------------------------------------------------------------------

def replica(server):
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    return router, RouteLearning(router, "t", RedisStats(server.url, "app"))


def publish_good(store: RedisStats) -> dict:
    return store.publish_snapshot(retrain([outcome(), outcome(alpha=0.8)]), "router")


def document_with(store: RedisStats, version: int, model: dict) -> str:
    return json.dumps({"format": 1, "version": version, "published_at": time.time(), "outcomes": 1,
                       "models": [{"target": "t", "basis": "none-d8", "draft": "lookup", "model": model}]})


def identity(dims: int) -> dict:
    return {"dims": dims, "ridge": 1.0, "alpha_max": 0.95, "prior_alpha": 0.5, "observations": 0.0,
            "A": np.eye(dims).tolist(), "b": [0.0] * dims}


BAD_MODELS = {
    "dims 40000": ("router_weights", "schema", {**identity(DIMS), "dims": 40000}),
    "dims 40000 and a matching b": ("router_weights", "schema", {**identity(2), "dims": 40000, "b": [0.0] * 40000}),
    "A of the wrong shape": ("router_weights", "schema", {**identity(DIMS), "A": [[1.0] * DIMS] * 3}),
    # Another feature count is another router's model (weights_for passes it over): not counted.
    "dims of another router": ("router_weights", None, identity(DIMS + 1)),
    "A singular": ("router_weights", "schema", {**identity(DIMS), "A": np.zeros((DIMS, DIMS)).tolist()}),
    "A not symmetric": ("router_weights", "schema", {**identity(DIMS), "A": (np.eye(DIMS) + np.triu(np.ones((DIMS, DIMS)), 1)).tolist()}),
    "a negative ridge": ("router_weights", "schema", {**identity(DIMS), "ridge": -1.0}),
}


@pytest.mark.parametrize("case", BAD_MODELS)
def test_a_bad_model_is_skipped_and_counted_and_the_router_keeps_its_own(server, case):
    store = RedisStats(server.url, "app")
    good = publish_good(store)
    router, learning = replica(server)
    assert learning.load_weights()
    loaded = router.models["lookup"]
    family, reason, model = BAD_MODELS[case]
    store.client.set("app:router:weights", document_with(store, good["version"] + 1, model))
    before = REJECTED.copy()
    assert not learning.load_weights()
    assert rejected_since(before) == (Counter({(family, reason): 1}) if reason else Counter())
    assert router.models["lookup"] is loaded


@pytest.mark.parametrize("value, reason", [
    ("garbage", "json"),
    (json.dumps({"version": 5, "published_at": "x", "format": 1, "models": "garbage"}), "schema"),
    ('{"version": 5, "published_at": NaN, "format": 1, "models": []}', "schema"),
    (json.dumps({"version": 5, "published_at": 1.0, "format": 1, "models": [{}] * 10 ** 5}), "schema"),
])
def test_a_bad_weights_document_is_skipped_and_counted(server, value, reason):
    store = RedisStats(server.url, "app")
    publish_good(store)
    router, learning = replica(server)
    assert learning.load_weights()
    loaded = dict(router.models)
    store.client.set("app:router:weights", value)
    before = REJECTED.copy()
    assert not learning.load_weights()
    assert rejected_since(before)[("router_weights", reason)] == 1
    assert router.models == loaded


def test_a_weights_key_of_another_type_is_counted_and_the_service_still_publishes(server):
    store = RedisStats(server.url, "app")
    router, learning = replica(server)
    store.client.rpush("app:router:weights", "x")
    store.client.rpush("app:router:version", "x")
    before = REJECTED.copy()
    assert not learning.load_weights()
    counted = rejected_since(before)
    assert counted[("router_weights", "type")] == 1
    store.add_routes("r", 1, [outcome()])
    service = Service(store.url, "app", router_retrain=retrain)
    service.publish()
    assert rejected_since(before)[("version", "type")] == 1
    assert service.router_latest["version"] == 1 and learning.load_weights()


def test_a_model_of_40000_dims_is_refused_before_anything_is_sized_from_it():
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="40000"):
            LinearAcceptance.from_dict({"dims": 40000, "ridge": 1.0, "A": [], "b": []})
        with pytest.raises(ValueError, match="expected 13"):
            LinearAcceptance.from_dict(identity(14), dims=13)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 ** 20, f"{peak} bytes allocated to refuse a model"


def test_a_published_model_round_trips():
    model = LinearAcceptance(3, prior_alpha=0.5)
    model.update([1.0, 0.5, 0.2], 0.8)
    again = LinearAcceptance.from_dict(model.to_dict(), dims=3)
    assert again.predict([1.0, 0.5, 0.2]) == model.predict([1.0, 0.5, 0.2])



def test_outcomes_naming_ever_more_models_are_held_to_the_budget_most_observed_first():
    # Each outcome names its own draft: untrusted names must not say how much is allocated.
    from specserve.router.retrain import MAX_MODEL_FLOATS, MAX_MODELS

    many = [{**outcome(), "observations": [{"draft": f"d{i}", "alpha": 0.5}]} for i in range(MAX_MODELS + 50)]
    popular = [{**outcome(), "observations": [{"draft": "popular", "alpha": 0.8}]}] * 3
    wide = [outcome(features=[0.5] * 256)] * 2     # 65,536 floats each
    before = REJECTED.copy()
    document = retrain([*many, *popular, *wide])
    drafts = [m["draft"] for m in document["models"]]
    assert len(drafts) <= MAX_MODELS and "popular" in drafts
    assert sum(m["model"]["dims"] ** 2 for m in document["models"]) <= MAX_MODEL_FLOATS
    assert rejected_since(before)[("router_outcome", "size")] == 1
