"""A draft server outside Ray (the class a deployment wraps, and what a draft placed inside the target is): an
HSR head tells the target it needs hidden states, and a replica that never saw a session asks for
them from the start, which the target's step loop then sends, so the proposal is the one a warm
replica would make."""

import asyncio

import pytest
import torch

from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts.base import NeedFeatures
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal
from specserve.replicas.target import Target
from specserve.replicas.request import StaticPolicy
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.request import SpecRequest
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import ProposeRequest, TreeShape
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.engine import speculative_generate
from tiny_hsr import save_tiny_pair, trained_hsr_head
from tiny_models import tiny_model

GREEDY = SamplingParams()
PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = tiny_model("llama", seed=0, layers=3)
    return target, save_tiny_pair(target, trained_hsr_head(target, steps=60), tmp_path_factory.mktemp("tiny"))


@pytest.mark.slow
def test_a_replica_without_the_sessions_states_asks_for_them_and_gets_them(pair):
    target_model, head_dir = pair

    async def run():
        cold = DraftServer("hsr", str(head_dir), dtype="float32")
        warm = DraftServer("hsr", str(head_dir), dtype="float32")
        assert (await cold.info())["needs_features"] and not (await DraftServer("lookup", None).info())["needs_features"]
        assert (await cold.info())["vocab_size"] == target_model.config.vocab_size
        target = Target(target_model)
        context = PROMPT + target.verify_one(PROMPT, Proposal.empty(), GREEDY).emitted_tokens

        def ask(start):
            return ProposeRequest("s", context, 3, None, GREEDY, features=target.features(context, start), features_start=start)

        # The warm replica got every state in order.
        [expected] = await warm.propose_batch([ask(0)])
        assert len(expected.tokens) == 3
        # The cold one is told it was sent the first rows already: it asks again from 0 ...
        assert await cold.propose_batch([ask(5)]) == [NeedFeatures(0)]
        # ... and from there proposes what the warm one did.
        [got] = await cold.propose_batch([ask(0)])
        assert got.tokens == expected.tokens

    asyncio.run(run())


@pytest.mark.slow
def test_the_step_loop_resends_states_to_a_cold_draft_replica(pair):
    # Through the loop: a draft replica that lost a session's states mid-request (a restart, a
    # reshuffle) is re-sent them, and the output stays the target's own.
    target_model, head_dir = pair
    server = DraftServer("hsr", str(head_dir), dtype="float32")
    expected = speculative_generate(Target(target_model), None, PROMPT, 16, GREEDY).token_ids
    scheduler = Scheduler(Target(target_model, slots=2), StaticPolicy())
    loop = StepLoop(scheduler, {"hsr": server}, InlineWorker())
    state = loop.add(SpecRequest(PROMPT, 16, GREEDY, "hsr", 3, None, "s"))

    async def run():
        for _ in range(3):
            await loop.step()
        server.pool = type(server.pool)(server.pool._make)   # the replica forgets every session
        await loop.run_until_idle()

    asyncio.run(run())
    assert state.out == expected and state.stats.accepted > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a head's steps run as graphs on CUDA only")
def test_a_served_head_captures_its_graphs_before_its_first_proposal(pair):
    target_model, head_dir = pair
    server = DraftServer("hsr", str(head_dir), dtype="float32", max_model_len=100, trees=(TreeShape(4, 3, 10),))
    held = server.graphs_captured
    assert held == 27   # the buckets of 64 and 128 positions: chain, feeds, tree levels, the whole tree
    target = Target(target_model)
    context = PROMPT + target.verify_one(PROMPT, Proposal.empty(), GREEDY).emitted_tokens
    asks = [ProposeRequest("chain", context, 3, None, GREEDY, features=target.features(context, 0), features_start=0),
            ProposeRequest("tree", context, 0, TreeShape(4, 3, 10), GREEDY, features=target.features(context, 0),
                           features_start=0)]
    chain, tree = asyncio.run(server.propose_batch(asks))
    assert len(chain.tokens) == 3 and len(tree.tokens) == 10
    assert server.graphs_captured == held


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a draft LM's cache is reserved on CUDA only")
def test_a_served_draft_lm_reserves_its_cache_and_captures_its_graphs_at_start(pair):
    _, head_dir = pair
    server = DraftServer("lm", str(head_dir.parent / "target"), dtype="float32", max_model_len=200)
    kv = server._batched.kv
    held = len(kv.graphs)
    assert kv.capacity == 200 and held > 0
    [proposal] = asyncio.run(server.propose_batch([ProposeRequest("s", PROMPT, 3, None, GREEDY)]))
    assert len(proposal.tokens) == 3
    assert kv.capacity == 200 and len(kv.graphs) == held   # no growth, no capture while serving


@pytest.mark.slow
def test_a_pooled_target_cache_never_hands_out_another_requests_states(pair):
    target = Target(pair[0])
    target.verify_one(PROMPT, Proposal.empty(), GREEDY)
    other = [9, 9, 9, 1, 2]
    assert len(target.features(other)) == 0                   # no common prefix: nothing
    assert torch.equal(target.features(PROMPT[:4] + [40]), target.features(PROMPT)[:4])


def test_a_suffix_draft_server_drafts_from_its_seed_answers_and_what_it_is_told_to_remember(tmp_path):
    from specserve.data.answers import Answer, save_chunk

    save_chunk(tmp_path / "answers-00000.npz", [Answer("chat", 2, [1, 2, 30, 31, 32, 33])])
    server = DraftServer("suffix", method="suffix", seed_outputs=str(tmp_path))
    assert server.suffix is not None and server.suffix.seed.tokens == 4   # the answer, not its prompt

    def ask(context, salt=None):
        return asyncio.run(server.propose_batch([ProposeRequest("s", context, 3, None, GREEDY, cache_salt=salt)]))[0]

    assert ask([9, 30, 31, 32]).tokens == [33]
    assert ask([9, 40, 41, 42]).tokens == []
    server.suffix.remember([40, 41, 42, 43, 44], cache_salt="t")
    server.suffix.refresh()
    assert ask([9, 40, 41, 42], salt="t").tokens == [43, 44] and ask([9, 40, 41, 42]).tokens == []


def test_a_draft_lm_served_as_an_ensemble_drafts_through_its_views_and_an_hsr_head_cannot_be_one(pair):
    from specserve.replicas.drafts.ensemble import EnsembleDraftLM

    target, head_dir = pair
    folder = head_dir.parent / "target"   # the target as its own draft LM: every drafted token is its own
    server = DraftServer("tabed", str(folder), "float32", ensemble={"views": ["full", "last-turn"], "weights": "adaptive",
                                                                 "distance": "kl", "history": None,
                                                                 "turn_marker": [5, 6]})
    assert isinstance(server._batched, EnsembleDraftLM) and server._batched.marker == [5, 6]
    proposal = asyncio.run(server.propose_batch([ProposeRequest("s", PROMPT, 3, None, GREEDY)]))[0]
    # The first token: the argmax of the equal mix of the target reading its whole prompt and
    # reading it from its last [5, 6] on (nothing verified yet).
    last_turn = PROMPT[len(PROMPT) - 1 - PROMPT[::-1].index(5):]
    with torch.inference_mode():
        full_q, turn_q = (torch.softmax(target(torch.tensor([ids])).logits[0, -1], -1) for ids in (PROMPT, last_turn))
    assert last_turn == [5, 6] and len(proposal.tokens) == 3
    assert proposal.tokens[0] == int((0.5 * full_q + 0.5 * turn_q).argmax()) != int(full_q.argmax())
    with pytest.raises(ValueError, match="hidden-state-reuse head"):
        DraftServer("tabed", str(head_dir), "float32", ensemble={"views": ["full", "last-turn"]})


def test_a_served_head_asked_for_the_windowed_attention_skips_a_vlm_requests_image_positions(pair):
    """``windowed`` from the config reaches every session's head: on an ask whose context holds
    image tokens (ids past the vocabulary, the placeholder 3 in their stead), the session caches
    text positions only."""
    from specserve.replicas.model.image_tokens import VIRTUAL_BASE

    target_model, head_dir = pair
    picture = list(range(VIRTUAL_BASE, VIRTUAL_BASE + 8))
    context = [5, 6, *picture, 7, 8, 9, 5, 6]
    placeholder_view = [3 if t >= VIRTUAL_BASE else t for t in context]
    target = Target(target_model)
    target.verify_one(placeholder_view, Proposal.empty(), GREEDY)   # states of the placeholder view
    for windowed, cached in ((False, list(range(1, len(context)))), (True, [1, 10, 11, 12, 13, 14])):
        server = DraftServer("hsr", str(head_dir), dtype="float32", windowed=windowed)
        ask = ProposeRequest("s", context, 3, None, GREEDY, features=target.features(placeholder_view, 0),
                             image_placeholder=3)
        [proposal] = asyncio.run(server.propose_batch([ask]))
        assert len(proposal.tokens) == 3
        with server.pool.using("s", placeholder_view) as draft:
            assert draft.session.cached == cached, windowed


# ---- what a finished request's session leaves ------------------------------------------------

CLUSTER = {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_5": 6.0}


def test_an_ensembles_session_gets_the_clusters_sums_with_its_first_ask_and_leaves_its_counts_at_release():
    from specserve.replicas.drafts.draft_lm import DraftLM
    from specserve.replicas.engine import in_process_server
    from tiny_models import perturbed

    target = tiny_model("llama", seed=0)
    server = in_process_server("tabed", DraftLM("tabed", perturbed(target, seed=1)), ensemble={"turn_marker": [7, 3]})
    asked, left = [], []
    propose = server.propose_batch

    async def recording(asks):
        asked.extend(asks)
        return await propose(asks)

    server.propose_batch = recording
    loop = StepLoop(Scheduler(Target(target, slots=2), StaticPolicy()), {"tabed": server}, InlineWorker(),
                    on_carried=lambda *args: left.append(args))
    learned = {"version": 4, "sums": {**CLUSTER, "adt_requests": 3.0}}
    state = loop.add(SpecRequest(PROMPT, 24, GREEDY, "tabed", 3, None, "r", prior_learned=learned))
    asyncio.run(loop.run_until_idle())
    # The ensemble's part of the sums, on the first ask only.
    assert asked[0].carried == CLUSTER and len(asked) > 1 and all(a.carried is None for a in asked[1:])
    (draft, request, counts), = left
    assert draft == "tabed" and request.request_id == "r" and state.done
    assert 0 < counts["tabed_01_g10_positions"] <= len(state.out) and set(counts) <= {
        "tabed_01_g10_positions", *(f"tabed_01_g10_hits_{j}" for j in range(11))}
    assert server._batched.sessions == {}
    # The release carries the final context, which scores the last block: without it, fewer positions.
    release, unended = server.release, []

    async def without_ending(session_ids, endings=None):
        return await release(session_ids)

    server.release = without_ending
    loop = StepLoop(Scheduler(Target(target, slots=2), StaticPolicy()), {"tabed": server}, InlineWorker(),
                    on_carried=lambda *args: unended.append(args))
    loop.add(SpecRequest(PROMPT, 24, GREEDY, "tabed", 3, None, "r2", prior_learned=learned))
    asyncio.run(loop.run_until_idle())
    assert 0 < unended[0][2]["tabed_01_g10_positions"] < counts["tabed_01_g10_positions"]


def test_the_start_up_cost_probe_proposes_through_an_ensemble_and_releases_its_sessions():
    from specserve.replicas.cost_probe import draft_ms_per_position
    from specserve.replicas.drafts.draft_lm import DraftLM
    from specserve.replicas.engine import in_process_server
    from tiny_models import VOCAB, perturbed

    server = in_process_server("tabed", DraftLM("tabed", perturbed(tiny_model("llama", seed=0), seed=1)),
                               ensemble={"turn_marker": [7, 3]})
    assert draft_ms_per_position(server.propose_now, VOCAB, server.features_size) >= 0
    assert server._batched.sessions == {}


class Releasing:
    """A draft deployment stand-in that proposes nothing and answers a release with ``reply``."""

    def __init__(self, reply):
        self.reply = reply

    async def info(self):
        return {"needs_features": False, "vocab_size": None}

    async def propose_batch(self, asks):
        return [Proposal.empty() for _ in asks]

    async def release(self, session_ids, endings=None):
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


GOOD = {"tabed_01_g10_positions": 4, "tabed_01_g10_hits_2": 3}


@pytest.mark.parametrize("reply, expected", [
    ({"a": GOOD, "b": {**GOOD, "tabed_01_g10_hits_2": 9}, "x": GOOD}, ["a"]),   # b: more hits than positions; x: not asked
    ({"a": {**GOOD, "tabed_01_g10_hits_2": -1}}, []),
    ({"a": {"q_n_1_1": 5}}, []),
    ("garbage", []), (None, []),
    (RuntimeError("draft replica gone"), []),
], ids=["one good", "negative", "another name", "a string", "none", "release failed"])
def test_only_valid_counts_of_the_requests_asked_reach_the_replica_and_no_release_fails_a_request(reply, expected):
    target = tiny_model("llama", seed=0)
    left = []
    loop = StepLoop(Scheduler(Target(target, slots=2), StaticPolicy()), {"remote": Releasing(reply)}, InlineWorker(),
                    on_carried=lambda draft, request, counts: left.append((request.request_id, counts)))
    states = [loop.add(SpecRequest(PROMPT, 3, GREEDY, "remote", 2, None, rid)) for rid in ("a", "b")]
    asyncio.run(loop.run_until_idle())
    assert all(s.done and s.finish_reason == "length" for s in states)
    assert left == [(rid, GOOD) for rid in expected]


def test_a_sink_that_fails_costs_only_the_counts():
    def broken(*args):
        raise ValueError("statistics closed")

    loop = StepLoop(Scheduler(Target(tiny_model("llama", seed=0), slots=2), StaticPolicy()),
                    {"remote": Releasing({"a": GOOD})}, InlineWorker(), on_carried=broken)
    state = loop.add(SpecRequest(PROMPT, 3, GREEDY, "remote", 2, None, "a"))
    asyncio.run(loop.run_until_idle())
    assert state.done and state.finish_reason == "length"
