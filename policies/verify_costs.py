"""What a verify forward costs on this replica, by batch size and tokens fed, from every step.

The online window rule (``online_window.py``) prices each window with b(γ), the verify ms of a
forward that feeds 1 + γ tokens. One request's own steps are too few to measure that: a step's
noise exceeds the differences between the windows that matter, and a request visits only a few
sizes, so a rule priced from its own steps falls further from the per-request oracle than one
priced from the true costs (figures: docs/benchmarks.md §4.1).

So the replica pools every step it verifies: per (batch size, context bucket, forward tokens),
the median of the last ``samples`` verify times (medians, because a step now and then takes much
longer). The context matters to the shape, not only the level: the attention reads the whole
cache once per token fed, so a wide window costs more over a short one at a long context than at
a short one, and one table over every context would price long windows too high for short
prompts and too low for long ones. A bucket is the batch's mean context rounded up to a power of
two (at least 128). A request then takes the shape of b from the table of its bucket and its
level from its own steps (``online_window``).
"""

from __future__ import annotations

import statistics
from collections import deque

from specserve.replicas.step import StepRecord


class VerifyCosts:
    def __init__(self, samples: int = 64, min_samples: int = 3):
        self.samples = samples
        self.min_samples = min_samples
        # (batch size, context bucket) -> forward tokens -> recent verify ms, and their median
        # (kept per size, so a step recomputes one median: this runs on every step of the replica)
        self._ms: dict[tuple[int, int], dict[int, deque[float]]] = {}
        self._medians: dict[tuple[int, int], dict[int, float]] = {}

    def observe(self, record: StepRecord, context_tokens: int = 0) -> None:
        """One step; ``context_tokens``: the cached tokens of its requests, summed."""
        if record.batch_size <= 0 or record.forward_tokens <= 0:
            return
        key = (record.batch_size, context_bucket(context_tokens / record.batch_size))
        ms = self._ms.setdefault(key, {}).setdefault(record.forward_tokens, deque(maxlen=self.samples))
        ms.append(record.verify_ms)
        if len(ms) >= self.min_samples:
            self._medians.setdefault(key, {})[record.forward_tokens] = round(statistics.median(ms), 4)

    def table(self, batch_size: int, context_tokens: int = 0) -> tuple[tuple[int, float], ...]:
        """((forward tokens, median verify ms), ...) by tokens, for the sizes measured
        ``min_samples`` times at this batch size and context bucket (``context_tokens`` summed
        over the batch, as ``observe`` takes it)."""
        key = (batch_size, context_bucket(context_tokens / max(1, batch_size)))
        return tuple(sorted(self._medians.get(key, {}).items()))


def context_bucket(mean_context: float) -> int:
    """The power of two at or above a mean context, at least 128."""
    bucket = 128
    while bucket < mean_context:
        bucket *= 2
    return bucket
