"""The ingress's HTTP face: OpenAI's routes over FastAPI, answers as OpenAI JSON or Server-Sent Events.

Every error is OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, whoever raised
it: a check (``OpenAIError``), pydantic (400, not FastAPI's 422), FastAPI itself (a body it could
not parse, an unknown route or method: its status kept) or a bug (500). A stream answers 200 only
once its first piece has come, so what fails before then (every replica busy, no first token in
time, a bad request) is a status the client can act on; what fails later is an error chunk in the
stream, which has said 200 already.

The routes themselves are the ``Ingress`` deployment's methods, each a line that calls
``HttpFace``: ``serve.ingress`` rewrites a route's function to bind it to the replica, and only
the deployment's own methods reach the replica as rewritten (a base class's would be imported
there afresh). Handlers and middleware are set on ``api`` here, at import, before
``serve.ingress`` freezes a copy of it.
"""

from __future__ import annotations

import functools
import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.ingress.choices import answers, best, choice_requests, merged, total_usage
from specserve.ingress.config import IngressConfig
from specserve.ingress.guard import Guard
from specserve.ingress.logprob_fields import LogprobFields
from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.prepare import Prepared, Preparer, validation_message
from specserve.ingress.resumable import Event, TargetStreams, started
from specserve.ingress.tools import ToolCallStream, tool_answer
from specserve.policies.registry import POLICIES

logger = logging.getLogger("ray.serve")

# Whether the replicas learn together, as ``GET /v1/policy`` says it: the application has a policy
# service exactly when it was given a Redis (``cluster/app.py``), so its handle is the answer.
CLUSTER_LEARNING_ON = "on"
CLUSTER_LEARNING_OFF = ("off: no redis_url configured; each replica learns alone "
                        "(set redis_url or SPECSERVE_REDIS_URL)")

api = FastAPI(title="specserve", description="Speculative-decoding LLM serving, OpenAI-compatible.")
# Every HTTP route passes the API key and body-size checks first (ingress/guard.py).
api.add_middleware(Guard)


@api.exception_handler(OpenAIError)
async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


@api.exception_handler(RequestValidationError)
async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
    # FastAPI's default is 422 with its own body; OpenAI clients expect 400 with theirs.
    message, param = validation_message(err.errors())
    return JSONResponse(OpenAIError(message, param=param).body(), status_code=400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    # FastAPI's and Starlette's own answers ({"detail": ...} by default), status kept.
    if err.status_code in (404, 405):
        message = f"Invalid URL ({request.method} {request.url.path})"   # OpenAI's words for it
    elif err.status_code == 400:   # a body json.loads gave up on: nested too deep, a number too long
        message = f"the body could not be parsed ({err.detail}): send one JSON object with the request's fields"
    else:
        message = str(err.detail)
    kind = "server_error" if err.status_code >= 500 else "invalid_request_error"
    return JSONResponse(OpenAIError(message, status=err.status_code, type=kind).body(), status_code=err.status_code,
                        headers=getattr(err, "headers", None))


@api.exception_handler(Exception)
async def _unexpected(_: Request, err: Exception) -> JSONResponse:
    # A bug, not the client's fault; still an OpenAI body, and the replica lives on.
    logger.exception("unexpected error")
    body = OpenAIError(f"internal error: {type(err).__name__}: {err}", status=500, type="server_error",
                       code="internal_error").body()
    return JSONResponse(body, status_code=500)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class HttpFace:
    """What OpenAI's routes answer (the ``Ingress`` deployment's routes call these)."""

    def __init__(self, config: IngressConfig, preparer: Preparer, streams: TargetStreams, target, policy=None):
        """``target``, ``policy``: the target deployment's and the policy service's handles."""
        self.config, self.model_id = config, config.model_id
        self.preparer, self.streams, self.target, self.policy = preparer, streams, target, policy
        self.created = int(time.time())

    @functools.cached_property
    def logprob_fields(self) -> LogprobFields:
        return LogprobFields(self.preparer.tokenizer)

    def _completion_logprobs(self, prepared: Prepared, event: Event, offset: int, first: bool) -> dict | None:
        """A completion choice's ``logprobs`` for ``event``'s tokens, ``offset`` characters into the
        choice's text; the echoed prompt's tokens first on the ``first`` piece."""
        if prepared.spec_request.logprobs is None:
            return None
        fields = self.logprob_fields
        out = fields.completion(event.token_ids, event.logprobs or [], offset)
        if first and prepared.echo is not None:
            prompt_ids = prepared.spec_request.prompt_ids
            prompt = fields.completion(prompt_ids, event.prompt_logprobs or [None] * len(prompt_ids))
            out = {key: prompt[key] + ([o + len(prepared.echo) - offset for o in out[key]] if key == "text_offset"
                                       else out[key]) for key in out}
        return out

    def models(self) -> dict:
        text = self.preparer   # None: an image generator's deployment
        sees = text is not None and text.processor is not None   # a VLM target: pictures and clips in
        return {"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "specserve",
            "max_model_len": text.max_context if text else None, "drafts": self.config.draft_names,
            "policies": list(POLICIES),
            "input_modalities": ["text", "image", "video"] if sees else ["text"],
            # Frames a clip is sampled down to: a client sending more knows what is read.
            "max_video_frames": self.config.images.max_video_frames if sees else None,
            "output_modalities": ["text"] if text else ["image"],
            "placement": self.config.placement,
        }]}

    async def policy_snapshot(self) -> dict:
        if self.policy is None:
            # Learning alone is how this deployment was configured, not a fault: a 200 that says so.
            return {"object": "policy_snapshot", "cluster_learning": CLUSTER_LEARNING_OFF, "snapshot": None,
                    "service": None}
        try:
            snapshot, status = await asyncio.wait_for(
                asyncio.gather(self.policy.snapshot.remote(), self.policy.status.remote()), self.config.call_timeout_s)
        except Exception as err:  # noqa: BLE001 - the service is down: say so, do not fail the ingress
            raise OpenAIError(f"the policy service is not answering ({type(err).__name__}); retry shortly",
                              status=503, type="server_error", code="policy_service_unavailable") from err
        return {"object": "policy_snapshot", "cluster_learning": CLUSTER_LEARNING_ON, "snapshot": snapshot,
                "service": status}

    async def routing_recent(self, limit: int) -> dict:
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

    async def completions(self, req: CompletionRequest):
        prepared = await self.preparer.prepare(req)
        if req.stream:
            return await self._stream(prepared, req, chat=False)
        ranked = req.generated_choices > req.n
        candidates = await answers(self.streams, choice_requests(prepared, req.generated_choices, ranked))
        chosen = best(candidates, req.n) if ranked else candidates
        echo = prepared.echo or ""
        choices = []
        for index, whole in enumerate(chosen):
            choice = {"index": index, "text": echo + whole.text,
                      "logprobs": self._completion_logprobs(prepared, whole, 0, True), "finish_reason": whole.finish_reason}
            if req.return_token_ids:
                choice["token_ids"] = whole.token_ids
            if len(chosen) > 1:
                choice["spec"] = whole.spec
            choices.append(choice)
        return {
            "id": f"cmpl-{prepared.id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_id, "choices": choices, "usage": total_usage(candidates), "spec": chosen[0].spec,
        }

    async def chat_completions(self, req: ChatCompletionRequest):
        prepared = await self.preparer.prepare(req)
        if req.stream:
            return await self._stream(prepared, req, chat=True)
        every = await answers(self.streams, choice_requests(prepared, req.n))
        choices = []
        for index, whole in enumerate(every):
            logprobs = self.logprob_fields.chat(whole.token_ids, whole.logprobs or []) if req.logprobs else None
            message, finish = {"role": "assistant", "content": whole.text}, whole.finish_reason
            if prepared.tool_calls:
                message["content"], calls, finish = tool_answer(whole.text, finish)
                if calls:
                    message["tool_calls"] = calls
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
            if req.return_token_ids:
                choice["token_ids"] = whole.token_ids
            if len(every) > 1:
                choice["spec"] = whole.spec
            choices.append(choice)
        return {
            "id": f"chatcmpl-{prepared.id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_id, "choices": choices, "usage": total_usage(every), "spec": every[0].spec,
        }

    async def _stream(self, prepared: Prepared, req: CompletionRequest | ChatCompletionRequest,
                      chat: bool) -> StreamingResponse:
        """Server-Sent Events, OpenAI's chunks ending in ``data: [DONE]``; answered once the first
        piece of any choice has come (a failure before it raises here: the handlers give it its
        status). Each chunk carries one choice's piece; a chat choice's first says its role."""
        events = await started(merged([self.streams.events(p) for p in choice_requests(prepared, req.n)]))
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{prepared.id}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_id}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets: dict[int, int] = {}   # per choice: characters of its text sent so far (text_offset)
        parsers: dict[int, ToolCallStream] = {}   # per choice, when its tool calls are parsed out

        def choice(index: int, event: Event) -> dict:
            if not chat:
                first = index not in offsets
                text = ((prepared.echo or "") if first else "") + event.text
                offset = offsets.get(index, 0)
                logprobs = self._completion_logprobs(prepared, event, offset, first)
                offsets[index] = offset + len(text)
                return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": event.finish_reason}
            logprobs = self.logprob_fields.chat(event.token_ids, event.logprobs or []) if req.logprobs else None
            delta, text, finish = {}, event.text, event.finish_reason
            if prepared.tool_calls:
                parser = parsers.setdefault(index, ToolCallStream())
                made = parser.calls
                text, calls, finish = parser.piece(text, finish)
                if calls:
                    delta["tool_calls"] = [{"index": made + k, **call} for k, call in enumerate(calls)]
            if text:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        async def body() -> AsyncIterator[str]:
            ended: list[Event] = []
            roles: set[int] = set()
            try:
                async for index, event in events:
                    if chat and index not in roles:
                        roles.add(index)
                        yield _sse({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]})
                    chunk = {**base, "choices": [choice(index, event)]}
                    if req.return_token_ids:   # vLLM's extension: each chunk's new token ids
                        chunk["choices"][0]["token_ids"] = event.token_ids
                    if event.finish_reason is not None:
                        chunk["spec"] = event.spec
                        ended.append(event)
                    yield _sse(chunk)
                if include_usage and ended:
                    yield _sse({**base, "choices": [], "usage": total_usage(ended)})
            except OpenAIError as err:
                yield _sse(err.body())
            except Exception as err:  # noqa: BLE001 - the stream already said 200; say what broke in-band
                logger.exception("stream %s failed", prepared.id)
                yield _sse(OpenAIError(f"generation failed: {type(err).__name__}: {err}", status=500,
                                       type="server_error", code="internal_error").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")
