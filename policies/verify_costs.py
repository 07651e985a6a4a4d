"""What a verify forward costs on this replica, by batch size and tokens fed, from every step.

The online window rule (``online_window.py``) prices each window with b(γ), the verify ms of a
forward that feeds 1 + γ tokens. One request's own steps are too few to measure that: on the CPU
here a step varies by ~2 ms (sd) while the windows that matter differ by 0-1.5 ms (batch 1,
bfloat16: 19.8 / 22.0 / 19.2 / 20.7 / 20.8 / 20.9 / 23.6 / 25.8 / 25.6 ms for 1..9 tokens, the
medians of ~1100 steps of bench-like runs), and its 32 steps visit two to four sizes. Replayed
over recorded outputs with that noise, the rule priced from its own steps reached 0.95 of the
per-request oracle, priced from the true costs 0.99 (the same as the best static window).

So the replica pools every step it verifies: per (batch size, forward tokens), the median of the
last ``samples`` verify times (medians: a step now and then takes 8 ms longer). A request then
takes the shape of b from the replica and its level from its own steps (``online_window``):
steps of long contexts cost more at every size, and which requests used which sizes would
otherwise leak into the shape.
"""

from __future__ import annotations

import statistics
from collections import deque

from specserve.replicas.step import StepRecord


class VerifyCosts:
    def __init__(self, samples: int = 64, min_samples: int = 3):
        self.samples = samples
        self.min_samples = min_samples
        # batch size -> forward tokens -> recent verify ms, and their median (kept per size, so a
        # step recomputes one median, not the table's: this runs on every step of the replica)
        self._ms: dict[int, dict[int, deque[float]]] = {}
        self._medians: dict[int, dict[int, float]] = {}
        self._tables: dict[int, tuple[tuple[int, float], ...]] = {}   # batch size -> table, until it changes

    def observe(self, record: StepRecord) -> None:
        if record.batch_size <= 0 or record.forward_tokens <= 0:
            return
        b, tokens = record.batch_size, record.forward_tokens
        ms = self._ms.setdefault(b, {}).setdefault(tokens, deque(maxlen=self.samples))
        ms.append(record.verify_ms)
        if len(ms) >= self.min_samples:
            self._medians.setdefault(b, {})[tokens] = round(statistics.median(ms), 4)
            self._tables.pop(b, None)

    def table(self, batch_size: int) -> tuple[tuple[int, float], ...]:
        """((forward tokens, median verify ms), ...) by tokens, for the sizes measured
        ``min_samples`` times at this batch size."""
        if batch_size not in self._tables:
            self._tables[batch_size] = tuple(sorted(self._medians.get(batch_size, {}).items()))
        return self._tables[batch_size]
