"""What a verify forward costs on this replica, by batch size and tokens fed, from every step.

The online window rule (``online_window.py``) prices each window with b(γ), the verify ms of a
forward that feeds 1 + γ tokens. One request's own steps are too few to measure that: on the CPU
here a step varies by ~2 ms (sd) while the windows that matter differ by 0-1.5 ms (batch 1,
bfloat16: 19.8 / 22.0 / 19.2 / 20.7 / 20.8 / 20.9 / 23.6 / 25.8 / 25.6 ms for 1..9 tokens, the
medians of ~1100 steps of bench-like runs), and its 32 steps visit two to four sizes. Replayed
over recorded outputs with that noise, the rule priced from its own steps reached 0.95 of the
per-request oracle, priced from the true costs 0.99 (the same as the best static window).

So the replica pools every step it verifies: per (batch size, context bucket, forward tokens),
the median of the last ``samples`` verify times (medians: a step now and then takes 8 ms longer).
The context matters to the shape, not only the level: alone, 6 tokens cost ~1 ms more than 1 at
a 200-token context and ~6 ms more at ~1000 (the attention reads the whole cache once per token
fed), so one table over every context prices long windows too high for short prompts and too low
for long ones (in ``bench policies`` the buckets moved the online rule from 0.959 to 0.960 of the
oracle: within its noise). A bucket is the batch's mean context rounded up to a power of two (at
least 128). A request then takes the shape of b from the table of its bucket and its level from
its own steps (``online_window``).
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
