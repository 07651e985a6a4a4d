"""The target replica's class outside Serve (the same object Serve constructs), on the reference
target: its health reflects whether the model runs, and a request that leaves gives its KV slot
back at the next step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.model_store import REFERENCE_TARGET
from specserve.replicas.request import SpecRequest, StaticPolicy, StreamItem
from specserve.replicas.target_deployment import UNHEALTHY_AFTER_FAILED_STEPS, TargetConfig, TargetDeployment

pytestmark = pytest.mark.reference

Replica = TargetDeployment.func_or_class   # the class behind the Serve deployment


@pytest.fixture
def replica():
    return Replica(TargetConfig(REFERENCE_TARGET, dtype="float32", max_batch=4), policy=PolicyByRequest("static"))


def prompt(replica, text: str) -> list[int]:
    from specserve.replicas.prompt_ids import encode_chat

    return encode_chat(replica.loaded.tokenizer, [{"role": "user", "content": text}])


def break_weights(replica) -> None:
    """The embedding's storage is lost (in place, so every forward holding the parameter sees it)."""
    weight = replica.loaded.model.get_input_embeddings().weight
    weight.data = torch.empty(0, weight.shape[1], dtype=weight.dtype)


def test_a_replica_whose_model_cannot_run_is_unhealthy(replica):
    async def scenario():
        await replica.check_health()                      # a working model: healthy
        break_weights(replica)
        with pytest.raises(RuntimeError, match="cannot run one token"):
            await replica.check_health()

    asyncio.run(scenario())


def test_failing_steps_make_it_unhealthy_and_end_their_streams_with_an_error(replica):
    async def scenario():
        break_weights(replica)
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            items = [item async for item in replica.generate(SpecRequest(prompt(replica, f"Count to {i}"), 8,
                                                                         request_id=f"r{i}"))]
            # One item, the error: no finish_reason or spec, so the ingress resumes the request.
            (failed,) = items
            assert failed.last and failed.finish_reason is None and failed.spec is None
            assert failed.error.message == replica.loop.last_error   # what the model raised
        assert replica.loop.failures == UNHEALTHY_AFTER_FAILED_STEPS
        with pytest.raises(RuntimeError, match="steps failed in a row"):
            await replica.check_health()

    asyncio.run(scenario())


def test_a_request_that_leaves_gives_its_slot_and_kv_back_at_the_next_step(replica):
    async def scenario():
        stay = replica.generate(SpecRequest(prompt(replica, "Name three rivers."), 48, request_id="stay"))
        leave = replica.generate(SpecRequest(prompt(replica, "Write a long poem about the sea."), 200, request_id="leave"))
        await anext(stay)
        await anext(leave)
        busy = await replica.load()
        assert busy["running"] == 2 and busy["kv_positions_in_use"] > 0
        await leave.aclose()                              # the client hung up
        await anext(stay)                                 # one more step runs
        after = await replica.load()
        assert after["running"] == 1
        assert after["kv_positions_in_use"] < busy["kv_positions_in_use"]
        assert after["kv_bytes_allocated"] == busy["kv_bytes_allocated"]   # slots are reused, not reallocated
        async for _ in stay:
            pass
        idle = await replica.load()
        assert idle["running"] == 0 and idle["kv_positions_in_use"] == 0 and idle["waiting"] == 0

    asyncio.run(scenario())


def test_max_model_len_allocates_the_whole_cache_at_start_and_refuses_longer_requests():
    config = TargetConfig(REFERENCE_TARGET, dtype="float32", max_batch=2, kv_sessions_idle=1, max_model_len=256)
    replica = Replica(config, policy=PolicyByRequest("static"))
    config = replica.loaded.model.config
    per_position = (config.num_hidden_layers * 2 * config.num_key_value_heads
                    * (config.hidden_size // config.num_attention_heads) * 4)   # K and V, float32

    async def scenario():
        start = await replica.load()
        assert start["kv_max_len"] == 256 and start["kv_bytes_allocated"] == 3 * 256 * per_position
        # On the CPU the configuration sizes the cache: max_batch + kv_sessions_idle slots.
        assert (start["kv_slots"], start["kv_capacity_tokens"], start["kv_sized_by"]) == (3, 3 * 256, "config")
        assert start["cuda_graphs"] is None and start["fused_elementwise"] is False   # both CUDA's alone
        async for _ in replica.generate(SpecRequest(prompt(replica, "Name three rivers."), 24, request_id="a")):
            pass
        assert (await replica.load())["kv_bytes_allocated"] == start["kv_bytes_allocated"]
        with pytest.raises(ValueError, match="limit of 256 tokens"):
            async for _ in replica.generate(SpecRequest(prompt(replica, "Hi"), 250, request_id="b")):
                pass

    asyncio.run(scenario())


def test_stream_interval_sends_the_first_step_at_once_then_pieces_of_at_least_that_many(replica):
    async def pieces(interval: int) -> list[list[int]]:
        request = SpecRequest(prompt(replica, "Name five rivers."), 13, request_id=f"i{interval}", stream_interval=interval)
        return [item.token_ids async for item in replica.generate(request)]

    every = asyncio.run(pieces(1))
    grouped = asyncio.run(pieces(4))
    assert len(every) == 13 and all(len(p) == 1 for p in every[:-1])   # plain decoding: a token a step
    assert sum(grouped, []) == sum(every, [])                            # the same tokens, fewer items
    assert len(grouped[0]) == 1 and all(len(p) >= 4 for p in grouped[1:-1]) and len(grouped) <= 5


def test_only_the_last_item_carries_the_spec_summary_the_replica_built_once(replica):
    async def items(request: SpecRequest) -> list[StreamItem]:
        return [item async for item in replica.generate(request)]

    text = prompt(replica, "Repeat: one two three, one two three, one two three.")
    spoken = asyncio.run(items(SpecRequest(text, 6, request_id="plain")))
    assert all(not item.last and item.spec is None for item in spoken[:-1])
    last = spoken[-1]
    assert last.finish_reason == "length" and last.error is None and last.cached_tokens == 0
    # A plain request: what speculation did (nothing), and no policy adapted it.
    assert last.spec["draft"] == "none" and last.spec["steps"] == 6 and "policy" not in last.spec
    again = asyncio.run(items(SpecRequest(text, 6, request_id="again")))[-1]
    assert again.cached_tokens == len(text) - 1   # the slot kept the prompt's KV (the root is fed again)


@pytest.mark.parametrize("utilization", [0.0, 1.5])
def test_gpu_memory_utilization_outside_0_to_1_is_refused_before_the_model_loads(utilization):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        TargetConfig("no-such-model", gpu_memory_utilization=utilization)


def test_a_policy_that_cannot_name_its_rule_is_refused_before_the_model_loads():
    # The response's spec.policy names the rule each request ran under; a bare StaticPolicy cannot,
    # and finding out at the end of a streamed request would cost the client its response.
    with pytest.raises(TypeError, match="PolicyByRequest"):
        Replica(TargetConfig("no-such-model"), policy=StaticPolicy())


def test_a_prompt_answered_on_one_replica_is_drafted_from_its_answer_on_another(tmp_path):
    """The suffix draft inside two replicas sharing outputs through a real Redis: the second
    replica drafts the repeat from the first one's answer, and the output is the same; another
    tenant's repeat gets nothing from it."""
    from specserve.cluster.redis_server import RedisServer
    from specserve.policies.replica_learning import ReplicaLearningFactory

    server = RedisServer.start(tmp_path)
    suffix = {"suffix": {"model": None, "method": "suffix", "seed_outputs": None}}

    def make() -> Replica:
        return Replica(TargetConfig(REFERENCE_TARGET, dtype="float32", max_batch=4), policy=PolicyByRequest("static"),
                       drafts=suffix, learning=ReplicaLearningFactory(server.url, "app"))

    async def answer(replica, text, salt=None):
        request = SpecRequest(text, 64, draft="suffix", window=4, pinned=True, request_id=f"r-{salt}", cache_salt=salt)
        items = [item async for item in replica.generate(request)]
        return [t for item in items for t in item.token_ids], items[-1].spec

    async def scenario():
        first, second = make(), make()
        text = prompt(first, "Describe how a bicycle works in a few sentences.")
        tokens, cold = await answer(first, text)
        await answer(second, prompt(second, "Hello!"))        # starts the second replica's exchange
        for _ in range(100):                                  # Redis, then the next build there
            if second._suffixes[0].remembered >= len(tokens):
                break
            await asyncio.sleep(0.1)
        again, warm = await answer(second, text)
        other, isolated = await answer(second, text, salt="tenant-b")
        return tokens, cold, again, warm, other, isolated

    try:
        tokens, cold, again, warm, other, isolated = asyncio.run(scenario())
    finally:
        server.stop()
    assert again == tokens == other
    assert warm["mean_accepted_len"] >= 3.0 > cold["mean_accepted_len"] + 1   # ≤ 4 a step at window 4
    assert isolated["mean_accepted_len"] < 2.0


def test_the_layers_an_inside_head_reads_are_tapped_before_any_request():
    """A step graph keeps the layers it was captured with: the start's capture must see the head's."""
    replica = Replica(TargetConfig(REFERENCE_TARGET, dtype="float32", max_batch=2, max_model_len=256),
                      policy=PolicyByRequest("static"), drafts={"smollm2-eagle3": {"model": "smollm2-eagle3"}})
    head = replica.loop.drafts["smollm2-eagle3"]
    tapped = replica.scheduler.target._tap.watched_layers
    layers = {replica.scheduler.target._decoder_layer(layer) for layer in head.feature_layers}
    assert head.needs_features and len(layers) > 1 and layers <= tapped
