"""Rows taking turns: round i runs the rows starting from row i mod n, so that a noisy neighbour,
a warming cache or a slow start weighs on every row alike over a run, not on whichever goes first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def in_turn(rows: Sequence[T], i: int) -> list[T]:
    """``rows`` in round ``i``'s order: from row ``i mod len(rows)`` on, then the rows before it."""
    shift = i % len(rows)
    return [*rows[shift:], *rows[:shift]]
