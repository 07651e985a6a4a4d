"""`spec.policy`: a request's own policy beside the deployment's, in one batch."""

import pytest

from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.scheduler import SpecRequest
from specserve.replicas.target import Target
from specserve.router.engine import run_batch
from test_scheduler import GREEDY, alone, servers
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
