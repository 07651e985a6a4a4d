"""A verify forward's cost line per load bucket, from recent steps: what the load-aware policy
(``goodput.py``) and the draft router's costs (``router/costs.py``) price a step with.

    verify_ms ≈ a + b · forward_tokens

fitted by least squares (``window.fit_verify_ms``) over the recent steps of the batch's load
bucket (``stats.load_bucket``: b1, b4, b8, b8+) when they span two sizes, else over all recent
steps, else the last line that did. A token fed costs more in a loaded forward than alone (the
forward is past the size at which the CPU's matrix products stop being flat; figures:
docs/benchmarks.md §4.2), so one line through every batch size underprices speculation under
load. A steady batch decoding plainly feeds the same tokens every step and fits no line: the last
line still prices a window. Fits are kept until the next step is added
(they are asked for every request of a step).
"""

from __future__ import annotations

from collections import deque

from specserve.policies.stats import load_bucket
from specserve.policies.window import fit_verify_ms


class LoadLines:
    def __init__(self, history: int):
        self._history = history
        self._all: deque[tuple[int, float]] = deque(maxlen=history)        # (forward tokens, verify ms)
        self._by_load: dict[str, deque[tuple[int, float]]] = {}            # the same, per load bucket
        self._fits: dict[str | None, tuple[float, float] | None] = {}
        self._last: tuple[float, float] | None = None

    def add(self, batch_size: int, forward_tokens: int, verify_ms: float) -> None:
        point = (forward_tokens, verify_ms)
        self._all.append(point)
        self._by_load.setdefault(load_bucket(batch_size), deque(maxlen=self._history)).append(point)
        self._fits.clear()

    def line(self, batch_size: int | None = None) -> tuple[float, float] | None:
        """(a, b) at ``batch_size``'s load bucket (None: over all steps); None until recent steps
        have spanned two sizes."""
        key = None if batch_size is None else load_bucket(max(1, batch_size))
        if key not in self._fits:
            self._fits[key] = self._fit(key)
        return self._fits[key]

    def _fit(self, key: str | None) -> tuple[float, float] | None:
        if key is not None:
            local = fit_verify_ms(self._by_load.get(key, ()))
            if local is not None:
                return local
        pooled = fit_verify_ms(self._all)
        if pooled is not None:
            self._last = pooled
        return self._last
