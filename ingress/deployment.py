"""The ingress deployment: OpenAI-compatible HTTP and gRPC in, a target replica's token stream out.

Everything a client sends is checked here (schema, model name, draft name, context length)
before any replica sees it, so a bad request costs one answer and nothing else: HTTP 400 with
OpenAI's error body, or gRPC ``INVALID_ARGUMENT``. Both protocols share one path:

    body --(pydantic)--> _prepare --> SpecRequest --> target.generate (stream) --> TextStream --> events

HTTP formats the events as OpenAI JSON or Server-Sent Events; gRPC as protobuf messages.

What the ingress does when things break (docs/design.md §7):
- a target replica that dies mid-generation (or whose step fails) does not end the request: it
  resumes on a target replica from the tokens already produced (the prompt plus those tokens is
  the new prompt, the tokens left the new ``max_tokens``), so a stream continues where it stopped;
  greedy output is unchanged, a sampled one keeps the target's distribution (the continuation
  draws from a fresh seed derived from the request's). If no replica takes the continuation
  within ``resume_timeout_s`` (or a new request gets no first token within ``first_token_timeout_s``:
  a target deployment without a running replica) the request ends with a retriable error
  (503 + ``Retry-After``, gRPC ``UNAVAILABLE``) instead of hanging; every other call to another
  deployment is bounded by ``call_timeout_s``;
- a full target (Serve's ``max_queued_requests`` reached) is a 503 with ``Retry-After`` at once,
  not an unbounded queue;
- with API keys configured (``ingress/auth.py``) every route but ``/health`` needs one (401 /
  ``UNAUTHENTICATED``); bodies over ``max_body_bytes`` are a 413 before anything parses them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from specserve.policies.registry import POLICIES
import torch

from specserve.replicas.image_tokens import picture_ids
from specserve.replicas.model_store import load_tokenizer_and_config
from specserve.replicas.vlm import (image_prompt_ids, image_token_id, is_vlm_config, load_processor, picture_markers,
                                    pixel_preparer, tokens_per_image)
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.openai_api import AUTO_DRAFT, NO_DRAFT, ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.replicas.prompt_ids import encode_chat, encode_text
from specserve.replicas.request import SpecRequest, StreamItem
from specserve.ingress import guard
from specserve.ingress.auth import ApiKeys
from specserve.ingress.guard import Guard
from specserve.ingress.images import ImageLimits, decode_image
from specserve.ingress.text_stream import TextStream

logger = logging.getLogger("ray.serve")

api = FastAPI(title="specserve", description="Speculative-decoding LLM serving, OpenAI-compatible.")


@dataclass(frozen=True)
class IngressConfig:
    """What the ingress needs of the application's configuration (``cluster.config.AppConfig``)."""

    target: str
    model_id: str
    draft_names: list[str]
    default_draft: str
    default_window: int
    api_keys_file: str | None = None     # besides SPECSERVE_API_KEYS in the ingress's environment
    max_model_len: int | None = None     # prompt + completion at most (default: the model's context)
    max_body_bytes: int = 4 << 20
    stream_interval: int = 1             # tokens per streamed piece at least (the first piece excepted)
    resume_attempts: int = 3             # continuations of one request after its target replica failed
    resume_timeout_s: float = 60.0       # how long a continuation may wait for a replica to take it
    # How long a new request may wait for its first token (queued, admitted, prefilled): a target
    # deployment with no running replica must not hold a client forever.
    first_token_timeout_s: float = 120.0
    call_timeout_s: float = 10.0         # any other call to another deployment (policy service, routes)
    retry_after_s: int = 5               # what a 503 tells the client to wait
    # draft -> where it runs and why ({"where", "reason", "figures"}, ``cluster/placement.py``)
    placement: dict[str, dict] = field(default_factory=dict)
    images: ImageLimits = field(default_factory=ImageLimits)   # a VLM target's pictures


@dataclass
class Prepared:
    """A checked request, ready for a target replica."""

    id: str
    spec_request: SpecRequest
    stop: list[str]


@dataclass
class Event:
    """A piece of a generation: new text, and on the last piece why it ended and what speculation did."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    spec: dict | None = None
    usage: dict = field(default_factory=dict)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}): send a JSON object", None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the body must be a JSON object (Content-Type: application/json) with the request's fields", None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


@api.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


@api.exception_handler(RequestValidationError)
async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
    # FastAPI's default is 422 with its own body; OpenAI clients expect 400 with theirs.
    message, param = _validation_message(err.errors())
    return JSONResponse(OpenAIError(message, param=param).body(), status_code=400)


@api.exception_handler(Exception)
async def _unexpected(_: Request, err: Exception) -> JSONResponse:
    # A bug, not the client's fault; still an OpenAI body, and the replica lives on.
    logger.exception("unexpected error")
    body = OpenAIError(f"internal error: {type(err).__name__}: {err}", status=500, type="server_error",
                       code="internal_error").body()
    return JSONResponse(body, status_code=500)


_GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
               429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
               504: grpc.StatusCode.DEADLINE_EXCEEDED}


class StepFailed(RuntimeError):
    """A target replica failed a request mid-stream: its step failed (an item with a
    ``StepError``) or its stream ended without a last item. The request resumes elsewhere from
    the tokens it has."""


# Tokens per piece of a non-streamed answer (with no stop strings): few messages, and a
# continuation after a replica failure recomputes at most this many.
WHOLE_ANSWER_INTERVAL = 64
# A target replica that died (or is being replaced) under a request, or whose step failed: the
# request continues elsewhere from what it has produced.
_RESUMABLE = (RayActorError, StepFailed)
# No target replica can take a request right now (all full, or none running): retry shortly.
_BUSY = (BackPressureError, DeploymentUnavailableError)


# Every HTTP route passes the API key and body-size checks first (ingress/guard.py).
api.add_middleware(Guard)



def _pb_content(message: pb.ChatMessage) -> str | list[dict]:
    """A gRPC message's content as the HTTP API's: with pictures (raw file bytes), image parts
    first (as data URLs, so both APIs check them one way), then the text."""
    if not message.images:
        return message.content
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": "data:image;base64," + base64.b64encode(b).decode()}}
                         for b in message.images]
    return [*parts, {"type": "text", "text": message.content}]


def _usage_pb(usage: dict) -> pb.Usage:
    """The gRPC Usage of an OpenAI usage object (the proto has the three counts, not the details)."""
    return pb.Usage(**{k: v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")})

@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256, health_check_period_s=10)
@serve.ingress(api)
class Ingress:
    def __init__(self, target: DeploymentHandle, config: IngressConfig, policy: DeploymentHandle | None = None):
        """``policy``: the policy service, when the application shares statistics through Redis."""
        self.target = target
        self.policy = policy
        self.config = config
        self.tokenizer, model_config = load_tokenizer_and_config(config.target)
        # A VLM's pictures are prepared here, as its processor does, and named by their pixels
        # (``image_tokens``): the prefix-affinity router and the replicas' caches key on them.
        self.processor = load_processor(config.target) if is_vlm_config(model_config) else None
        self.prepare_pixels = None if self.processor is None else pixel_preparer(self.processor.image_processor)
        if self.processor is not None:
            self.tokens_per_image = tokens_per_image(model_config, self.processor.image_processor)
            self.image_placeholder = image_token_id(model_config)
            self.picture_markers = picture_markers(self.processor)
        model_config = getattr(model_config, "text_config", None) or model_config
        self.max_context = getattr(model_config, "max_position_embeddings", None)
        if config.max_model_len is not None:
            self.max_context = min(self.max_context or config.max_model_len, config.max_model_len)
        self.vocab_size = getattr(model_config, "vocab_size", None)
        self.model_id = config.model_id
        self.created = int(time.time())
        self.api_keys = ApiKeys.load(config.api_keys_file)
        guard.configure(self.api_keys, config.max_body_bytes)
        logger.info("ingress for %s: API keys %s", self.model_id,
                    f"required ({len(self.api_keys)} configured)" if self.api_keys.enabled else "off")

    # ---- the shared path -------------------------------------------------------------------

    async def _pictures(self, req: CompletionRequest | ChatCompletionRequest) -> list[torch.Tensor]:
        """The request's pictures, decoded and prepared (off the event loop: a large one takes
        tens of milliseconds), in prompt order; 400 for a text-only target or a bad picture."""
        urls = [url for m in req.messages for url in m.image_urls()] if isinstance(req, ChatCompletionRequest) else []
        if not urls:
            return []
        if self.processor is None:
            raise OpenAIError(f"`{self.model_id}` reads text only: drop the image_url parts, or serve a "
                              "vision-language target", param="messages", code="images_not_supported")
        limits = self.config.images
        if len(urls) > limits.max_images:
            raise OpenAIError(f"{len(urls)} images in one request; this server takes at most {limits.max_images}",
                              param="messages", code="too_many_images")

        def prepare() -> list[torch.Tensor]:
            return [self.prepare_pixels(decode_image(url, limits)) for url in urls]

        return await asyncio.to_thread(prepare)

    def _prepare(self, req: CompletionRequest | ChatCompletionRequest, pixels: list | None = None) -> Prepared:
        if req.model != self.model_id:
            raise OpenAIError(f"The model `{req.model}` does not exist; this server serves `{self.model_id}`.",
                              status=404, param="model", code="model_not_found")
        pixels = pixels or []
        prompt_ids = self._prompt_ids(req, pixels)
        is_chat = isinstance(req, ChatCompletionRequest)
        max_tokens = req.token_limit if is_chat else req.max_tokens
        if self.max_context:
            room = self.max_context - len(prompt_ids)
            if room < 1 or (max_tokens is not None and max_tokens > room):
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                    f"{len(prompt_ids) + (max_tokens or 1)} tokens ({len(prompt_ids)} in the prompt, "
                    f"{max_tokens or 1} for the completion). Shorten the prompt or lower max_tokens.",
                    param="max_tokens" if room >= 1 else ("messages" if is_chat else "prompt"),
                    code="context_length_exceeded",
                )
            max_tokens = max_tokens or room
        spec = req.spec
        # "auto" goes to the target replica as it is: its draft router chooses after the prefill
        # (or, with the router off, the configured default draft).
        draft = spec.draft if spec and spec.draft else AUTO_DRAFT
        if draft not in (AUTO_DRAFT, NO_DRAFT, *self.config.draft_names):
            raise OpenAIError(f"unknown draft {draft!r}; available: {', '.join([AUTO_DRAFT, NO_DRAFT, *self.config.draft_names])}",
                              param="spec.draft", code="draft_not_found")
        policy = spec.policy if spec else None
        if policy is not None and policy not in POLICIES:
            raise OpenAIError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}",
                              param="spec.policy", code="policy_not_found")
        window = spec.window if spec and spec.window is not None else self.config.default_window
        tree = TreeShape(spec.tree.depth, spec.tree.top_k, spec.tree.budget) if spec and spec.tree else None
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed)
        request_id = uuid.uuid4().hex
        return Prepared(
            id=request_id,
            spec_request=SpecRequest(prompt_ids, max_tokens or 16, params, draft, window, tree, request_id=request_id,
                                     pinned=bool(spec and (spec.window is not None or spec.tree is not None)),
                                     policy=policy, stream_interval=self.config.stream_interval,
                                     cache_salt=req.cache_salt, images=tuple(pixels),
                                     image_placeholder=self.image_placeholder if pixels else None),
            stop=req.stop,
        )

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest, pixels: list) -> list[int]:
        if isinstance(req, ChatCompletionRequest):
            if not pixels and not any(m.text().strip() for m in req.messages):
                raise OpenAIError("messages: every message is empty; give some text", param="messages")
            if not pixels:
                return encode_chat(self.tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages])
            text = self.processor.apply_chat_template(
                [{"role": m.role, "content": m.template_content()} for m in req.messages], tokenize=False,
                add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            try:
                return image_prompt_ids(ids, pixels, lambda p: picture_ids(p, self.tokens_per_image),
                                        self.image_placeholder, self.picture_markers)
            except ValueError as err:
                raise OpenAIError(str(err), param="messages") from err
        if isinstance(req.prompt, str):
            if not req.prompt.strip():
                raise OpenAIError("prompt: the prompt is empty; give some text", param="prompt")
            return encode_text(self.tokenizer, req.prompt)
        if not req.prompt:
            raise OpenAIError("prompt: the list of token ids is empty", param="prompt")
        bad = [t for t in req.prompt if not 0 <= t < (self.vocab_size or 2**31)]
        if bad:
            raise OpenAIError(f"prompt: token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return list(req.prompt)

    def _unavailable(self, why: str) -> OpenAIError:
        return OpenAIError(f"{why}; retry in {self.config.retry_after_s} s", status=503, type="server_error",
                           code="unavailable", retry_after=self.config.retry_after_s)

    async def _events(self, prepared: Prepared) -> AsyncIterator[Event]:
        text = TextStream(self.tokenizer, prepared.stop)
        prompt_tokens = len(prepared.spec_request.prompt_ids)
        request, resumed = prepared.spec_request, 0
        # By when the next item must come: the first token's deadline, then none while tokens
        # flow, then a continuation's (set at its first failure, kept through the ones after).
        deadline: float | None = time.monotonic() + self.config.first_token_timeout_s
        continuing = False   # ``deadline`` is a continuation's
        while True:
            # _by_reference=False: the stream's items come over gRPC, not through Ray's object store:
            # each item is a message, and the ingress spent a fifth of a core relaying 16 streams.
            stream = self.target.options(stream=True, _by_reference=False).generate.remote(request)
            try:
                async for item in self._items(stream, deadline):
                    if item.error is not None:
                        raise StepFailed(f"the target's step failed: {item.error.message}")
                    deadline, continuing = None, False
                    delta = text.push(item.token_ids)
                    finish, spec = item.finish_reason, item.spec
                    if text.stopped:
                        finish = "stop"
                        if not item.last:   # ended early by a stop string: the target is still going
                            stream.cancel()
                            spec = {}
                    elif finish is not None:
                        delta += text.flush()
                    if finish is not None and resumed:
                        spec = {**(spec or {}), "resumed": resumed}
                    if delta or finish is not None:
                        usage = {}
                        if finish is not None:
                            done = len(text.token_ids)
                            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                                     "total_tokens": prompt_tokens + done,
                                     # OpenAI's field: prompt tokens whose KV the replica already held.
                                     "prompt_tokens_details": {"cached_tokens": min(prompt_tokens, item.cached_tokens)}}
                        yield Event(delta, item.token_ids, finish, spec, usage)
                    if finish is not None:
                        return
                # The stream ended without a last item: the replica went away between two items.
                err: BaseException = StepFailed("the target's stream ended early")
            except _RESUMABLE as caught:
                err = caught
            except _BUSY as caught:
                if not resumed:   # not taken at all: the client retries
                    raise self._unavailable(f"every target replica is busy or restarting ({type(caught).__name__})") from caught
                err = caught           # a continuation waits (until its deadline) for a replica
            stream.cancel()
            if resumed >= self.config.resume_attempts:
                raise self._unavailable(f"the request failed on {resumed + 1} target replicas ({type(err).__name__})") from err
            resumed += 1
            done = len(text.token_ids)
            if done >= prepared.spec_request.max_tokens:   # it failed after its last token
                text_tail = text.flush()
                yield Event(text_tail, [], "length", {"resumed": resumed},
                            {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done})
                return
            logger.warning("request %s: its target replica failed after %d tokens (%s: %s); resuming (attempt %d)",
                           prepared.id, done, type(err).__name__, err, resumed)
            request = self._continuation(prepared.spec_request, text.token_ids, resumed)
            if not continuing:
                deadline, continuing = time.monotonic() + self.config.resume_timeout_s, True
            if isinstance(err, _BUSY):
                await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    @staticmethod
    def _continuation(original: SpecRequest, produced: list[int], attempt: int) -> SpecRequest:
        """The rest of ``original`` after ``produced``: the target recomputes the KV of the prompt
        and those tokens (greedy output is the same token for token). A seeded sampled request
        draws its continuation from a seed derived from its own, so it does not replay the random
        numbers its first tokens used."""
        params = original.params
        if params.seed is not None:
            params = replace(params, seed=(params.seed + attempt * 0x9E3779B97F4A7C15) % 2**63)
        return replace(original, prompt_ids=[*original.prompt_ids, *produced],
                       max_tokens=original.max_tokens - len(produced), params=params,
                       request_id=f"{original.request_id}-r{attempt}")

    async def _items(self, stream, deadline: float | None) -> AsyncIterator[StreamItem]:
        """The stream's items; the first one within ``deadline`` (a request or its continuation must
        be answered by a replica in time, or it ends with a retriable error instead of hanging)."""
        iterator = stream.__aiter__()
        if deadline is not None:
            try:
                first = await asyncio.wait_for(iterator.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                stream.cancel()
                raise self._unavailable("no target replica answered in time") from None
            yield first
        async for item in iterator:
            yield item

    async def _generate(self, prepared: Prepared) -> tuple[str, list[int], Event]:
        """The whole answer at once: the target sends its tokens in large pieces (each piece is a
        message; a continuation after a replica failure starts from the last piece received)."""
        if not prepared.stop:   # stop strings are found in the text as it comes: keep pieces small then
            prepared = replace(prepared, spec_request=replace(prepared.spec_request, stream_interval=WHOLE_ANSWER_INTERVAL))
        pieces, ids, last = [], [], None
        async for event in self._events(prepared):
            pieces.append(event.text)
            ids.extend(event.token_ids)
            last = event
        return "".join(pieces), ids, last

    # ---- HTTP ------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "specserve",
            "max_model_len": self.max_context, "drafts": self.config.draft_names, "policies": list(POLICIES),
            "input_modalities": ["text", "image"] if self.processor is not None else ["text"],
            "placement": self.config.placement,
        }]}

    @api.get("/v1/policy")
    async def policy_snapshot(self) -> dict:
        """The cluster priors new requests start from (the policy service's latest snapshot)."""
        if self.policy is None:
            raise OpenAIError("this deployment has no policy service: give the application a redis_url",
                              status=404, code="policy_service_not_configured")
        try:
            snapshot, status = await asyncio.wait_for(
                asyncio.gather(self.policy.snapshot.remote(), self.policy.status.remote()), self.config.call_timeout_s)
        except Exception as err:  # noqa: BLE001 - the service is down: say so, do not fail the ingress
            raise OpenAIError(f"the policy service is not answering ({type(err).__name__}); retry shortly",
                              status=503, type="server_error", code="policy_service_unavailable") from err
        return {"object": "policy_snapshot", "snapshot": snapshot, "service": status}

    @api.get("/v1/routing/recent")
    async def routing_recent(self, limit: int = Query(50, ge=1, le=1000)) -> dict:
        """The draft router's latest decisions with their features and outcomes: the whole
        cluster's (the Redis stream, through the policy service) when there is one, else one
        target replica's own."""
        source, routes = "cluster", None
        if self.policy is not None:
            try:
                routes = await asyncio.wait_for(self.policy.recent_routes.remote(limit), self.config.call_timeout_s)
            except Exception:  # noqa: BLE001 - fall back to a replica's own view
                routes = None
        if routes is None:
            source = "replica"
            try:
                routes = await asyncio.wait_for(self.target.recent_routes.remote(limit), self.config.call_timeout_s)
            except Exception as err:  # noqa: BLE001
                raise OpenAIError(f"no target replica is answering ({type(err).__name__}); retry shortly",
                                  status=503, type="server_error", code="target_unavailable") from err
        return {"object": "list", "source": source, "data": routes}

    @api.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        prepared = self._prepare(req)
        if req.stream:
            return self._sse(prepared, req, chat=False)
        text, ids, last = await self._generate(prepared)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = ids
        return {
            "id": f"cmpl-{prepared.id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_id, "choices": [choice], "usage": last.usage, "spec": last.spec,
        }

    @api.post("/v1/chat/completions")
    async def chat_completions(self, req: ChatCompletionRequest):
        prepared = self._prepare(req, await self._pictures(req))
        if req.stream:
            return self._sse(prepared, req, chat=True)
        text, ids, last = await self._generate(prepared)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": last.finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = ids
        return {
            "id": f"chatcmpl-{prepared.id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id, "choices": [choice], "usage": last.usage, "spec": last.spec,
        }

    def _sse(self, prepared: Prepared, req, chat: bool) -> StreamingResponse:
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{prepared.id}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def choice(text: str | None, finish: str | None, role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def body() -> AsyncIterator[str]:
            try:
                if chat:
                    yield sse({**base, "choices": [choice(None, None, role=True)]})
                async for event in self._events(prepared):
                    chunk = {**base, "choices": [choice(event.text, event.finish_reason)]}
                    if req.return_token_ids:   # vLLM's extension: each chunk's new token ids
                        chunk["choices"][0]["token_ids"] = event.token_ids
                    if event.finish_reason is not None:
                        chunk["spec"] = event.spec
                    yield sse(chunk)
                    if event.finish_reason is not None and include_usage:
                        yield sse({**base, "choices": [], "usage": event.usage})
            except OpenAIError as err:
                yield sse(err.body())
            except Exception as err:  # noqa: BLE001 - the stream already said 200; say what broke in-band
                logger.exception("stream %s failed", prepared.id)
                yield sse(OpenAIError(f"generation failed: {type(err).__name__}: {err}", status=500,
                                      type="server_error", code="internal_error").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    # ---- gRPC (method names are the RPC names of specserve.proto) ------------------------------

    def _from_pb(self, request: pb.CompletionRequest) -> CompletionRequest | ChatCompletionRequest:
        # gRPC has no model listing: an empty model means the one this server serves.
        body: dict = {"model": request.model or self.model_id, "stop": list(request.stop) or None}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        if request.HasField("spec"):
            spec: dict = {}
            if request.spec.draft:
                spec["draft"] = request.spec.draft
            if request.spec.HasField("window"):
                spec["window"] = request.spec.window
            if request.spec.HasField("tree"):
                tree = request.spec.tree
                spec["tree"] = {"depth": tree.depth, "top_k": tree.top_k, "budget": tree.budget}
            if request.spec.policy:
                spec["policy"] = request.spec.policy
            body["spec"] = spec
        if request.HasField("max_tokens"):
            body["max_tokens"] = request.max_tokens
        try:
            if request.messages:
                if request.prompt:
                    raise OpenAIError("give either prompt or messages, not both", param="prompt")
                body["messages"] = [{"role": m.role, "content": _pb_content(m)} for m in request.messages]
                return ChatCompletionRequest.model_validate(body)
            body["prompt"] = request.prompt
            return CompletionRequest.model_validate(body)
        except ValidationError as err:
            message, param = _validation_message(err.errors())
            raise OpenAIError(message, param=param) from err

    @staticmethod
    def _spec_pb(spec: dict | None) -> pb.SpecSummary:
        spec = spec or {}
        router = spec.get("router")
        decision = None if router is None else pb.RouterDecision(
            choice=router["choice"], reason=router["reason"], predicted_alpha=router.get("predicted_alpha", {}),
            switched_to=[s["to"] for s in router.get("switches", ())])
        return pb.SpecSummary(draft=spec.get("draft", ""), steps=spec.get("steps", 0),
                              mean_accepted_len=spec.get("mean_accepted_len", 0.0),
                              acceptance_rate=spec.get("acceptance_rate", 0.0), windows=spec.get("windows", []),
                              router=decision)

    @staticmethod
    def _grpc_abort(grpc_context, err: OpenAIError) -> None:
        grpc_context.set_code(_GRPC_CODES.get(err.status, grpc.StatusCode.INTERNAL))
        grpc_context.set_details(err.message)
        if err.retry_after is not None:
            grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after))])

    async def _grpc_prepare(self, request: pb.CompletionRequest, grpc_context) -> Prepared:
        if self.api_keys.enabled and not self.api_keys.allows_metadata(grpc_context.invocation_metadata()):
            raise OpenAIError("missing or invalid API key: send metadata `authorization: Bearer <key>`",
                              status=401, code="invalid_api_key")
        req = self._from_pb(request)
        return self._prepare(req, await self._pictures(req))

    async def Complete(self, request: pb.CompletionRequest, grpc_context) -> pb.CompletionResponse:
        try:
            prepared = await self._grpc_prepare(request, grpc_context)
            text, ids, last = await self._generate(prepared)
        except OpenAIError as err:
            self._grpc_abort(grpc_context, err)
            return pb.CompletionResponse()
        return pb.CompletionResponse(
            id=prepared.id, model=self.model_id, text=text, token_ids=ids, finish_reason=last.finish_reason,
            usage=_usage_pb(last.usage), spec=self._spec_pb(last.spec),
        )

    async def CompleteStream(self, request: pb.CompletionRequest, grpc_context) -> AsyncIterator[pb.CompletionChunk]:
        try:
            prepared = await self._grpc_prepare(request, grpc_context)
            async for event in self._events(prepared):
                chunk = pb.CompletionChunk(id=prepared.id, text=event.text, token_ids=event.token_ids)
                if event.finish_reason is not None:
                    chunk.finish_reason = event.finish_reason
                    chunk.usage.CopyFrom(_usage_pb(event.usage))
                    chunk.spec.CopyFrom(self._spec_pb(event.spec))
                yield chunk
        except OpenAIError as err:
            # Ray Serve's proxy sends the status set on the context when the generator raises.
            self._grpc_abort(grpc_context, err)
            raise
