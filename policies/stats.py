"""Acceptance statistics: integer counters per (target, draft, task bucket, time window), built
from the scheduler's per-step records by a replica-local collector.

Everything here is an integer count, so that two replicas' counts add up in Redis (``HINCRBY``)
and a snapshot of the cluster is a sum, never an average of averages. Field names follow vLLM's
spec-decode counters where one exists:

    drafts            request-steps that drafted (vLLM ``num_drafts``)
    draft_tokens      tokens (tree nodes) proposed (``num_draft_tokens``)
    accepted_tokens   draft tokens accepted (``num_accepted_tokens``)
    accepted_pos_<i>  steps whose i-th draft token was accepted (``num_accepted_tokens_per_pos``)
    rejections        drafting steps that broke before the longest offered path: Σ 1[n < γ], the
                      second term of the denominator of Eq. 2 in "A Drop-in Solution for
                      On-the-Fly Adaptation of Speculative Decoding in Large Language Models"
    emitted           tokens emitted by drafting steps (accepted + the bonus token)
    window_<γ>        drafting steps whose longest offered path was γ (a chain's window)
    plain_steps       steps of a request that has a draft where nothing was drafted: the policy
                      switched speculation off, or the draft had nothing to propose (prompt
                      lookup without a match)
    draft_us, verify_us   time of the steps those request-steps were part of (µs, summed per request-step)
    verify_us_w<γ>    verify time of the drafting steps with window γ (the paper's cost model b(γ))
    requests          requests started
    load_<L>_steps_w<γ>, load_<L>_verify_us_w<γ>, load_<L>_draft_us, load_<L>_draft_tokens
                      the cost side again per load bucket L of the step's batch size (``load_bucket``:
                      b1, b4, b8, b8+): verifying γ extra tokens costs almost nothing alone and
                      several times a plain step in a batch of 16, so the best window depends on
                      the load a request starts under (acceptance does not, and is not split)
    tree_<d>x<k>_steps, _emitted, _us   drafting steps that asked a tree of depth d and top-k k, the
                      tokens they emitted and their draft + verify time (which shape pays, measured);
                      again per load bucket as load_<L>_tree_<d>x<k>_* (a wide tree that pays alone
                      costs a batch's forward more)
    q_*, sage_*, adt_*, eagle2_*   the learned state finished requests carry to new ones
                      (``carry.py``: the rules' ``counts``), added when a request finishes

The collector's buffer is bounded: counts of one key only grow in value, and the number of time
windows it holds is capped (the oldest merge into the next), so a long Redis outage costs time
resolution, never memory or counts.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from specserve.replicas.request import SpecRequest
from specserve.replicas.step import StepRecord

# Prompt-length buckets (tokens): acceptance differs by task, and length is what every replica
# knows before the first step; with the router's topics a bucket is split by task topic too
# (``SpecRequest.topic``). The draft router (``router/``) goes further: it predicts α from the
# prompt's own features.
BUCKET_EDGES = (64, 256, 1024)


# Batch-size buckets: where the verify cost of extra draft tokens changes most on CPUs and GPUs.
LOAD_EDGES = (1, 4, 8)


def load_bucket(batch_size: int) -> str:
    for edge in LOAD_EDGES:
        if batch_size <= edge:
            return f"b{edge}"
    return f"b{LOAD_EDGES[-1]}+"


LOAD_BUCKETS = tuple([f"b{e}" for e in LOAD_EDGES] + [f"b{LOAD_EDGES[-1]}+"])


# A grammar-constrained request's bucket carries this suffix: under a grammar a draft is accepted
# differently (the grammar's forced tokens are not counted as drafted), so its priors are its own.
CONSTRAINED = "-grammar"


def task_bucket(prompt_tokens: int, constrained: bool = False, topic: int | None = None) -> str:
    """``p<edge>`` by prompt length, then ``-t<topic>`` with the prompt's task topic, then
    ``-grammar`` when a grammar constrains the output: ``p256-t2-grammar``."""
    suffix = ("" if topic is None else f"-t{topic}") + (CONSTRAINED if constrained else "")
    for edge in BUCKET_EDGES:
        if prompt_tokens <= edge:
            return f"p{edge}{suffix}"
    return f"p{BUCKET_EDGES[-1]}+{suffix}"


_TOPIC = re.compile(r"-t\d+")


def without_topic(bucket: str) -> str:
    """The length (and grammar) bucket a topic bucket belongs to: ``p256-t2`` -> ``p256``. The
    policy service pools each topic into it, the prior of a topic not measured yet."""
    return _TOPIC.sub("", bucket, count=1)


def request_bucket(request: SpecRequest) -> str:
    """The task bucket a request is counted and warm-started under."""
    return task_bucket(len(request.prompt_ids), request.grammar is not None, request.topic)


@dataclass(frozen=True, order=True)
class StatsKey:
    target: str
    draft: str
    bucket: str
    window_start: int   # unix seconds, a multiple of the collector's window_s

    def without_time(self) -> tuple[str, str, str]:
        return self.target, self.draft, self.bucket


def counts_from_record(record: StepRecord) -> dict[str, Counter]:
    """Per request id, the counters one step adds."""
    out: dict[str, Counter] = {}
    draft_us = round(record.draft_ms * 1e3)
    verify_us = round(record.verify_ms * 1e3)
    load = f"load_{load_bucket(record.batch_size)}"
    for step in record.requests:
        c = out.setdefault(step.request_id, Counter())
        if step.max_depth > 0:
            c["drafts"] += 1
            c["draft_tokens"] += step.proposed
            c["accepted_tokens"] += step.accepted
            for i in range(step.accepted):
                c[f"accepted_pos_{i}"] += 1
            c["rejections"] += int(step.accepted < step.max_depth)
            c["emitted"] += step.accepted + 1
            c[f"window_{step.max_depth}"] += 1
            c[f"verify_us_w{step.max_depth}"] += verify_us
            c["draft_us"] += draft_us
            c["verify_us"] += verify_us
            c[f"{load}_steps_w{step.max_depth}"] += 1
            c[f"{load}_verify_us_w{step.max_depth}"] += verify_us
            c[f"{load}_draft_us"] += draft_us
            c[f"{load}_draft_tokens"] += step.proposed
            tree = step.asked.tree
            if tree is not None:
                shape = f"tree_{tree.depth}x{tree.top_k}"
                for prefix in ("", f"{load}_"):
                    c[f"{prefix}{shape}_steps"] += 1
                    c[f"{prefix}{shape}_emitted"] += step.accepted + 1
                    c[f"{prefix}{shape}_us"] += draft_us + verify_us
        elif step.draft != "none":
            c["plain_steps"] += 1
    return out


class StatsCollector:
    """A replica's local buffer of counters; ``observe`` is called by the scheduler every step,
    ``drain`` by the exporter that flushes to Redis. Thread-safe: steps run on the model thread,
    flushes on the event loop."""

    def __init__(self, target: str, window_s: int = 60, max_windows: int = 60,
                 clock: Callable[[], float] = time.time):
        self.target = target
        self.window_s = window_s
        self.max_windows = max_windows
        self._clock = clock
        self._lock = threading.Lock()
        self._buffer: dict[StatsKey, Counter] = {}
        self._requests: dict[str, tuple[str, str]] = {}   # request id -> (draft, bucket)

    def _window(self) -> int:
        return int(math.floor(self._clock() / self.window_s) * self.window_s)

    def start(self, request_id: str, draft: str, bucket: str) -> None:
        """A request of ``draft`` in ``bucket`` (``request_bucket``) starts."""
        with self._lock:
            self._requests[request_id] = (draft, bucket)
            self._add(StatsKey(self.target, draft, bucket, self._window()), Counter(requests=1))

    def carry(self, draft: str, bucket: str, counts: dict[str, int]) -> None:
        """A finished request's carried counts (``carry.CarriedSums``), under its draft and bucket."""
        with self._lock:
            self._add(StatsKey(self.target, draft, bucket, self._window()), Counter(counts))

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def observe(self, record: StepRecord) -> None:
        by_request = counts_from_record(record)
        window = self._window()
        with self._lock:
            for request_id, counts in by_request.items():
                if not counts:
                    continue
                draft, bucket = self._requests.get(request_id, (None, None))
                if draft is None:
                    continue   # a request the collector was not told about (in-process use)
                self._add(StatsKey(self.target, draft, bucket, window), counts)

    def _add(self, key: StatsKey, counts: Counter) -> None:
        if key in self._buffer:   # the common case, every step: no bound to check
            self._buffer[key].update(counts)
            return
        self._buffer[key] = Counter(counts)
        windows = sorted({k.window_start for k in self._buffer})
        if len(windows) > self.max_windows:
            # Bounded: the oldest window's counts move into the next one (time resolution lost, no count).
            oldest, into = windows[0], windows[1]
            for k in [k for k in self._buffer if k.window_start == oldest]:
                moved = StatsKey(k.target, k.draft, k.bucket, into)
                self._buffer.setdefault(moved, Counter()).update(self._buffer.pop(k))

    def drain(self) -> dict[StatsKey, Counter]:
        """Everything counted since the last drain; the buffer starts empty."""
        with self._lock:
            out, self._buffer = self._buffer, {}
        return out

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(sum(c.values()) for c in self._buffer.values())
