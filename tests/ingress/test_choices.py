"""A request's choices (``n``, ``best_of``) over HTTP and gRPC, against a scripted target
deployment: one target request per choice with its own id and seed, answers in index order, one
usage, ``best_of``'s likeliest kept, streams interleaved by index, a failure failing them all."""

import asyncio
import json
from dataclasses import replace

import pytest

from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.auth import ApiKeys
from specserve.ingress.choices import choice_requests
from specserve.ingress.grpc_api import GrpcFace
from specserve.ingress.http_api import HttpFace
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Prepared
from specserve.replicas.request import SpecRequest, StepError, StreamItem
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TokenLogprob
from scripted_target import HANG, SPEC, GrpcContext, Letters, Replicas, streams

SEEDED = SamplingParams(temperature=1.0, seed=42)


class Prepare:
    tokenizer = Letters()

    def __init__(self, logprobs=None, params=SEEDED):
        self.logprobs, self.params = logprobs, params

    async def prepare(self, _):
        return Prepared("abc", SpecRequest([20, 21], 4, self.params, request_id="abc", logprobs=self.logprobs), stop=[])


def faces(replicas: Replicas, prepare: Prepare | None = None) -> tuple[HttpFace, GrpcFace]:
    target_streams = streams(replicas)
    prepare = prepare or Prepare()
    return HttpFace(target_streams.config, prepare, target_streams, replicas), GrpcFace("m", ApiKeys(), prepare, target_streams)


def ended(tokens: list[int], cached: int = 0, logprobs=None) -> StreamItem:
    return StreamItem(tokens, "length", SPEC, cached_tokens=cached, logprobs=logprobs)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_choices_are_requests_of_their_own_ids_and_seeds():
    prepared = asyncio.run(Prepare().prepare(None))
    choices = choice_requests(prepared, 3)
    assert [c.spec_request.request_id for c in choices] == ["abc", "abc-1", "abc-2"]
    assert [c.spec_request.params.seed for c in choices] == [42, 43, 44]
    assert choices[0].spec_request == prepared.spec_request   # choice 0 is the request itself
    top = replace_seed(prepared, 2**63 - 1)
    assert [c.spec_request.params.seed for c in choice_requests(top, 2)] == [2**63 - 1, -(2**63)]
    assert all(c.spec_request.logprobs == 0 for c in choice_requests(prepared, 2, ranked=True))


def replace_seed(prepared: Prepared, seed: int) -> Prepared:
    return replace(prepared, spec_request=replace(prepared.spec_request, params=replace(SEEDED, seed=seed)))


def test_n_chat_choices_come_in_index_order_with_one_usage():
    replicas = Replicas([ended([0, 1], cached=0)], [ended([2], cached=1)], [ended([3, 4, 5], cached=1)])
    http, _ = faces(replicas)
    body = asyncio.run(http.chat_completions(chat(n=3)))
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "ab"), (1, "c"), (2, "def")]
    assert [r.params.seed for r in replicas.requests] == [42, 43, 44]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c["spec"] == SPEC for c in body["choices"]) and body["spec"] == SPEC


def test_best_of_keeps_the_likeliest_and_shows_logprobs_only_when_asked():
    def lp(*values):
        return [TokenLogprob(v) for v in values]

    replicas = Replicas([ended([0, 1], logprobs=lp(-1.0, -2.0))], [ended([2, 3], logprobs=lp(-0.5, -0.5))],
                        [ended([4], logprobs=lp(-4.0))])
    http, _ = faces(replicas)
    body = asyncio.run(http.completions(CompletionRequest(model="m", prompt="hi", best_of=3, max_tokens=4)))
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, "cd", None)]
    assert [r.logprobs for r in replicas.requests] == [0, 0, 0]   # computed to rank them, not shown
    assert body["usage"]["completion_tokens"] == 5                 # every candidate's tokens were generated


def test_n_streams_interleave_by_index_each_chat_choice_saying_its_role_first():
    replicas = Replicas([StreamItem([0]), ended([1])], [StreamItem([2]), ended([3])])
    http, _ = faces(replicas)

    async def chunks():
        response = await http._stream(await Prepare().prepare(None), chat(n=2, stream=True,
                                      stream_options={"include_usage": True}), chat=True)
        return [json.loads(c[len("data: "):]) for c in [c async for c in response.body_iterator][:-1]]

    got = asyncio.run(chunks())
    per_choice = {i: [c["choices"][0]["delta"] for c in got if c["choices"] and c["choices"][0]["index"] == i]
                  for i in (0, 1)}
    assert per_choice[0] == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert per_choice[1] == [{"role": "assistant", "content": ""}, {"content": "c"}, {"content": "d"}]
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 4
    assert sum(1 for c in got if "usage" in c) == 1


def test_a_choice_that_fails_fails_the_request_and_the_others_are_cancelled():
    fault = StreamItem([], error=StepError("ValueError: no token is left", request_fault=True))
    replicas = Replicas([StreamItem([0]), HANG], [fault])
    http, _ = faces(replicas)
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(http.chat_completions(chat(n=2)))
    assert raised.value.code == "request_failed"
    assert replicas.opened[0].cancelled


def test_grpc_choices_and_chunks_by_index():
    replicas = Replicas([ended([0, 1])], [ended([2])])
    _, grpc_face = faces(replicas)
    response = asyncio.run(grpc_face.complete(pb.CompletionRequest(model="m", prompt="hi", n=2), GrpcContext()))
    assert response.text == "ab" and [(c.index, c.text) for c in response.choices] == [(0, "ab"), (1, "c")]
    assert response.usage.completion_tokens == 3

    replicas = Replicas([StreamItem([0]), ended([1])], [ended([2])])
    _, grpc_face = faces(replicas)

    async def chunks():
        request = pb.CompletionRequest(model="m", prompt="hi", n=2)
        return [c async for c in grpc_face.complete_stream(request, GrpcContext())]

    got = asyncio.run(chunks())
    assert sorted((c.index, c.text) for c in got) == [(0, "a"), (0, "b"), (1, "c")]
    assert {c.index for c in got if c.finish_reason} == {0, 1}


def test_grpc_best_of_is_not_streamed():
    _, grpc_face = faces(Replicas())
    context = GrpcContext()

    async def chunks():
        request = pb.CompletionRequest(model="m", prompt="hi", n=1, best_of=2)
        return [c async for c in grpc_face.complete_stream(request, context)]

    with pytest.raises(OpenAIError):
        asyncio.run(chunks())
    assert "best_of" in context.details
