"""A target deployment's handle whose streams are scripted (``Replicas``), for the ingress's
tests without Ray: each ``generate`` call streams the next list of items, an exception among
them raised where it stands (a busy deployment's before the first item, a dead replica's
mid-stream)."""

import asyncio

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from specserve.ingress.config import IngressConfig
from specserve.ingress.prepare import Prepared
from specserve.ingress.resumable import TargetStreams
from specserve.replicas.request import SpecRequest

SPEC = {"draft": "prompt-lookup", "steps": 2, "policy": "static"}   # as a replica builds it


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i): text the test can read."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i) for i in ids)


HANG = object()   # a replica that never answers


class Stream:
    """One replica's answer: its items in order; an exception among them is raised there (a busy
    deployment's before the first item, a dead replica's mid-stream)."""

    def __init__(self, items: list):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        async def items():
            for item in self.items:
                if item is HANG:
                    await asyncio.Event().wait()
                if isinstance(item, BaseException):
                    raise item
                yield item
        return items()

    def cancel(self):
        self.cancelled = True
        # Serve's cancel re-raises the error of a request no replica was assigned.
        if self.items and isinstance(self.items[0], (BackPressureError, DeploymentUnavailableError)):
            raise self.items[0]


class Replicas:
    """A target deployment's handle: each ``generate`` call streams the next list of items (as if
    each went to another replica)."""

    def __init__(self, *streams: list):
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


class Clock:
    """Time that passes only when the stream sleeps (a busy continuation's backoff)."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def streams(replicas: "Replicas", resume_attempts: int = 3, clock: Clock | None = None, **config) -> TargetStreams:
    clock = clock or Clock()
    return TargetStreams(replicas, Letters(), IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4,
                                                            resume_attempts=resume_attempts, retry_after_s=7, **config),
                         clock=clock, sleep=clock.sleep)


def prepared() -> Prepared:
    return Prepared("abc", SpecRequest([20, 21, 22], 4, request_id="abc"), stop=[])


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


def busy() -> list:
    return [BackPressureError(num_queued_requests=8, max_queued_requests=8)]
