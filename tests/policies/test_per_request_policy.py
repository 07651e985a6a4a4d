"""`spec.policy`: a request's own policy beside the deployment's, in one batch."""

import pytest

from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.request import SpecRequest
from specserve.replicas.target import Target
from specserve.replicas.engine import run_batch
from tiny_servers import GREEDY, alone, servers
from tiny_models import tiny_model

PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


def test_each_request_follows_its_own_policy_in_one_batch():
    model = tiny_model("llama", seed=0)
    policy = PolicyByRequest("static")
    requests = [SpecRequest(PROMPT, 24, GREEDY, "near", 4, None, "deployment's"),
                SpecRequest(PROMPT, 24, GREEDY, "near", 4, None, "own", policy="hf-heuristic")]
    static, adapted = run_batch(Target(model, slots=4), servers(model), requests, policy=policy)
    assert set(policy.instances) == {"static", "hf-heuristic"}
    # Static: the asked window every step (until the last steps cap it at the tokens left).
    assert static.stats.windows[:3] == [4, 4, 4]
    assert any(w != 4 for w in adapted.stats.windows[:10])      # +2 / -1 per step: it moved
    assert static.token_ids == adapted.token_ids == alone(model, PROMPT)


def test_an_unknown_default_policy_is_refused():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        PolicyByRequest("nope")


def test_the_response_spec_lists_the_trees_a_tree_policy_asked_for():
    from specserve.replicas.step import TreeShape

    model = tiny_model("llama", seed=0)
    request = SpecRequest(PROMPT, 24, GREEDY, "near", 0, TreeShape(4, 2, 8), "tree", policy="adt-tree")
    (gen,) = run_batch(Target(model, slots=2), servers(model), [request], policy=PolicyByRequest("static"))
    trees = gen.stats.summary()["trees"]
    # Every step but the last (no room left for a draft token: plain) asked a tree.
    assert len(trees) >= gen.stats.steps - 1 and all(len(t) == 3 for t in trees)
    assert len({tuple(t) for t in trees}) > 1, trees     # ADT-Tree moved the shape step by step
    assert gen.token_ids == alone(model, PROMPT)
