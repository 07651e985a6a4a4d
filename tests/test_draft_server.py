"""A draft server outside Ray (the class a deployment wraps, and what a colocated draft is): an
HSR head tells the target it needs hidden states, and a replica that never saw a session asks for
them from the start, which the target's step loop then sends, so the proposal is the one a warm
replica would make."""

import asyncio

import pytest
import torch

from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts.hsr_draft import NeedFeatures
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal
from specserve.replicas.target import Target
from specserve.replicas.target_deployment import ColocatedDraft, TargetDeployment
from specserve.router.session import ProposeRequest
from tiny_hsr import save_tiny_pair, trained_hsr_head
from tiny_models import tiny_model

GREEDY = SamplingParams()
PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_model("llama", seed=0, layers=3)
    return target, save_tiny_pair(target, trained_hsr_head(target, steps=60), tmp_path_factory.mktemp("tiny"))


def test_a_replica_without_the_sessions_states_asks_for_them_and_gets_them(pair):
    target_model, head_dir = pair
    propose_with_features = TargetDeployment.func_or_class._propose_with_features

    async def run():
        cold = DraftServer("hsr", str(head_dir), dtype="float32")
        warm = DraftServer("hsr", str(head_dir), dtype="float32")
        assert await cold.needs_features() and not await DraftServer("lookup", None).needs_features()
        target = Target(target_model)
        context = PROMPT + target.verify(PROMPT, Proposal.empty(), GREEDY, None).emitted_tokens
        ask = ProposeRequest(3, None)
        # The warm replica got every state in order.
        expected, sent = await propose_with_features(ColocatedDraft(warm), "s", context, ask, GREEDY, target, 0)
        assert sent == len(context) - 1 and len(expected.tokens) == 3
        # The cold one is told it was sent the first rows already: it asks again from 0.
        direct = await cold.propose("s", context, ProposeRequest(3, None, target.features(context, 5), 5), GREEDY)
        assert direct == NeedFeatures(0)
        got, sent = await propose_with_features(ColocatedDraft(cold), "s", context, ask, GREEDY, target, 5)
        assert sent == len(context) - 1 and got.tokens == expected.tokens

    asyncio.run(run())


def test_a_pooled_target_cache_never_hands_out_another_requests_states(pair):
    target = Target(pair[0])
    target.verify(PROMPT, Proposal.empty(), GREEDY, None)
    other = [9, 9, 9, 1, 2]
    assert len(target.features(other)) == 0                   # no common prefix: nothing
    assert torch.equal(target.features(PROMPT[:4] + [40]), target.features(PROMPT)[:4])
