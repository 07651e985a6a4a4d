"""The ingress's gRPC face (``specserve.proto``'s ``SpecServe``): protobuf in and out at the edge,
the HTTP API's request types and path in between.

A request becomes the HTTP API's body (``from_pb``) and is checked as one; an ``OpenAIError``
becomes a status (``GRPC_CODES``: 400 ``INVALID_ARGUMENT``, 404 ``NOT_FOUND``, 503 ``UNAVAILABLE``
with a ``retry-after`` trailer, ...). ``CompleteStream`` sends nothing before its first piece,
so a failure before then is a status as ``Complete``'s is.

Serve's gRPC proxy calls the ``Ingress`` deployment's method of the RPC's name, which calls ``GrpcFace``.
"""

from __future__ import annotations

import functools
import base64
from collections.abc import AsyncIterator

import grpc
from pydantic import ValidationError

from specserve.ingress import specserve_pb2 as pb
from specserve.ingress.auth import ApiKeys
from specserve.ingress.logprob_fields import LogprobFields
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Prepared, Preparer, validation_message
from specserve.ingress.resumable import TargetStreams

GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
              404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
              504: grpc.StatusCode.DEADLINE_EXCEEDED}


def pb_content(message: pb.ChatMessage) -> str | list[dict]:
    """A gRPC message's content as the HTTP API's: with pictures (raw file bytes), image parts
    first (as data URLs, so both APIs check them one way), then the text."""
    if not message.images:
        return message.content
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": "data:image;base64," + base64.b64encode(b).decode()}}
                         for b in message.images]
    return [*parts, {"type": "text", "text": message.content}]


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
        body["spec"] = spec
    if request.HasField("max_tokens"):
        body["max_tokens"] = request.max_tokens
    try:
        if request.messages:
            if request.prompt:
                raise OpenAIError("give either prompt or messages, not both", param="prompt")
            body["messages"] = [{"role": m.role, "content": pb_content(m)} for m in request.messages]
            return ChatCompletionRequest.model_validate(body)
        body["prompt"] = request.prompt
        return CompletionRequest.model_validate(body)
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
    return pb.SpecSummary(draft=spec.get("draft", ""), steps=spec.get("steps", 0),
                          mean_accepted_len=spec.get("mean_accepted_len", 0.0),
                          acceptance_rate=spec.get("acceptance_rate", 0.0), windows=spec.get("windows", []),
                          router=decision)


def grpc_abort(grpc_context, err: OpenAIError) -> None:
    """Set ``err`` as the call's status (Serve's proxy sends what is set on the context)."""
    grpc_context.set_code(GRPC_CODES.get(err.status, grpc.StatusCode.INTERNAL))
    grpc_context.set_details(err.message)
    if err.retry_after is not None:
        grpc_context.set_trailing_metadata([("retry-after", str(err.retry_after))])


class GrpcFace:
    """What ``SpecServe``'s RPCs answer (the ``Ingress`` deployment's methods of those names call these)."""

    def __init__(self, model_id: str, api_keys: ApiKeys, preparer: Preparer, streams: TargetStreams):
        self.model_id, self.api_keys, self.preparer, self.streams = model_id, api_keys, preparer, streams

    @functools.cached_property
    def logprob_fields(self) -> LogprobFields:
        return LogprobFields(self.preparer.tokenizer)

    def _logprobs(self, prepared: Prepared, event, first: bool) -> dict:
        """The response's or chunk's logprobs fields for ``event`` (the prompt's on the first)."""
        asked = prepared.spec_request
        out = {"logprobs": logprobs_pb(self.logprob_fields, event.token_ids,
                                       (event.logprobs or []) if asked.logprobs is not None else None)}
        if first and asked.prompt_logprobs is not None:
            out["prompt_logprobs"] = logprobs_pb(self.logprob_fields, asked.prompt_ids,
                                                 event.prompt_logprobs or [None] * len(asked.prompt_ids))
        return out

    async def _grpc_prepare(self, request: pb.CompletionRequest, grpc_context) -> Prepared:
        if self.api_keys.enabled and not self.api_keys.allows_metadata(grpc_context.invocation_metadata()):
            raise OpenAIError("missing or invalid API key: send metadata `authorization: Bearer <key>`",
                              status=401, code="invalid_api_key")
        return await self.preparer.prepare(from_pb(request, self.model_id))

    async def complete(self, request: pb.CompletionRequest, grpc_context) -> pb.CompletionResponse:
        try:
            prepared = await self._grpc_prepare(request, grpc_context)
            whole = await self.streams.answer(prepared)
        except OpenAIError as err:
            grpc_abort(grpc_context, err)
            return pb.CompletionResponse()
        return pb.CompletionResponse(
            id=prepared.id, model=self.model_id, text=(prepared.echo or "") + whole.text, token_ids=whole.token_ids,
            finish_reason=whole.finish_reason, usage=usage_pb(whole.usage), spec=spec_pb(whole.spec),
            **self._logprobs(prepared, whole, first=True),
        )

    async def complete_stream(self, request: pb.CompletionRequest, grpc_context) -> AsyncIterator[pb.CompletionChunk]:
        try:
            prepared = await self._grpc_prepare(request, grpc_context)
            first = True
            async for event in self.streams.events(prepared):
                chunk = pb.CompletionChunk(id=prepared.id, text=((prepared.echo or "") if first else "") + event.text,
                                           token_ids=event.token_ids, **self._logprobs(prepared, event, first))
                first = False
                if event.finish_reason is not None:
                    chunk.finish_reason = event.finish_reason
                    chunk.usage.CopyFrom(usage_pb(event.usage))
                    chunk.spec.CopyFrom(spec_pb(event.spec))
                yield chunk
        except OpenAIError as err:
            # Ray Serve's proxy sends the status set on the context when the generator raises.
            grpc_abort(grpc_context, err)
            raise
