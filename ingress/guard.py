"""ASGI middleware in front of every HTTP route of the ingress: the API key, then the body size
and the time the body takes to arrive, all checked before FastAPI parses anything (an oversized
body is never read whole into a model; a client that sends its body slowly gets a 408 once
``body_timeout_s`` has passed since the first read, however steadily it trickles, and its
connection is closed, so that it holds an ingress coroutine no longer than that).

The ingress replica calls ``configure`` once; the settings live in this module, not on the
FastAPI app, because Ray Serve ships the ingress class to its replica by value, with copies of
the objects its methods reference: state set on ``api`` from the class would land on a copy.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from specserve.ingress.auth import ApiKeys
from specserve.ingress.openai_api import OpenAIError

OPEN_PATHS = ("/health",)      # a load balancer's probe needs no key

_keys = ApiKeys()
_max_body_bytes = 4 << 20
# A whole body arrives within this: long enough for max_body_bytes over a slow link, short enough
# that clients which trickle their bodies cannot hold the ingress's coroutines for long.
BODY_TIMEOUT_S = 30.0
_body_timeout_s = BODY_TIMEOUT_S


def configure(keys: ApiKeys, max_body_bytes: int, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
    global _keys, _max_body_bytes, _body_timeout_s
    _keys, _max_body_bytes, _body_timeout_s = keys, max_body_bytes, body_timeout_s


class Guard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if _keys.enabled and scope.get("path", "") not in OPEN_PATHS and \
                not _keys.allows_header(headers.get("authorization"), headers.get("x-api-key")):
            err = OpenAIError("missing or invalid API key: send `Authorization: Bearer <key>`", status=401,
                              code="invalid_api_key")
            return await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = _max_body_bytes
        too_large = JSONResponse(OpenAIError(f"the body is larger than this server's limit of {limit} bytes; "
                                             "shorten the prompt", status=413, code="body_too_large").body(), status_code=413)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return await too_large(scope, receive, send)
        # Read (at most ``limit`` bytes of) the body here, then hand it on as one message.
        chunks, size = [], 0
        try:
            async with asyncio.timeout(_body_timeout_s):   # the answers below are sent outside it
                while size <= limit:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if not message.get("more_body"):
                        break
        except TimeoutError:
            err = OpenAIError(f"the body did not arrive within {_body_timeout_s:g} s; send it at once",
                              status=408, code="body_timeout")
            # Connection: close, since the rest of the body may still be on its way: the server
            # drops the connection after this answer instead of reading on.
            return await JSONResponse(err.body(), status_code=408, headers={"Connection": "close"})(scope, receive, send)
        if size > limit:
            return await too_large(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
