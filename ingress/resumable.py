"""A request's stream from the target deployment, kept going when a target replica fails.

    request = the prepared request
    loop:
        open target.generate(request) as a stream; its first item within the deadline
        each item's tokens -> TextStream -> an Event (text, and on the last one why it ended)
        a replica died or its step failed:  request = continuation(request, tokens so far); again
        every replica busy:                 a new request is a 503; a continuation waits and asks again

What a client gets when something breaks (docs/design.md §7):
- a target replica that dies mid-generation, or whose whole step fails (``RayActorError``,
  ``StepFailed``), does not end the request: it resumes on a target replica from the tokens
  already produced (the prompt plus those tokens is the new prompt, the tokens left the new
  ``max_tokens``), at most ``resume_attempts`` times; greedy output is unchanged, a sampled one
  keeps the target's distribution (the continuation draws from a seed derived from the request's);
- every replica busy (``BackPressureError``: Serve's queue is full; ``DeploymentUnavailableError``:
  none running) is a 503 with ``Retry-After`` at once for a new request; a continuation asks again
  after a short backoff until ``resume_timeout_s`` has passed since its replica failed (a busy
  answer is no failure and costs no attempt);
- no first item within ``first_token_timeout_s`` (a new request) or ``resume_timeout_s`` (a
  continuation) is a 503 with ``Retry-After``, not a hang;
- a request that fails alone for a reason of its own (``StepError.request_fault``) would fail the
  same way anywhere: it is answered 400 ``request_failed`` and not resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from specserve.ingress.config import IngressConfig
from specserve.ingress.openai_api import OpenAIError
from specserve.ingress.prepare import Prepared
from specserve.ingress.text_stream import TextStream
from specserve.replicas.request import SpecRequest, StreamItem
from specserve.replicas.logprobs import joined
from specserve.replicas.step import TokenLogprob

logger = logging.getLogger("ray.serve")

# Tokens per piece of a non-streamed answer (with no stop strings): few messages, and a
# continuation after a replica failure recomputes at most this many.
WHOLE_ANSWER_INTERVAL = 64
# A continuation that finds every replica busy asks again after this, doubling up to the cap.
BUSY_BACKOFF_S = 0.05
MAX_BUSY_BACKOFF_S = 1.0


@dataclass
class Event:
    """A piece of a generation: new text, and on the last piece why it ended and what speculation did."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    spec: dict | None = None
    usage: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None   # per token of ``token_ids``, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # on the first piece, when the request asked

    def then(self, later: "Event") -> "Event":
        """This piece and ``later`` as one: both texts and tokens, ``later``'s ending."""
        return replace(later, text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
                       logprobs=joined(self.logprobs, later.logprobs),
                       prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


class StepFailed(RuntimeError):
    """A target replica failed a request mid-stream: its step failed (an item with a
    ``StepError``) or its stream ended without a last item. The request resumes elsewhere from
    the tokens it has."""


# A target replica that died (or is being replaced) under a request, or whose step failed: the
# request continues elsewhere from what it has produced.
_RESUMABLE = (RayActorError, StepFailed)
# No target replica can take a request right now (all full, or none running): ask again shortly.
_BUSY = (BackPressureError, DeploymentUnavailableError)


def _cancel(stream) -> None:
    """Cancel a target stream, whatever became of it: Serve's ``cancel`` re-raises the error of a
    request that was never assigned a replica (``BackPressureError``), which is already handled."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - nothing is left to cancel
        pass


def continuation(original: SpecRequest, produced: list[int], attempt: int) -> SpecRequest:
    """The rest of ``original`` after ``produced``: the target recomputes the KV of the prompt
    and those tokens (greedy output is the same token for token). A seeded sampled request
    draws its continuation from a seed derived from its own, so it does not replay the random
    numbers its first tokens used."""
    params = original.params
    if params.seed is not None:
        params = replace(params, seed=(params.seed + attempt * 0x9E3779B97F4A7C15) % 2**63)
    return replace(original, prompt_ids=[*original.prompt_ids, *produced],
                   max_tokens=original.max_tokens - len(produced), params=params,
                   request_id=f"{original.request_id}-r{attempt}", prompt_logprobs=None,
                   resumed_tokens=original.resumed_tokens + len(produced))


async def started(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """``events`` once its first event has come: a failure before then raises here, while the
    client can still be answered with a status (503 + ``Retry-After``, 400); one after it is the
    stream's to report."""
    first = await anext(events, None)

    async def rest() -> AsyncIterator[Event]:
        if first is not None:
            yield first
        async for event in events:
            yield event

    return rest()


class TargetStreams:
    """Requests' streams from the target deployment (``target``, a handle), resumed across replica
    failures. ``clock`` and ``sleep`` time the deadlines and a busy continuation's backoff."""

    def __init__(self, target, tokenizer, config: IngressConfig, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable] = asyncio.sleep):
        self.target, self.tokenizer, self.config = target, tokenizer, config
        self.clock, self.sleep = clock, sleep

    def unavailable(self, why: str) -> OpenAIError:
        return OpenAIError(f"{why}; retry in {self.config.retry_after_s} s", status=503, type="server_error",
                           code="unavailable", retry_after=self.config.retry_after_s)

    async def answer(self, prepared: Prepared) -> Event:
        """The whole answer as one event: the target sends its tokens in large pieces (each piece is
        a message; a continuation after a replica failure starts from the last piece received)."""
        if not prepared.stop:   # stop strings are found in the text as it comes: keep pieces small then
            prepared = replace(prepared, spec_request=replace(prepared.spec_request, stream_interval=WHOLE_ANSWER_INTERVAL))
        whole: Event | None = None
        async for event in self.events(prepared):
            whole = event if whole is None else whole.then(event)
        return whole

    async def events(self, prepared: Prepared) -> AsyncIterator[Event]:
        config = self.config
        text = TextStream(self.tokenizer, prepared.stop)
        prompt_tokens = len(prepared.spec_request.prompt_ids)
        request, resumed = prepared.spec_request, 0
        # By when the next item must come: the first token's deadline, then none while tokens
        # flow, then a continuation's (set at its first failure, kept through the ones after).
        deadline: float | None = self.clock() + config.first_token_timeout_s
        continuing = False   # ``deadline`` is a continuation's
        backoff = BUSY_BACKOFF_S
        # An item whose tokens add no text yet (part of a character) waits for the next one.
        pending = StreamItem([])
        while True:
            # _by_reference=False: the stream's items come over gRPC, not through Ray's object store:
            # each item is a message, and relaying them through the object store costs the ingress more.
            stream = self.target.options(stream=True, _by_reference=False).generate.remote(request)
            try:
                async for item in self._items(stream, deadline):
                    if item.error is not None:
                        if item.error.request_fault:
                            logger.warning("request %s failed alone (%s); not resumed", prepared.id, item.error.message)
                            raise OpenAIError(f"the target could not sample this request: {item.error.message}",
                                              code="request_failed")
                        raise StepFailed(f"the target's step failed: {item.error.message}")
                    deadline, continuing = None, False
                    delta = text.push(item.token_ids)
                    item = pending.then(item)
                    finish, spec = item.finish_reason, item.spec
                    if text.stopped:
                        finish = "stop"
                        if not item.last:   # ended early by a stop string: the target is still going
                            _cancel(stream)
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
                        yield Event(delta, item.token_ids, finish, spec, usage, item.logprobs, item.prompt_logprobs)
                        pending = StreamItem([])
                    else:
                        pending = item
                    if finish is not None:
                        return
                # The stream ended without a last item: the replica went away between two items.
                err: BaseException = StepFailed("the target's stream ended early")
            except _RESUMABLE as caught:
                err = caught
            except _BUSY as caught:
                _cancel(stream)
                if not resumed:   # not taken at all: the client retries
                    raise self.unavailable(f"every target replica is busy or restarting ({type(caught).__name__})") from caught
                # A continuation waits for a replica until its deadline; asking again is no new attempt.
                left = deadline - self.clock() if deadline is not None else 0.0
                if left <= 0:
                    raise self.unavailable(f"no target replica took the request's continuation within "
                                           f"{config.resume_timeout_s} s ({type(caught).__name__})") from caught
                await self.sleep(min(backoff, left))
                backoff = min(2 * backoff, MAX_BUSY_BACKOFF_S)
                continue
            except (asyncio.CancelledError, GeneratorExit):   # the client left: so does the request
                _cancel(stream)
                raise
            _cancel(stream)
            if resumed >= config.resume_attempts:
                raise self.unavailable(f"the request failed on {resumed + 1} target replicas ({type(err).__name__})") from err
            resumed += 1
            done = len(text.token_ids)
            if done >= prepared.spec_request.max_tokens:   # it failed after its last token
                yield Event(text.flush(), [], "length", {"resumed": resumed},
                            {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done})
                return
            logger.warning("request %s: its target replica failed after %d tokens (%s: %s); resuming (attempt %d)",
                           prepared.id, done, type(err).__name__, err, resumed)
            request = continuation(prepared.spec_request, text.token_ids, resumed)
            if not continuing:
                deadline, continuing = self.clock() + config.resume_timeout_s, True
            backoff = BUSY_BACKOFF_S

    async def _items(self, stream, deadline: float | None) -> AsyncIterator[StreamItem]:
        """The stream's items; the first one within ``deadline`` (a request or its continuation must
        be answered by a replica in time, or it ends with a retriable error instead of hanging)."""
        iterator = stream.__aiter__()
        if deadline is not None:
            try:
                first = await asyncio.wait_for(iterator.__anext__(), max(0.0, deadline - self.clock()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                _cancel(stream)
                raise self.unavailable("no target replica answered in time") from None
            yield first
        async for item in iterator:
            yield item
