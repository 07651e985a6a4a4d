"""The ingress's gRPC face (``specserve.proto``'s ``SpecServe``): protobuf in and out at the edge,
the HTTP API's request types and path in between.

A request becomes the HTTP API's body (``from_pb``) and is checked as one; an ``OpenAIError``
becomes a status (``GRPC_CODES``: 400 ``INVALID_ARGUMENT``, 404 ``NOT_FOUND``, 503 ``UNAVAILABLE``
with a ``retry-after`` trailer, ...). ``CompleteStream`` sends nothing before its first piece,
so a failure before then is a status as ``Complete``'s is.

Serve's gRPC proxy calls the ``Ingress`` deployment's method of the RPC's name, which calls ``GrpcFace``.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.auth import ApiKeys
from specserve.ingress.choices import answers, best, choice_requests, merged, total_usage
from specserve.ingress.image_generation import ImageGenerationRequest, PictureFace
from specserve.ingress.logprob_fields import LogprobFields
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Prepared, Preparer, validation_message
from specserve.ingress.resumable import TargetStreams
from specserve.ingress.tools import ToolCallStream, tool_answer

GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
              504: grpc.StatusCode.DEADLINE_EXCEEDED}


def _data_url(data: bytes) -> str:
    return "data:image;base64," + base64.b64encode(data).decode()


def pb_content(message: pb.ChatMessage) -> str | list[dict]:
    """A gRPC message's content as the HTTP API's: with pictures and clips (raw file bytes), image
    parts first, then video parts (as data URLs, so both APIs check them one way), then the text."""
    if not message.images and not message.videos:
        return message.content
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": _data_url(b)}} for b in message.images]
    for video in message.videos:
        source = {"frames": [_data_url(b) for b in video.frames]} if video.frames else {"url": _data_url(video.clip)}
        if video.HasField("fps"):
            source["fps"] = video.fps
        parts.append({"type": "video_url", "video_url": source})
    return [*parts, {"type": "text", "text": message.content}]


def _schema(text: str) -> dict:
    try:
        return json.loads(text)
    except ValueError as err:
        raise OpenAIError(f"tools: parameters_json is not JSON ({err})", param="tools") from None


def pb_message(message: pb.ChatMessage) -> dict:
    """A gRPC chat message as the HTTP API's."""
    out: dict = {"role": message.role, "content": pb_content(message)}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
        out["content"] = out["content"] or None
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def tool_calls_pb(calls: list[dict]) -> list[pb.ToolCall]:
    return [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]) for c in calls]


def from_pb(request: pb.CompletionRequest, model_id: str) -> CompletionRequest | ChatCompletionRequest:
    """The HTTP API's request for a gRPC one (checked by pydantic as a body is)."""
    # gRPC has no model listing: an empty model means the one this server serves.
    body: dict = {"model": request.model or model_id, "stop": list(request.stop) or None}
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p", "min_tokens"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in request.logit_bias.items()}
    for name in ("stop_token_ids", "allowed_token_ids"):
        if getattr(request, name):
            body[name] = list(getattr(request, name))
    if request.ignore_eos:
        body["ignore_eos"] = True
    if request.HasField("logprobs"):
        if request.messages:
            body.update(logprobs=True, top_logprobs=request.logprobs)
        else:
            body["logprobs"] = request.logprobs
    if request.HasField("structured_output"):
        kind = request.structured_output.WhichOneof("constraint")
        value = getattr(request.structured_output, kind) if kind else None
        body["structured_outputs"] = {"json": value} if kind == "json_schema" else (
            {"choice": list(value.choices)} if kind == "choice" else {kind: value} if kind else {})
    if request.echo:
        if request.messages:
            raise OpenAIError("echo is for a prompt request, not messages", param="echo")
        body["echo"] = True
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
        spec.update(_relaxation(request.spec))
        body["spec"] = spec
    for name in ("n", "best_of"):
        if request.HasField(name):
            if name == "best_of" and request.messages:
                raise OpenAIError("best_of is for a prompt request, not messages", param="best_of")
            body[name] = getattr(request, name)
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            **({"parameters": _schema(t.parameters_json)} if t.parameters_json else {})}} for t in request.tools]
    if request.tool_choice:
        body["tool_choice"] = request.tool_choice if request.tool_choice in ("none", "auto", "required") else {
            "type": "function", "function": {"name": request.tool_choice}}
    if request.HasField("max_tokens"):
        body["max_tokens"] = request.max_tokens
    try:
        if request.messages:
            if request.prompt:
                raise OpenAIError("give either prompt or messages, not both", param="prompt")
            body["messages"] = [pb_message(m) for m in request.messages]
            return ChatCompletionRequest.model_validate(body)
        body["prompt"] = request.prompt
        return CompletionRequest.model_validate(body)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise OpenAIError(message, param=param) from err


def _relaxation(spec: pb.SpecOptions) -> dict:
    """SpecOptions' acceptance fields as the HTTP body's (none set: none)."""
    out: dict = {}
    if spec.acceptance:
        out["acceptance"] = spec.acceptance
    if spec.HasField("lantern"):
        out["lantern"] = {name: getattr(spec.lantern, name) for name in ("delta", "k") if spec.lantern.HasField(name)}
    return out


def image_request_from_pb(request: pb.ImageRequest) -> ImageGenerationRequest:
    """The gRPC ImageRequest as the HTTP body, checked by the same schema."""
    body: dict = {"prompt": request.prompt}
    if request.model:
        body["model"] = request.model
    if request.size:
        body["size"] = request.size
    for name in ("n", "seed", "temperature", "top_k", "cfg_scale"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.HasField("spec"):
        spec = {"draft": request.spec.draft or None, "policy": request.spec.policy or None}
        if request.spec.HasField("window"):
            spec["window"] = request.spec.window
        if request.spec.HasField("tree"):
            tree = request.spec.tree
            spec["tree"] = {"depth": tree.depth, "top_k": tree.top_k, "budget": tree.budget}
        spec.update(_relaxation(request.spec))
        body["spec"] = {k: v for k, v in spec.items() if v is not None}
    try:
        return ImageGenerationRequest.model_validate(body)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise OpenAIError(message, param=param) from err


def logprobs_pb(fields: LogprobFields, token_ids: list[int], logprobs: list | None) -> list[pb.TokenLogprob]:
    """The gRPC TokenLogprobs of ``token_ids`` (None: not asked, none)."""
    if logprobs is None:
        return []
    return [pb.TokenLogprob(token_id=t, token=fields.token(t), logprob=None if lp is None else lp.logprob,
                            top_logprobs=[] if lp is None else [pb.TopLogprob(token_id=i, token=fields.token(i), logprob=v)
                                                                for i, v in lp.top])
            for t, lp in zip(token_ids, logprobs)]


def usage_pb(usage: dict) -> pb.Usage:
    """The gRPC Usage of an OpenAI usage object (the proto has the three counts, not the details)."""
    return pb.Usage(**{k: v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens", "total_tokens")})


def spec_pb(spec: dict | None) -> pb.SpecSummary:
    spec = spec or {}
    router = spec.get("router")
    decision = None if router is None else pb.RouterDecision(
        choice=router["choice"], reason=router["reason"], predicted_alpha=router.get("predicted_alpha", {}),
        switched_to=[s["to"] for s in router.get("switches", ())])
    relaxed = spec.get("acceptance")
    return pb.SpecSummary(draft=spec.get("draft", ""), steps=spec.get("steps", 0),
                          mean_accepted_len=spec.get("mean_accepted_len", 0.0),
                          acceptance_rate=spec.get("acceptance_rate", 0.0), windows=spec.get("windows", []),
                          router=decision, acceptance=relaxed and pb.Relaxation(**relaxed))


def grpc_abort(grpc_context, err: OpenAIError) -> None:
    """Set ``err`` as the call's status (Serve's proxy sends what is set on the context)."""
    grpc_context.set_code(GRPC_CODES.get(err.status, grpc.StatusCode.INTERNAL))
    grpc_context.set_details(err.message)
    if err.retry_after is not None:
        grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after))])


class GrpcFace:
    """What ``SpecServe``'s RPCs answer (the ``Ingress`` deployment's methods of those names call these)."""

    def __init__(self, model_id: str, api_keys: ApiKeys, preparer: Preparer | None, streams: TargetStreams,
                 pictures: PictureFace | None = None):
        self.model_id, self.api_keys, self.preparer, self.streams = model_id, api_keys, preparer, streams
        self.pictures = pictures

    @functools.cached_property
    def logprob_fields(self) -> LogprobFields:
        return LogprobFields(self.preparer.tokenizer)

    def _logprobs(self, prepared: Prepared, event, first: bool) -> dict:
        """The response's or chunk's logprobs fields for ``event`` (the prompt's on the first)."""
        asked = prepared.spec_request
        if asked.logprobs is None:
            return {}
        out = {"logprobs": logprobs_pb(self.logprob_fields, event.token_ids, event.logprobs or [])}
        if first and asked.prompt_logprobs is not None:
            out["prompt_logprobs"] = logprobs_pb(self.logprob_fields, asked.prompt_ids,
                                                 event.prompt_logprobs or [None] * len(asked.prompt_ids))
        return out

    async def _grpc_prepare(self, request: pb.CompletionRequest, grpc_context
                            ) -> tuple[CompletionRequest | ChatCompletionRequest, Prepared]:
        """The request as the HTTP API's, and prepared."""
        if self.api_keys.enabled and not self.api_keys.allows_metadata(grpc_context.invocation_metadata()):
            raise OpenAIError("missing or invalid API key: send metadata `authorization: Bearer <key>`",
                              status=401, code="invalid_api_key")
        if self.preparer is None:   # an image generator's deployment (``image_generation.py``)
            raise OpenAIError("this deployment's model generates pictures: POST /v1/images/generations over HTTP",
                              param="model", code="text_not_supported")
        asked = from_pb(request, self.model_id)
        return asked, await self.preparer.prepare(asked)

    async def generate_image(self, request: pb.ImageRequest, grpc_context) -> pb.ImageResponse:
        """``GenerateImage``: POST /v1/images/generations' answer, each picture's PNG as bytes."""
        try:
            if self.api_keys.enabled and not self.api_keys.allows_metadata(grpc_context.invocation_metadata()):
                raise OpenAIError("missing or invalid API key: send metadata `authorization: Bearer <key>`",
                                  status=401, code="invalid_api_key")
            if self.pictures is None:
                raise OpenAIError("this deployment's model generates text, not pictures: call Complete",
                                  param="model", code="images_not_supported")
            pngs, scene, specs = await self.pictures.render(image_request_from_pb(request))
        except OpenAIError as err:
            grpc_abort(grpc_context, err)
            return pb.ImageResponse()
        return pb.ImageResponse(pictures=[pb.Picture(png=png, revised_prompt=scene, spec=spec_pb(spec))
                                          for png, spec in zip(pngs, specs)])

    async def complete(self, request: pb.CompletionRequest, grpc_context) -> pb.CompletionResponse:
        try:
            asked, prepared = await self._grpc_prepare(request, grpc_context)
            ranked = asked.generated_choices > asked.n
            candidates = await answers(self.streams, choice_requests(prepared, asked.generated_choices, ranked))
        except OpenAIError as err:
            grpc_abort(grpc_context, err)
            return pb.CompletionResponse()
        chosen = best(candidates, asked.n) if ranked else candidates
        answered = [self._answered(prepared, c) for c in chosen]
        choices = [pb.Choice(index=i, text=text, token_ids=c.token_ids, finish_reason=finish, spec=spec_pb(c.spec),
                             logprobs=self._logprobs(prepared, c, first=False).get("logprobs"), tool_calls=calls)
                   for i, (c, (text, calls, finish)) in enumerate(zip(chosen, answered))] if len(chosen) > 1 else []
        first, (text, calls, finish) = chosen[0], answered[0]
        return pb.CompletionResponse(
            id=prepared.id, model=self.model_id, text=text, token_ids=first.token_ids, finish_reason=finish,
            usage=usage_pb(total_usage(candidates)), spec=spec_pb(first.spec), choices=choices, tool_calls=calls,
            **self._logprobs(prepared, first, first=True),
        )

    @staticmethod
    def _answered(prepared: Prepared, whole) -> tuple[str, list[pb.ToolCall], str]:
        """A whole choice's text, tool calls and finish reason."""
        if not prepared.tool_calls:
            return (prepared.echo or "") + whole.text, [], whole.finish_reason
        content, calls, finish = tool_answer(whole.text, whole.finish_reason)
        return content or "", tool_calls_pb(calls), finish

    async def complete_stream(self, request: pb.CompletionRequest, grpc_context) -> AsyncIterator[pb.CompletionChunk]:
        try:
            asked, prepared = await self._grpc_prepare(request, grpc_context)
            if asked.generated_choices > asked.n:
                raise OpenAIError("best_of cannot be streamed: the best choices are known only at the end",
                                  param="best_of")
            begun: set[int] = set()
            parsers: dict[int, ToolCallStream] = {}
            async for index, event in merged([self.streams.events(p) for p in choice_requests(prepared, asked.n)]):
                first = index not in begun
                begun.add(index)
                text, calls, finish = ((prepared.echo or "") if first else "") + event.text, [], event.finish_reason
                if prepared.tool_calls:
                    text, calls, finish = parsers.setdefault(index, ToolCallStream()).piece(text, finish)
                chunk = pb.CompletionChunk(id=prepared.id, index=index, text=text, token_ids=event.token_ids,
                                           tool_calls=tool_calls_pb(calls), **self._logprobs(prepared, event, first))
                if finish is not None:
                    chunk.finish_reason = finish
                    chunk.usage.CopyFrom(usage_pb(event.usage))
                    chunk.spec.CopyFrom(spec_pb(event.spec))
                yield chunk
        except OpenAIError as err:
            # Ray Serve's proxy sends the status set on the context when the generator raises.
            grpc_abort(grpc_context, err)
            raise
