"""The guard in front of every HTTP route, driven as an ASGI app with a fake client: a body that
arrives whole is handed on as one message; one that is too large is a 413; one that takes longer
than the body deadline, however steadily it trickles, is a 408 with OpenAI's error body, and the
app behind never runs."""

import asyncio
import json
import time

import pytest

from specserve.ingress import guard
from specserve.ingress.auth import ApiKeys


@pytest.fixture(autouse=True)
def settings():
    yield
    guard.configure(ApiKeys(), 4 << 20)   # the module's defaults, for the tests that follow


class App:
    """The route behind the guard: records the body it was handed."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        message = await receive()
        self.bodies.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(receive, app=None):
    """Runs one POST through the guard; the response's status, headers and JSON body, and the app."""
    app, sent = app or App(), []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    # A guard without a body deadline would wait on such a client for ever: the test gives up first.
    asyncio.run(asyncio.wait_for(guard.Guard(app)(scope, receive, send), timeout=5.0))
    if not sent:
        return None, {}, None, app
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], headers, json.loads(body) if headers.get("content-type") == "application/json" else body, app


def chunks(*parts: bytes, every_s: float = 0.0):
    """A client sending these pieces of a body, one each ``every_s``."""
    pending = list(parts)

    async def receive():
        await asyncio.sleep(every_s)
        piece = pending.pop(0)
        return {"type": "http.request", "body": piece, "more_body": bool(pending)}
    return receive


def stalling(first: bytes):
    """A client that sends the first piece of a body and then nothing: only a deadline ends it."""
    sent = []

    async def receive():
        if sent:
            await asyncio.sleep(3600)
        sent.append(first)
        return {"type": "http.request", "body": first, "more_body": True}
    return receive


def test_a_body_in_pieces_reaches_the_app_as_one_message():
    status, _, body, app = call(chunks(b'{"a": ', b'1}'))
    assert (status, body, app.bodies) == (200, b"ok", [b'{"a": 1}'])


def test_a_body_over_the_size_limit_is_a_413():
    guard.configure(ApiKeys(), max_body_bytes=1024)
    status, _, body, app = call(chunks(b"x" * 1000, b"x" * 1000))
    assert status == 413 and body["error"]["code"] == "body_too_large" and app.bodies == []


@pytest.mark.parametrize("client", [
    "trickles",   # a piece every 0.05 s: never idle long, but never done
    "stalls",     # half a body, then silence
])
def test_a_body_slower_than_the_deadline_is_a_408_and_the_connection_closes(client):
    guard.configure(ApiKeys(), 4 << 20, body_timeout_s=0.3)
    receive = chunks(*[b"x"] * 1000, every_s=0.05) if client == "trickles" else stalling(b'{"a": ')
    start = time.monotonic()
    status, headers, body, app = call(receive)
    assert time.monotonic() - start < 2.0
    assert status == 408 and headers.get("connection") == "close"
    assert body == {"error": {"message": "the body did not arrive within 0.3 s; send it at once",
                              "type": "invalid_request_error", "param": None, "code": "body_timeout"}}
    assert app.bodies == []


def test_the_body_deadline_defaults_when_configure_is_called_as_before():
    guard.configure(ApiKeys(), 1 << 20)
    assert guard._body_timeout_s == guard.BODY_TIMEOUT_S == 30.0
