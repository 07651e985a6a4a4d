"""The shared learning-rate schedule: linear warm-up to the peak, cosine down to zero."""

import pytest

from specserve.training.schedule import warmup_cosine


def test_warm_up_then_cosine_to_zero():
    rates = [warmup_cosine(1.0, step, 4, 12) for step in range(14)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert rates[4] == 1.0 and rates[8] == pytest.approx(0.5) and rates[12] == rates[13] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(rates[4:], rates[5:]))
