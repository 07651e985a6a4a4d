"""Learned rule state carried across requests: a finished request's counts, a new request's start
from them, on one replica and through the cluster's snapshot (``policies/carry.py``)."""

import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from specserve.policies.adt_tree import ADTTree
from specserve.policies.carry import CarriedSums
from specserve.policies.eagle2_depth_tree import Eagle2DepthTree
from specserve.policies.per_request import PolicyByRequest
from specserve.policies.priors import compute_snapshot, warm_start
from specserve.policies.q_learning_window import QLearningWindow
from specserve.policies.redis_schema import PolicySnapshot
from specserve.policies.replica_learning import ReplicaLearning
from specserve.policies.sage_tree import SageTree
from specserve.policies.stats import StatsCollector, StatsKey
from specserve.policies.tree import TreePolicy
from specserve.policies.window import WindowPolicy
from specserve.replicas.request import RequestState, SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import RequestStep, Speculation, StepRecord, StepResult, TreeShape
from counters import counts

TREE = TreeShape(3, 4, 16)


def request(request_id="r", window=2, tree=None, prior_learned=None, draft="d", prompt=(1, 2, 3), max_tokens=4):
    return SpecRequest(list(prompt), max_tokens, SamplingParams(), draft, window, tree, request_id,
                       prior_learned=prior_learned)


def state_of(req):
    return RequestState(req, frozenset(), torch.device("cpu"))


def chain_record(request_id, window, accepted, verify_ms=20.0):
    step = RequestStep(request_id, "d", Speculation(window), window, accepted, window, None)
    return StepRecord(1, 1 + window, 0, 0.0, verify_ms, 0.0, (step,))


def finish(policy, rs, window, accepted):
    """One step of ``rs`` that ends it (its max_tokens reached), observed by ``policy``."""
    rs.advance(StepResult(window, accepted, list(range(accepted)), [5] * rs.request.max_tokens, window))
    assert rs.done
    policy.observe(chain_record(rs.id, window, accepted))
    policy.observe(StepRecord(0, 0, 0, 0.0, 0.0, 0.0, ()))   # the next step drops the finished request


def test_q_learning_counts_the_entries_a_request_backed_up_and_a_new_one_starts_from_their_means():
    rule = QLearningWindow(window_max=2, lr=0.5, discount=0.0, epsilon=0.0)
    state = rule.start(request(window=1))
    out = chain_record("r", 2, 2, verify_ms=30.0)             # 3 tokens in 30 ms: reward 100 tok/s
    state = rule.update(rule.decide(state, 1, random.Random(0))[1], outcomes_of(out))
    # s = 1 (the start window), a = the asked 2: one backup of q[1][2] to 0.5 · 100.
    assert state.q[1][2] == pytest.approx(50.0) and state.visits[1][2] == 1
    assert rule.counts(state) == {"q_n_1_2": 1, "q_mq_1_2": 50000}
    # Two requests' counts: q[1][2] visited once at 50 and three times at 70 -> (50 + 210) / 4.
    sums = Counter(rule.counts(state)) + Counter({"q_n_1_2": 3, "q_mq_1_2": 210000})
    carried = rule.start(request(), dict(sums))
    assert carried.q[1][2] == pytest.approx(65.0) and carried.q[0][0] == rule.q_init
    fresh = QLearningWindow(window_max=2, carry=False)
    assert fresh.start(request(), dict(sums)).q[1][2] == 0.0 and fresh.counts(state) == {}


def outcomes_of(record):
    from specserve.policies.window import WindowOutcome

    return WindowOutcome.of(record, record.requests[0])


def test_the_policy_starts_each_request_from_what_finished_ones_left_on_the_replica():
    policy = WindowPolicy(QLearningWindow(window_max=2, lr=0.5, discount=0.0, epsilon=0.0))
    sunk = []
    policy.carried.sinks.append(lambda draft, bucket, c: sunk.append((draft, bucket, c)))
    first = state_of(request("a", window=2))
    # A fresh table is all zeros: greedy takes the smallest window, a plain step (s = 2, a = 0).
    assert policy.choose(first, 1) == Speculation(0)
    finish(policy, first, 0, 0)                # 1 token in 20 ms: q[2][0] = 0.5 · 50
    assert policy.states == {} and sunk == [("d", "p64", {"q_n_2_0": 1, "q_mq_2_0": 25000})]
    second = state_of(request("b", window=2))
    policy.choose(second, 1)
    assert policy.states["b"].q[2][0] == pytest.approx(25.0)
    assert sum(map(sum, policy.states["b"].q)) == pytest.approx(25.0)   # nothing else was visited


def test_a_newer_snapshot_replaces_the_replicas_own_counts_and_sinks_get_every_finished_request():
    sums = CarriedSums()
    sunk = []
    sums.sinks.append(lambda *args: sunk.append(args))
    sums.add(request(), {"adt_requests": 1, "adt_depth": 5, "adt_top_k": 0})
    assert sums.for_request(request()) == {"adt_requests": 1.0, "adt_depth": 5.0}   # zero counts are not kept
    cluster = {"version": 3, "sums": {"adt_requests": 10.0, "adt_depth": 40.0}}
    # The snapshot of version 3 holds this replica's count (or the next will): the local one goes.
    assert sums.for_request(request(prior_learned=cluster)) == {"adt_requests": 10.0, "adt_depth": 40.0}
    sums.add(request(), {"adt_requests": 1, "adt_depth": 9})
    assert sums.for_request(request(prior_learned=cluster)) == {"adt_requests": 11.0, "adt_depth": 49.0}
    older = {"version": 2, "sums": {"adt_requests": 1.0}}
    assert sums.for_request(request(prior_learned=older))["adt_requests"] == 2.0   # an older one resets nothing
    assert [a[2] for a in sunk] == [{"adt_requests": 1, "adt_depth": 5}, {"adt_requests": 1, "adt_depth": 9}]


def test_tree_rules_start_from_the_carried_means():
    sage, adt, eagle = SageTree(), ADTTree(), Eagle2DepthTree()
    req = request(tree=TREE)
    assert sage.start(req, {"sage_requests": 4.0, "sage_max_depth": 22.0}).max_depth == 6   # 5.5 rounds up
    assert sage.start(req, {}).max_depth == sage.depth_max
    assert sage.start(req, {"sage_requests": 1.0, "sage_max_depth": 40.0}).max_depth == sage.depth_ceiling
    start = adt.start(req, {"adt_requests": 2.0, "adt_depth": 13.0, "adt_top_k": 10.0})
    assert (start.depth, start.top_k, start.budget) == (6, 5, 16)      # round(6.5) = 6 (half to even), 5
    assert (adt.start(req).depth, adt.start(req).top_k) == (3, 4)
    assert eagle.start(req, {"eagle2_requests": 3.0, "eagle2_depth": 14.0}).start_depth == 5
    assert eagle.start(req, {"eagle2_requests": 3.0, "eagle2_depth": 0.0}).start_depth == 1   # never 0
    # What each rule leaves: nothing before a step drafted.
    assert sage.counts(sage.start(req)) == {} and adt.counts(adt.start(req)) == {}
    assert eagle.counts(eagle.start(req)) == {}


def test_the_replica_hands_finished_requests_counts_to_redis_and_the_snapshot_carries_them_back():
    learning = ReplicaLearning("t")
    policy = PolicyByRequest("adt-tree")
    policy.carry_into(learning.collector.carry)
    rs = state_of(request("a", window=0, tree=TREE, prompt=tuple(range(100))))
    assert policy.choose(rs, 1) == Speculation(0, TreeShape(3, 4, 16))
    rs.advance(StepResult(3, 3, [0, 1, 2], [5, 5, 5, 5], 3))
    tree_step = RequestStep("a", "d", Speculation(0, TREE), 6, 3, 3, None)
    policy.observe(StepRecord(1, 7, 0, 1.0, 20.0, 0.0, (tree_step,)))
    policy.observe(StepRecord(0, 0, 0, 0.0, 0.0, 0.0, ()))
    # All three levels accepted: a deeper, narrower tree next (4, 1 -> bounded to 4).
    (key, counted), = learning.collector.drain().items()
    assert key.bucket == "p256" and counted == Counter(adt_requests=1, adt_depth=4, adt_top_k=4)
    # The policy service's sums come back in the prior, which a new request of that bucket brings.
    c = counts(600, 200, window=4) + counted
    for shape, steps, emitted, us in (("tree_4x4", 30, 90, 30_000), ("tree_2x8", 30, 60, 30_000)):
        c.update({f"{shape}_steps": steps, f"{shape}_emitted": emitted, f"{shape}_us": us,
                  f"load_b1_{shape}_steps": steps, f"load_b1_{shape}_emitted": emitted, f"load_b1_{shape}_us": us})
    c.update({"load_b8+_tree_2x8_steps": 30, "load_b8+_tree_2x8_emitted": 60, "load_b8+_tree_2x8_us": 10_000})
    snapshot = compute_snapshot({StatsKey("t", "d", "p256", 0): c}, now=0.0)
    snapshot.update(version=7, published_at=0.0)
    PolicySnapshot.model_validate(snapshot)                   # what a replica reads back parses
    prior, = [p for p in snapshot["priors"] if p["bucket"] == "p256"]
    assert prior["learned"] == {"adt_depth": 4.0, "adt_requests": 1.0, "adt_top_k": 4.0}
    # Alone, 4x4 emitted 3 tokens per ms against 2; at batch 8+ only 2x8 was measured (6 per ms).
    assert prior["best_tree"]["depth"] == 4 and prior["best_tree_by_load"]["b8+"]["depth"] == 2
    start = warm_start(snapshot, "t", "d", "p256", batch_size=1)
    assert start["tree"] == (4, 4) and start["learned"] == prior["learned"]
    assert warm_start(snapshot, "t", "d", "p256", batch_size=12)["tree"] == (2, 8)


def test_a_policy_with_sinks_pickles_without_them():
    # Serve pickles a replica's arguments to find deployment handles in them; the sinks are the
    # replica's statistics, behind a lock, and stay in the process that attached them.
    import pickle
    import threading

    class Statistics:
        def __init__(self):
            self.lock = threading.Lock()

        def carry(self, draft, bucket, counts):
            pass

    policy = PolicyByRequest("q-learning")
    policy.carry_into(Statistics().carry)
    policy.choose(state_of(request("a")), 1)   # an instance that carries exists, with the sink
    copy = pickle.loads(pickle.dumps(policy))
    assert copy._sinks == [] and copy.instances["q-learning"].carried.sinks == []
    assert len(policy.instances["q-learning"].carried.sinks) == 1


def test_a_task_with_no_tree_measured_starts_from_the_drafts_pooled_tree():
    with_trees = counts(600, 200, window=4) + Counter(
        {"tree_6x2_steps": 30, "tree_6x2_emitted": 90, "tree_6x2_us": 30_000})
    snapshot = compute_snapshot({StatsKey("t", "d", "p256", 0): with_trees,
                                 StatsKey("t", "d", "p1024", 0): counts(600, 200, window=4)}, now=0.0)
    snapshot.update(version=1, published_at=0.0)
    # The snapshot gives it the pooled prior's (it measured no shape of its own to beat it).
    assert next(p for p in snapshot["priors"] if p["bucket"] == "p1024")["best_tree"]["depth"] == 6
    assert warm_start(snapshot, "t", "d", "p1024")["tree"] == (6, 2)
    assert warm_start(snapshot, "t", "d", "p256")["tree"] == (6, 2)


def test_a_topic_with_no_tree_measured_starts_from_its_length_buckets_tree_before_the_drafts():
    def shaped(*shapes):
        c = counts(600, 200, window=4)
        for depth, emitted in shapes:
            c.update({f"tree_{depth}x2_steps": 30, f"tree_{depth}x2_emitted": emitted, f"tree_{depth}x2_us": 30_000})
        return c
    snapshot = compute_snapshot({StatsKey("t", "d", "p256-t0", 0): counts(600, 200, window=4),
                                 StatsKey("t", "d", "p256-t1", 0): shaped((6, 90), (3, 60)),
                                 StatsKey("t", "d", "p1024-t0", 0): shaped((3, 150)),   # the draft's fastest shape
                                 StatsKey("t", "d", "p1024-t1", 0): shaped((3, 150))}, now=0.0)
    snapshot.update(version=1, published_at=0.0)
    start = warm_start(snapshot, "t", "d", "p256-t0")
    assert start["bucket"] == "p256-t0" and start["tree"] == (6, 2)     # p256's, not the draft's (3, 2)
    assert warm_start(snapshot, "t", "d", "p1024-t2")["bucket"] == "p1024"


def test_a_share_of_tree_requests_starts_one_move_from_the_prior_shape_and_says_so(tmp_path):
    """With cluster learning on (a real Redis and a published snapshot), ``tree_explore`` of the
    tree requests start one move from the prior's shape (depth or top-k halved or doubled): the
    shapes the policy service then prices are the ones around the best measured. Chains, pinned
    trees and a share of 0 are left as they were."""
    from specserve.cluster.redis_server import RedisServer
    from specserve.policies.redis_stats import RedisStats
    from specserve.policies.replica_learning import neighbour_shapes

    assert neighbour_shapes(TreeShape(4, 2, 8)) == [(2, 2), (8, 2), (4, 1), (4, 4)]
    assert neighbour_shapes(TreeShape(1, 1, 2)) == [(2, 1), (1, 2)]
    assert neighbour_shapes(TreeShape(16, 64, 64)) == [(8, 64), (16, 32)]   # what a snapshot may carry
    with_tree = counts(600, 200, window=4) + Counter({"tree_4x2_steps": 30, "tree_4x2_emitted": 90, "tree_4x2_us": 30_000})
    server = RedisServer.start(tmp_path)
    try:
        RedisStats(server.url, "specserve").publish_snapshot(compute_snapshot({StatsKey("t", "d", "p64", 0): with_tree},
                                                                               now=0.0) | {"computed_at": 0.0})
        def started(share, tree=TreeShape(3, 4, 16), pinned=False, n=200):
            learning = ReplicaLearning("t", server.url, tree_explore=share, rng=random.Random(0))
            assert learning.snapshots.refresh() is not None
            window = 0 if tree is not None else 2
            return [learning.start(SpecRequest([1, 2, 3], 4, SamplingParams(), "d", window, tree, f"r{i}", pinned=pinned))
                    for i in range(n)]

        explored = [(r.tree.depth, r.tree.top_k, prior.get("explored_tree")) for r, prior in started(0.25)]
        moved = [(d, k) for d, k, shape in explored if shape is not None]
        assert all((d, k) == (4, 2) for d, k, shape in explored if shape is None)   # the prior's shape
        assert all(shape == (d, k) for d, k, shape in explored if shape is not None)
        assert 30 <= len(moved) <= 70 and set(moved) == {(2, 2), (8, 2), (4, 1), (4, 4)}
        assert all(r.tree.depth == 4 for r, _ in started(0.0))
        assert all(r.tree == TreeShape(3, 4, 16) and prior is None for r, prior in started(1.0, pinned=True))
        assert all(r.tree is None and r.window == 4 and "explored_tree" not in prior for r, prior in started(1.0, tree=None))
    finally:
        server.stop()


def test_a_topic_keeps_its_length_buckets_best_tree_unless_it_measured_that_shape_too():
    def shaped(*shapes):
        c = counts(600, 200, window=4)
        for depth, emitted in shapes:
            c.update({f"tree_{depth}x2_steps": 30, f"tree_{depth}x2_emitted": emitted, f"tree_{depth}x2_us": 30_000,
                      f"load_b1_tree_{depth}x2_steps": 30, f"load_b1_tree_{depth}x2_emitted": emitted,
                      f"load_b1_tree_{depth}x2_us": 30_000})
        return c
    snapshot = compute_snapshot({StatsKey("t", "d", "p256-t0", 0): shaped((2, 150)),
                                 StatsKey("t", "d", "p256-t1", 0): shaped((6, 60)),          # never tried 2x2
                                 StatsKey("t", "d", "p256-t2", 0): shaped((6, 90), (2, 60))}, now=0.0)
    best = {p["bucket"]: (p["best_tree"]["depth"], p["best_tree_by_load"]["b1"]["depth"]) for p in snapshot["priors"]}
    assert best["p256"] == (2, 2)
    assert best["p256-t1"] == (2, 2)      # its one shape beat nothing: the length bucket's best stands
    assert best["p256-t2"] == (6, 6)      # it measured 2x2 too, and 6x2 beat it there


def test_an_ensembles_hits_on_one_replica_steer_the_first_block_of_a_request_on_another():
    """Replica A's request finds the full view right; its draft's release leaves the hits, which go
    through A's statistics and the policy service's snapshot to a request on replica B, whose draft
    has verified nothing: B's first block drafts with the full-view-heavy mix, not the equal one."""
    from types import SimpleNamespace

    from specserve.replicas.drafts.ensemble import EnsembleDraftLM, _Drafted
    from specserve.replicas.drafts.ensemble_carry import cluster_sums
    from specserve.replicas.step import ProposeRequest
    from tiny_models import tiny_model

    def replica():
        return ReplicaLearning("t"), EnsembleDraftLM("tabed", tiny_model("llama", seed=1), turn_marker=[7, 3])

    (learning_a, draft_a), (learning_b, draft_b) = replica(), replica()
    # The full view put 0.6 on both verified tokens, the last-turn view all on token 50: only the
    # mixes with w_full > 5/6 drafted them.
    session = draft_a._session("a")
    full_right = torch.tensor([[0.6, 0.0], [0.4, 1.0]])   # [tokens, views]
    session.pending = (4, 2, [_Drafted(torch.tensor([t, 50]), full_right, torch.zeros(2), t) for t in (5, 11)])
    draft_a._learn(session, [1, 1, 1, 2, 5, 11])
    learning_a.carry_draft("tabed", request("a", draft="tabed", prompt=tuple(range(100))), draft_a.release("a"))
    (key, counted), = learning_a.collector.drain().items()
    snapshot = compute_snapshot({key: counts(600, 200, window=4) + counted}, now=0.0) | {"version": 2, "published_at": 0.0}
    PolicySnapshot.model_validate(snapshot)                   # what replica B reads back parses
    learning_b.snapshots = SimpleNamespace(current=lambda: snapshot)
    started, _ = learning_b.start(request("b", draft="tabed", prompt=tuple(range(100))))
    assert draft_b.weights_for("b").tolist() == [0.5, 0.5]   # B alone: nothing verified, the equal mix
    ask = ProposeRequest("b", [1, 2, 3, 4], 2, None, SamplingParams(), carried=cluster_sums(started.prior_learned))
    draft_b.propose_chains([ask], [None])
    assert not draft_b.prior.scores and draft_b.weights_for("b")[0] > 5 / 6
    # A request that pins its window keeps it and starts cold, but its draft's own sums come along.
    pinned = replace(request("p", draft="tabed", prompt=tuple(range(100)), window=3), pinned=True)
    kept, prior = learning_b.start(pinned)
    assert prior is None and kept.window == 3 and kept.prior_alpha is None
    assert kept.prior_learned["sums"] == cluster_sums(started.prior_learned)
