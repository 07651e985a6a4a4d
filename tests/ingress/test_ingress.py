"""The ingress's continuation of a request whose target replica failed, and how it reads a target
replica's stream of ``StreamItem``s: the replica's summary passed on, a failed step resumed or
answered 503 / ``UNAVAILABLE`` (the live kill tests are in test_faults.py)."""

import asyncio

import grpc
import pytest

from specserve.ingress.deployment import IngressConfig, Prepared, _openai_error
from specserve.ingress.openai_api import OpenAIError
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import SpecRequest, StepError, StreamItem
from specserve.ingress.deployment import Ingress as IngressDeployment

Ingress = IngressDeployment.func_or_class   # the class behind the Serve deployment


def test_a_continuation_is_the_prompt_plus_what_was_produced_with_the_tokens_left():
    original = SpecRequest([1, 2, 3], 10, SamplingParams(), "prompt-lookup", 4, request_id="abc", pinned=True)
    rest = Ingress._continuation(original, [7, 8, 9], attempt=1)
    assert rest.prompt_ids == [1, 2, 3, 7, 8, 9] and rest.max_tokens == 7
    assert (rest.draft, rest.window, rest.pinned, rest.params) == ("prompt-lookup", 4, True, original.params)
    assert rest.request_id == "abc-r1"
    assert original.prompt_ids == [1, 2, 3] and original.max_tokens == 10   # the original is kept as it was


def test_a_seeded_continuation_draws_from_a_new_seed_derived_from_the_requests():
    original = SpecRequest([1], 10, SamplingParams(temperature=1.0, seed=42), request_id="s")
    first, second = (Ingress._continuation(original, [5], attempt=a) for a in (1, 2))
    assert len({original.params.seed, first.params.seed, second.params.seed}) == 3
    assert first.params.seed == Ingress._continuation(original, [5], attempt=1).params.seed   # repeatable
    assert 0 <= first.params.seed < 2**63 and first.params.temperature == 1.0


# ---- the target replica's stream, as the ingress reads it -----------------------------------

SPEC = {"draft": "prompt-lookup", "steps": 2, "policy": "static"}   # as a replica builds it


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i): text the test can read."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


class Stream:
    def __init__(self, items: list[StreamItem]):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        async def items():
            for item in self.items:
                yield item
        return items()

    def cancel(self):
        self.cancelled = True


class Replicas:
    """A target deployment's handle: each ``generate`` call streams the next list of items (as if
    each went to another replica)."""

    def __init__(self, *streams: list[StreamItem]):
        self.streams, self.requests, self.opened = list(streams), [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.requests.append(request)
        self.opened.append(Stream(self.streams.pop(0)))
        return self.opened[-1]


def ingress(replicas: Replicas, resume_attempts: int = 3):
    # The class Serve wraps (no ASGI wrapper), without __init__: no tokenizer or model to load,
    # only what the stream's path reads.
    out = object.__new__(Ingress.__mro__[1])
    out.target, out.tokenizer = replicas, Letters()
    out.config = IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4, resume_attempts=resume_attempts,
                               retry_after_s=7)
    return out


def prepared() -> Prepared:
    return Prepared("abc", SpecRequest([20, 21, 22], 4, request_id="abc"), stop=[])


def test_a_failed_step_resumes_on_another_replica_and_the_spec_says_so():
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0, 1]), failed], [StreamItem([2, 3], "length", SPEC, cached_tokens=2)])
    text, ids, last = asyncio.run(ingress(replicas)._generate(prepared()))
    assert (text, ids, last.finish_reason) == ("abcd", [0, 1, 2, 3], "length")
    # The replica's summary as it came, plus the one thing only the ingress knows.
    assert last.spec == {**SPEC, "resumed": 1}
    # The continuation: the prompt plus the two tokens received, two tokens left.
    assert replicas.requests[1].prompt_ids == [20, 21, 22, 0, 1] and replicas.requests[1].max_tokens == 2
    assert last.usage["completion_tokens"] == 4 and last.usage["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_stop_string_before_the_last_item_cancels_the_replica_and_answers_an_empty_spec():
    replicas = Replicas([StreamItem([0, 1]), StreamItem([2, 3], "length", SPEC)])
    events = asyncio.run(collect(ingress(replicas)._events(Prepared("abc", prepared().spec_request, ["b"]))))
    assert [(e.text, e.finish_reason, e.spec) for e in events] == [("a", "stop", {})]
    assert replicas.opened[0].cancelled   # the replica was still going: no summary to give


def test_a_stop_string_on_the_last_item_keeps_the_replicas_spec():
    replicas = Replicas([StreamItem([0, 1]), StreamItem([2, 3], "length", SPEC)])
    events = asyncio.run(collect(ingress(replicas)._events(Prepared("abc", prepared().spec_request, ["d"]))))
    assert "".join(e.text for e in events) == "abc" and events[-1].finish_reason == "stop"
    assert events[-1].spec == SPEC and not replicas.opened[0].cancelled


def test_a_step_failure_with_no_attempts_left_is_a_503_with_retry_after_over_http_and_unavailable_over_grpc():
    replicas = Replicas([StreamItem([0]), StreamItem([], error=StepError("RuntimeError: boom"))])
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(ingress(replicas, resume_attempts=0)._generate(prepared()))
    error = raised.value
    assert error.code == "unavailable" and "StepFailed" in error.message
    response = asyncio.run(_openai_error(None, error))
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    context = GrpcContext()
    Ingress._grpc_abort(context, error)
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.metadata == [("retry-after", "7")]


class GrpcContext:
    """What ``_grpc_abort`` sets on a servicer context."""

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def set_trailing_metadata(self, metadata):
        self.metadata = metadata


async def collect(events) -> list:
    return [event async for event in events]
