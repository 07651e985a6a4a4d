"""A request's choices (``n``, and ``best_of``'s candidates): one target request each.

Choice i is the prepared request under its own id, and a seeded request's choice i draws from
``seed + i``, so that choices differ and each is reproducible; choice 0 is the request itself.
The choices go to the target deployment together: the prefix-affinity router sends them to one
replica while the load allows, and its scheduler prefills their prompt once (``replicas/scheduler.py``). Each is
resumed on its own after a replica failure (``resumable.py``); one that fails fails the request,
and the others are cancelled with it.

``best_of`` generates that many candidates and keeps the ``n`` whose tokens' summed
log-probability is highest (OpenAI's and vLLM's rule), so its candidates compute their tokens'
log-probabilities whether or not the client asked to see them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from ray.serve import context as serve_context

from specserve.ingress.prepare import Prepared
from specserve.ingress.resumable import Event, TargetStreams


def choice_requests(prepared: Prepared, count: int, ranked: bool = False) -> list[Prepared]:
    """``count`` choices of ``prepared``; ``ranked``: each computes its tokens' log-probabilities."""
    out = []
    for index in range(count):
        request = prepared.spec_request
        if index:
            params = request.params
            if params.seed is not None:
                seed = params.seed + index
                params = replace(params, seed=seed if seed < 2**63 else seed - 2**64)   # a signed 64-bit seed
            request = replace(request, params=params, request_id=f"{request.request_id}-{index}")
        if ranked and request.logprobs is None:
            request = replace(request, logprobs=0)
        out.append(replace(prepared, id=request.request_id, spec_request=request))
    return out


def cumulative_logprob(event: Event) -> float:
    return sum(lp.logprob for lp in event.logprobs or () if lp is not None)


def best(candidates: list[Event], n: int) -> list[Event]:
    """The ``n`` candidates of highest summed log-probability, likeliest first."""
    return sorted(candidates, key=cumulative_logprob, reverse=True)[:n]


def total_usage(answers: list[Event]) -> dict:
    """One usage for all of a request's choices: its prompt once, every generated token (discarded
    ``best_of`` candidates' too), and the prompt tokens the replica held before any choice came."""
    prompt = answers[0].usage.get("prompt_tokens", 0)
    completion = sum(a.usage.get("completion_tokens", 0) for a in answers)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = [a.usage["prompt_tokens_details"]["cached_tokens"] for a in answers if "prompt_tokens_details" in a.usage]
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": min(cached)}
    return usage


def _own_serve_request() -> None:
    """This task's calls to other deployments get a Serve request id of their own. Serve keys a
    call's routing and its replica's bookkeeping by that id, and calls made while serving one
    request inherit the request's: the choices' concurrent calls would be taken for one call (one
    of them then waits, another is never sent). Set in the choice's own task, whose context is a
    copy: the request's own id is unchanged elsewhere."""
    current = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(replace(current, _internal_request_id=uuid.uuid4().hex))


async def answers(streams: TargetStreams, requests: list[Prepared]) -> list[Event]:
    """Every choice's whole answer, in order; the first failure cancels the rest and is raised."""
    if len(requests) == 1:
        return [await streams.answer(requests[0])]

    async def one(request: Prepared) -> Event:
        _own_serve_request()
        return await streams.answer(request)

    tasks = [asyncio.ensure_future(one(r)) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merged(streams: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) as each choice's events come; the first failure cancels the rest and
    is raised, and so does the consumer's leaving."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Event]) -> None:
        _own_serve_request()
        try:
            async for event in stream:
                queue.put_nowait((index, event, None))
            queue.put_nowait((index, None, None))
        except Exception as err:  # noqa: BLE001 - raised to the consumer, which cancels the others
            queue.put_nowait((index, None, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, event, err = await queue.get()
            if err is not None:
                raise err
            if event is None:
                left -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
