"""The learning-rate schedule the training recipes share: linear warm-up, then cosine decay to 0."""

from __future__ import annotations

import math


def warmup_cosine(peak: float, step: int, warmup_steps: int, steps: int) -> float:
    """The rate at ``step`` (from 0): ``peak`` reached after ``warmup_steps``, 0 at ``steps``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
