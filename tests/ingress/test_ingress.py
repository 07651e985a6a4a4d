"""The ingress's stream of a request from the target deployment, read without Ray (a fake target
handle whose ``generate`` streams prepared items): a failed step resumed, a request that fails
alone answered 400, busy replicas answered 503 (HTTP and gRPC, streamed or not) or waited for
while a request resumes; then the HTTP face's error bodies and the request's preparation (the
live kill tests are in test_faults.py)."""

import asyncio
import base64
import io
import json
import threading

import grpc
import pytest
from PIL import Image
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.testclient import TestClient

from specserve.ingress.auth import ApiKeys
from specserve.ingress.config import IngressConfig
from specserve.ingress.grpc_api import GrpcFace, grpc_abort
from specserve.ingress.logprob_fields import LogprobFields
from specserve.ingress.http_api import HttpFace, _http_error, _openai_error, api
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Prepared, Preparer
from specserve.ingress.resumable import BUSY_BACKOFF_S, MAX_BUSY_BACKOFF_S, continuation
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.deployment import Ingress
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import SpecRequest, StepError, StreamItem
from specserve.replicas.step import TokenLogprob, TreeShape
from specserve.replicas.vlm import TargetText
from scripted_target import HANG, SPEC, Clock, GrpcContext, Letters, Replicas, busy, collect, prepared, streams


def test_a_continuation_is_the_prompt_plus_what_was_produced_with_the_tokens_left():
    original = SpecRequest([1, 2, 3], 10, SamplingParams(), "prompt-lookup", 4, request_id="abc", pinned=True)
    rest = continuation(original, [7, 8, 9], attempt=1)
    assert rest.prompt_ids == [1, 2, 3, 7, 8, 9] and rest.max_tokens == 7
    assert (rest.draft, rest.window, rest.pinned, rest.params) == ("prompt-lookup", 4, True, original.params)
    assert rest.request_id == "abc-r1"
    assert original.prompt_ids == [1, 2, 3] and original.max_tokens == 10   # the original is kept as it was


def test_a_seeded_continuation_draws_from_a_new_seed_derived_from_the_requests():
    original = SpecRequest([1], 10, SamplingParams(temperature=1.0, seed=42), request_id="s")
    first, second = (continuation(original, [5], attempt=a) for a in (1, 2))
    assert len({original.params.seed, first.params.seed, second.params.seed}) == 3
    assert first.params.seed == continuation(original, [5], attempt=1).params.seed   # repeatable
    assert 0 <= first.params.seed < 2**63 and first.params.temperature == 1.0


# ---- the target replica's stream, as the ingress reads it -----------------------------------

def test_a_failed_step_resumes_on_another_replica_and_the_spec_says_so():
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0, 1]), failed], [StreamItem([2, 3], "length", SPEC, cached_tokens=2)])
    last = asyncio.run(streams(replicas).answer(prepared()))
    assert (last.text, last.token_ids, last.finish_reason) == ("abcd", [0, 1, 2, 3], "length")
    # The replica's summary as it came, plus the one thing only the ingress knows.
    assert last.spec == {**SPEC, "resumed": 1}
    # The continuation: the prompt plus the two tokens received, two tokens left.
    assert replicas.requests[1].prompt_ids == [20, 21, 22, 0, 1] and replicas.requests[1].max_tokens == 2
    # ... whose processors count those two tokens as output, not as prompt.
    assert replicas.requests[1].resumed_tokens == 2
    assert last.usage["completion_tokens"] == 4 and last.usage["prompt_tokens_details"] == {"cached_tokens": 2}


def test_logprobs_reach_the_answer_in_order_across_a_resume():
    lp = [TokenLogprob(-float(i), ((i, -float(i)),)) for i in range(4)]
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0, 1], logprobs=lp[:2], prompt_logprobs=[None, TokenLogprob(-0.5)]), failed],
                        [StreamItem([2], logprobs=lp[2:3]), StreamItem([3], "length", logprobs=lp[3:])])
    asked = Prepared("abc", SpecRequest([20, 21, 22], 4, request_id="abc", logprobs=1, prompt_logprobs=1), stop=[])
    whole = asyncio.run(streams(replicas).answer(asked))
    assert whole.token_ids == [0, 1, 2, 3] and whole.logprobs == lp
    assert whole.prompt_logprobs == [None, TokenLogprob(-0.5)]
    # The continuation asks for the output's logprobs, not the prompt's again.
    assert (replicas.requests[1].logprobs, replicas.requests[1].prompt_logprobs) == (1, None)


def test_logprob_fields_are_openais_shapes():
    fields = LogprobFields(Letters())
    lps = [TokenLogprob(-0.25, ((0, -0.25), (2, -2.0))), TokenLogprob(-1.5, ((3, -0.5), (1, -1.5)))]
    chat = fields.chat([0, 1], lps)
    assert chat["content"][0] == {"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.25, "bytes": [97]}, {"token": "c", "logprob": -2.0, "bytes": [99]}]}
    legacy = fields.completion([0, 1], [None, lps[1]], offset=5)
    assert legacy == {"tokens": ["a", "b"], "token_logprobs": [None, -1.5], "top_logprobs": [None, {"d": -0.5, "b": -1.5}],
                      "text_offset": [5, 6]}


def test_a_stop_string_before_the_last_item_cancels_the_replica_and_answers_an_empty_spec():
    replicas = Replicas([StreamItem([0, 1]), StreamItem([2, 3], "length", SPEC)])
    events = asyncio.run(collect(streams(replicas).events(Prepared("abc", prepared().spec_request, ["b"]))))
    assert [(e.text, e.finish_reason, e.spec) for e in events] == [("a", "stop", {})]
    assert replicas.opened[0].cancelled   # the replica was still going: no summary to give


def test_a_stop_string_on_the_last_item_keeps_the_replicas_spec():
    replicas = Replicas([StreamItem([0, 1]), StreamItem([2, 3], "length", SPEC)])
    events = asyncio.run(collect(streams(replicas).events(Prepared("abc", prepared().spec_request, ["d"]))))
    assert "".join(e.text for e in events) == "abc" and events[-1].finish_reason == "stop"
    assert events[-1].spec == SPEC and not replicas.opened[0].cancelled


def test_a_step_failure_with_no_attempts_left_is_a_503_with_retry_after_over_http_and_unavailable_over_grpc():
    replicas = Replicas([StreamItem([0]), StreamItem([], error=StepError("RuntimeError: boom"))])
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(streams(replicas, resume_attempts=0).answer(prepared()))
    error = raised.value
    assert error.code == "unavailable" and "StepFailed" in error.message
    response = asyncio.run(_openai_error(None, error))
    assert response.status_code == 503 and response.headers["retry-after"] == "7"
    context = GrpcContext()
    grpc_abort(context, error)
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.metadata == [("retry-after", "7")]


# ---- a request that fails alone ----------------------------------------------------------------


def test_a_request_that_fails_alone_is_a_400_and_is_not_resumed():
    fault = StreamItem([], error=StepError("ValueError: its logits are not finite", request_fault=True))
    replicas = Replicas([StreamItem([0]), fault], [StreamItem([1, 2, 3], "length", SPEC)])
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(streams(replicas).answer(prepared()))
    error = raised.value
    assert (error.status, error.type, error.code) == (400, "invalid_request_error", "request_failed")
    assert "its logits are not finite" in error.message
    assert len(replicas.requests) == 1   # another replica would fail it the same way
    context = GrpcContext()
    grpc_abort(context, error)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT


# ---- busy replicas ---------------------------------------------------------------------------------


def test_busy_replicas_while_resuming_are_waited_for_and_cost_no_attempt():
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0, 1]), failed], *[busy()] * 6, [StreamItem([2, 3], "length", SPEC)])
    clock = Clock()
    last = asyncio.run(streams(replicas, resume_attempts=1, clock=clock).answer(prepared()))
    assert (last.text, last.spec["resumed"]) == ("abcd", 1)   # one attempt, spent on the failed step
    # The same continuation asked again after a doubling backoff, capped.
    assert clock.slept == [min(BUSY_BACKOFF_S * 2**k, MAX_BUSY_BACKOFF_S) for k in range(6)]
    assert {r.request_id for r in replicas.requests[1:]} == {"abc-r1"}


def test_a_continuation_no_replica_takes_within_resume_timeout_s_is_a_503():
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0]), failed], *[busy()] * 100)
    clock = Clock()
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(streams(replicas, clock=clock, resume_timeout_s=5.0).answer(prepared()))
    assert raised.value.status == 503 and raised.value.retry_after == 7
    assert clock.now == pytest.approx(5.0)   # waited out its deadline, no longer
    assert len(replicas.requests) < 100


def test_a_replica_that_dies_while_resuming_spends_an_attempt():
    failed = StreamItem([], error=StepError("RuntimeError: the model raised"))
    replicas = Replicas([StreamItem([0]), failed], [RayActorError()], [StreamItem([1], "length", SPEC)])
    with pytest.raises(OpenAIError, match="failed on 2 target replicas"):
        asyncio.run(streams(replicas, resume_attempts=1).answer(prepared()))


# ---- streams answer a status until their first piece --------------------------------------------


def http_ingress(replicas: Replicas, **config) -> HttpFace:
    target_streams = streams(replicas, **config)
    return HttpFace(target_streams.config, None, target_streams, replicas)


@pytest.mark.parametrize("before_first", [busy(), [HANG]], ids=["busy", "no-first-token"])
def test_a_stream_that_fails_before_its_first_piece_is_a_503_with_retry_after(before_first):
    face = http_ingress(Replicas(before_first), first_token_timeout_s=0.05)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(face._stream(prepared(), request, chat=True))
    response = asyncio.run(_openai_error(None, raised.value))
    assert response.status_code == 503 and response.headers["retry-after"] == "7"


def test_a_stream_that_fails_after_its_first_piece_says_so_in_band():
    fault = StreamItem([], error=StepError("ValueError: not finite", request_fault=True))
    face = http_ingress(Replicas([StreamItem([0]), fault]))
    request = CompletionRequest(model="m", prompt="hi", stream=True)

    async def answered():
        response = await face._stream(prepared(), request, chat=False)
        return response, [chunk async for chunk in response.body_iterator]

    response, chunks = asyncio.run(answered())
    assert response.status_code == 200
    assert json.loads(chunks[0][len("data: "):])["choices"][0]["text"] == "a"
    assert json.loads(chunks[1][len("data: "):])["error"]["code"] == "request_failed"
    assert chunks[-1] == "data: [DONE]\n\n"


def test_a_grpc_stream_busy_before_its_first_piece_is_unavailable_with_a_retry_after_trailer():
    class Prepare:
        async def prepare(self, _):
            return prepared()

    face = GrpcFace("m", ApiKeys(), Prepare(), streams(Replicas(busy())))
    context = GrpcContext()

    async def chunks():
        return [c async for c in face.complete_stream(pb.CompletionRequest(model="m", prompt="hi"), context)]

    with pytest.raises(OpenAIError):
        asyncio.run(chunks())
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.metadata == [("retry-after", "7")]


# ---- GET /v1/policy: whether the replicas learn together -------------------------------------------


class Answers:
    """A handle method that answers ``value`` at once."""

    def __init__(self, value):
        self.value = value

    async def remote(self):
        return self.value


class PolicyService:
    snapshot = Answers({"version": 3, "priors": []})
    status = Answers({"redis_error": None, "interval_s": 10})


def test_v1_policy_says_plainly_whether_the_replicas_learn_together():
    from specserve.cluster.config import REDIS_URL_ENV

    target_streams = streams(Replicas())
    # No Redis, so no policy service: a body (the route's 200) that says so and what to set.
    alone = asyncio.run(HttpFace(target_streams.config, None, target_streams, Replicas()).policy_snapshot())
    assert alone["cluster_learning"].startswith("off: no redis_url configured; each replica learns alone")
    assert REDIS_URL_ENV in alone["cluster_learning"] and alone["snapshot"] is None
    together = asyncio.run(HttpFace(target_streams.config, None, target_streams, Replicas(),
                                    PolicyService()).policy_snapshot())
    assert together["cluster_learning"] == "on" and together["snapshot"]["version"] == 3


# ---- the HTTP face's own errors in OpenAI's body ------------------------------------------------


def test_fastapis_own_errors_get_openais_body_with_their_status():
    request = Request({"type": "http", "method": "POST", "path": "/v1/nowhere", "headers": [], "query_string": b""})
    response = asyncio.run(_http_error(request, HTTPException(400, "There was an error parsing the body")))
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["type"] == "invalid_request_error"
    response = asyncio.run(_http_error(request, HTTPException(404)))
    assert response.status_code == 404 and "POST /v1/nowhere" in json.loads(response.body)["error"]["message"]


@pytest.fixture(scope="module")
def http():
    # The module's app, not the replica's: a body FastAPI cannot parse, or a route it does not
    # have, never reaches the ingress object the routes are bound to.
    assert Ingress is not None   # serve.ingress has bound the routes
    return TestClient(api, raise_server_exceptions=False)


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"model": "m", "max_tokens": ' + "9" * 5000 + "}"],
                         ids=["nested-deep", "5000-digits"])
def test_a_body_json_cannot_read_is_a_400_with_openais_body(http, body):
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_route_or_method_is_openais_body_with_404_or_405(http):
    missing = http.post("/v1/nowhere", json={})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Invalid URL (POST /v1/nowhere)"
    wrong = http.get("/v1/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


# ---- preparing a request ---------------------------------------------------------------------------


class Tokenizer:
    """Records the thread it tokenizes on; a token per character."""

    chat_template = None

    def __init__(self):
        self.threads = []

    def __call__(self, text, **_):
        self.threads.append(threading.get_ident())
        return {"input_ids": [ord(c) % 100 for c in text]}


def preparer(tokenizer, processor=None) -> Preparer:
    config = type("Config", (), {"max_position_embeddings": 1 << 22, "vocab_size": 100})()
    return Preparer(TargetText(tokenizer, config, processor),
                    IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4))


def test_a_requests_tokenizing_runs_off_the_event_loop():
    # On the loop, a body of max_body_bytes would stall every stream of the replica for seconds.
    tokenizer = Tokenizer()

    async def prepare():
        return threading.get_ident(), await preparer(tokenizer).prepare(CompletionRequest(model="m", prompt="x" * (1 << 20)))

    loop_thread, out = asyncio.run(prepare())
    assert len(out.spec_request.prompt_ids) == 1 << 20
    assert tokenizer.threads and loop_thread not in tokenizer.threads


def test_relaxed_acceptance_on_text_is_a_400():
    prep = preparer(Tokenizer())
    for spec in ({"acceptance": "lantern"}, {"lantern": {"delta": 0.2}}):
        with pytest.raises(OpenAIError) as caught:
            asyncio.run(prep.prepare(CompletionRequest.model_validate({"model": "m", "prompt": "hi", "spec": spec})))
        assert caught.value.status == 400 and caught.value.param == "spec.acceptance"


def test_a_request_under_a_tree_policy_gets_an_unpinned_default_tree_unless_it_names_its_speculation():
    prep = preparer(Tokenizer())

    def spec_request(spec):
        return asyncio.run(prep.prepare(CompletionRequest.model_validate(
            {"model": "m", "prompt": "hi", "max_tokens": 4, "spec": spec}))).spec_request

    adapted = spec_request({"policy": "adt-tree"})
    assert (adapted.tree, adapted.pinned, adapted.policy) == (TreeShape(4, 2, 8), False, "adt-tree")
    assert spec_request({"policy": "online"}).tree is None                       # a window policy: a chain
    assert spec_request({"policy": "sage", "window": 3}).tree is None            # a window named: a pinned chain
    named = spec_request({"policy": "sage", "tree": {"depth": 2, "top_k": 2, "budget": 4}})
    assert (named.tree, named.pinned) == (TreeShape(2, 2, 4), True)


def test_sampling_controls_reach_the_replica_with_their_token_ids_checked():
    prep = preparer(Tokenizer())
    out = asyncio.run(prep.prepare(ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.5,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_p": 0.1,
        "logit_bias": {"7": 2, "3": -1}, "min_tokens": 2, "stop_token_ids": [9], "ignore_eos": True,
        "allowed_token_ids": [9, 3, 7, 3]})))
    params = out.spec_request.params
    assert params.logit_bias == ((3, -1.0), (7, 2.0)) and params.allowed_token_ids == (3, 7, 9)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == (0.5, 0.25, 1.1, 0.1)
    assert (params.min_tokens, params.stop_token_ids, params.ignore_eos) == (2, (9,), True)
    for field, value in (("logit_bias", {"100": 1}), ("stop_token_ids", [100]), ("allowed_token_ids", [5, 100]),
                         ("min_tokens", 9)):
        with pytest.raises(OpenAIError) as raised:
            asyncio.run(prep.prepare(ChatCompletionRequest.model_validate({
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, field: value})))
        assert raised.value.param == field and raised.value.status == 400


def test_grpcs_sampling_controls_are_the_http_apis():
    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress.grpc_api import from_pb

    req = from_pb(pb.CompletionRequest(prompt="hi", presence_penalty=0.5, repetition_penalty=1.25, min_p=0.5,
                                       min_tokens=2, logit_bias={7: 2.0}, stop_token_ids=[9], ignore_eos=True,
                                       allowed_token_ids=[3, 7]), "m")
    assert (req.presence_penalty, req.repetition_penalty, req.min_p, req.min_tokens) == (0.5, 1.25, 0.5, 2)
    assert (req.logit_bias, req.stop_token_ids, req.ignore_eos, req.allowed_token_ids) == ({"7": 2.0}, [9], True, [3, 7])
    assert from_pb(pb.CompletionRequest(prompt="hi"), "m").allowed_token_ids is None
    with pytest.raises(OpenAIError) as raised:
        from_pb(pb.CompletionRequest(prompt="hi", logit_bias={7: 200.0}), "m")
    assert raised.value.param == "logit_bias"


class Counting:
    """A tokenizer that counts what it is asked to tokenize, decoding through the real one."""

    def __init__(self, real):
        self.real, self.tokenized = real, 0

    def __call__(self, text, **kwargs):
        self.tokenized += len(text)
        return self.real(text, **kwargs)

    def __len__(self):
        return len(self.real)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.reference
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "messages"])
def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(chat):
    from specserve.replicas.vlm import load_target_text

    text = load_target_text("smollm2-135m-instruct")
    tokenizer = Counting(text.tokenizer)
    prep = Preparer(TargetText(tokenizer, text.config, None),
                    IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4, max_model_len=2048))
    big = "lighthouse " * ((4 << 20) // 11)           # ~4 MiB: hundreds of thousands of tokens
    request = (ChatCompletionRequest(model="m", messages=[{"role": "user", "content": big}]) if chat
               else CompletionRequest(model="m", prompt=big))
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(prep.prepare(request))
    assert raised.value.code == "context_length_exceeded" and "at least" in raised.value.message
    assert tokenizer.tokenized == 0
    # A prompt that fits is tokenized as before (the bound refuses only what cannot fit).
    fits = asyncio.run(prep.prepare(CompletionRequest(model="m", prompt="lighthouse " * 100)))
    assert len(fits.spec_request.prompt_ids) == len(text.tokenizer("lighthouse " * 100)["input_ids"])


def test_the_model_name_is_checked_before_any_picture_is_decoded():
    picture = io.BytesIO()
    Image.new("RGB", (4, 4)).save(picture, "PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    request = ChatCompletionRequest(model="other", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}])

    class Unusable:   # a processor that fails the test if a picture reaches it
        def __getattr__(self, name):
            raise AssertionError(f"the picture was prepared ({name}) before the model name was checked")

    prep = object.__new__(Preparer)
    prep.model_id, prep.processor = "m", Unusable()
    with pytest.raises(OpenAIError) as raised:
        asyncio.run(prep.prepare(request))
    assert raised.value.status == 404 and raised.value.code == "model_not_found"


def test_the_routes_annotations_are_objects_a_replica_can_read():
    # Serve's copy of the deployment class on a replica keeps only the globals its code uses: a
    # body's model named in a string annotation would not resolve there (a 400 for every body).
    cls = Ingress.func_or_class
    for name in ("completions", "chat_completions", "routing_recent", "Complete", "CompleteStream"):
        assert not any(isinstance(a, str) for a in getattr(cls, name).__annotations__.values()), name


def test_a_request_that_fetches_pictures_prepares_on_the_fetch_pool(monkeypatch):
    # Slow picture servers must not hold the threads every other request tokenizes on.
    from specserve.ingress import prepare as prepare_module
    from specserve.ingress.images import ImageLimits

    seen = []

    def decode(parts, limits, deadline=None):
        seen.append((threading.current_thread().name, deadline))
        raise OpenAIError("stop here", code="invalid_image")

    monkeypatch.setattr(prepare_module, "decode_media", decode)
    prep = object.__new__(Preparer)
    prep.model_id, prep.processor = "m", object()
    prep.config = IngressConfig("t", "m", [], "none", 0, images=ImageLimits(allow_image_urls=True))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, {"type": "text", "text": "?"}]}])
    with pytest.raises(OpenAIError, match="stop here"):
        asyncio.run(prep.prepare(request))
    (thread, deadline), = seen
    assert thread.startswith("image-fetch") and deadline is not None
