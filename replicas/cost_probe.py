"""A step's costs measured before a replica serves: what the draft router and the load-aware
policy price with until the replica's own steps replace them, and what draft placement
(``cluster/placement.py``) compares.

Unmeasured, a cost model can only guess, and a guess of "free" (a draft at 0 ms, a flat verify
line) sends every first request to the costliest draft, since every draft then looks far faster
than none. So the replica times, on its own model thread and device:

    verify    one request's forward feeding 1 + γ tokens (γ = 0, 2, 4, 6) at a short context,
              through ``Target.verify``: the points of b(γ) = c0 + c1·(1 + γ) at batch 1
    loaded    the same forward for ``LOADED_BATCH`` requests at once (γ = 0 and 4): a loaded
              step's line, which batch-1 points do not give (see below)
    a_d       a draft's ms per drafted position: a proposal of 5 positions minus one of 1,
              over 4, so that the session's prefill (paid once per request) cancels out

Each is the median of ``rounds`` repetitions, after one unmeasured warm-up. Batch-1 points do not
price a loaded step (the forward's cost per token grows past the CPU's flat region): priced with
them, the first requests of a burst would go to drafts that cost more than they save. The
loaded points seed the busy buckets' lines, and the replica's real steps replace them within a
few dozen steps (``StepCosts``, ``GoodputPolicy``
keep a bounded history, and the load-aware policy fits a line per load bucket).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, ProposeRequest
from specserve.replicas.target import Target, VerifyItem

PROBE_CONTEXT = 64          # prompt tokens of each probe: a short chat turn
VERIFY_WINDOWS = (0, 2, 4, 6)
# The window a step is priced at before the replica's own steps measure it (the shipped default):
# a draft deployment's handle call is shared over its positions, and placement compares at it.
PRICED_WINDOW = 4
LOADED_BATCH = 12           # requests of the loaded probe: in the busiest load bucket (more than 8)
LOADED_WINDOWS = (0, 4)
DRAFT_POSITIONS = (1, 5)


@dataclass(frozen=True)
class ProbedCosts:
    """What a replica measured at start: verify (forward tokens, ms) at batch 1, and each draft's
    ms per drafted position."""

    verify: tuple[tuple[int, float], ...]
    draft_ms_per_position: dict[str, float]
    # (forward tokens, ms) of LOADED_BATCH requests verified together; empty where not measured
    verify_loaded: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {"verify_ms": {str(tokens): round(ms, 3) for tokens, ms in self.verify},
                **({f"verify_ms_batch_{LOADED_BATCH}": {str(t): round(ms, 3) for t, ms in self.verify_loaded}}
                   if self.verify_loaded else {}),
                "draft_ms_per_position": {d: round(ms, 3) for d, ms in self.draft_ms_per_position.items()}}


def probe_tokens(vocab: int, count: int = PROBE_CONTEXT, start: int = 0) -> list[int]:
    """Ordinary token ids (no special ones at the start of the vocabulary), repeating: what a
    probe feeds. The costs measured do not depend on which tokens they are."""
    low = min(1000, vocab // 2)
    return [low + (start + 7 * i) % (vocab - low) for i in range(count)]


def verify_points(target: Target, slot: int, rounds: int = 3, clock=time.perf_counter) -> tuple[tuple[int, float], ...]:
    """(forward tokens, median ms) of one request's verify forward feeding 1 + γ tokens, γ in
    ``VERIFY_WINDOWS``, on KV slot ``slot`` (reset before and after: its prefix cache is lost)."""
    return _verify_points(target, [slot], VERIFY_WINDOWS, rounds, clock)


def loaded_verify_points(target: Target, slots: list[int], rounds: int = 2,
                         clock=time.perf_counter) -> tuple[tuple[int, float], ...]:
    """(forward tokens, median ms) of one verify forward for a request on each of ``slots`` at
    once, each feeding 1 + γ tokens, γ in ``LOADED_WINDOWS``; the slots are reset before and after
    (their prefix caches are lost)."""
    return _verify_points(target, slots, LOADED_WINDOWS, rounds, clock)


def _verify_points(target: Target, slots: list[int], windows: tuple[int, ...], rounds: int,
                   clock) -> tuple[tuple[int, float], ...]:
    """(forward tokens, median ms) of a verify forward with a request on each of ``slots``, per
    window. The context is prefilled once and the other slots copy its cache (what a verify costs
    does not depend on which tokens the contexts hold); every verify rolls its slot back to the
    context and feeds the root again."""
    context = probe_tokens(target.vocab)
    try:
        for slot in slots:
            target.kv.reset(slot)
        target.prefill(slots[0], context[:-1], len(context), next_token=context[-1])
        for slot in slots[1:]:
            target.copy_prefix(slots[0], slot, len(context) - 1)
        points = []
        for window in windows:
            times = []
            for r in range(rounds + 1):
                items = [VerifyItem(slot, context, Proposal.chain(probe_tokens(target.vocab, window, start=r + i + 1)),
                                    SamplingParams()) for i, slot in enumerate(slots)]
                t0 = clock()
                target.verify(items)
                if r:   # the first round warms up
                    times.append(1e3 * (clock() - t0))
            points.append((len(slots) * (1 + window), statistics.median(times)))
        return tuple(points)
    finally:
        for slot in slots:
            target.kv.reset(slot)


def draft_ms_per_position(propose_now, vocab: int, features_size: int | None = None, rounds: int = 3,
                          clock=time.perf_counter) -> float:
    """a_d of a draft: ``propose_now(asks)`` answers a list of ``ProposeRequest`` on the calling
    thread (``DraftServer.propose_now``); ``features_size``: the width of the target states a
    draft that reuses them reads per position (``DraftServer.features_size``: n·H for n layers;
    random rows: the cost does not depend on them)."""
    import torch

    context = probe_tokens(vocab)
    # The target's hidden states of the positions it has verified: all but the root.
    features = None if features_size is None else torch.randn(len(context) - 1, features_size)
    by_positions = {}
    for positions in DRAFT_POSITIONS:
        times = []
        for r in range(rounds + 1):
            ask = ProposeRequest(f"cost-probe-{positions}-{r}", context, positions, None, SamplingParams(),
                                 features=features, features_start=0)
            t0 = clock()
            propose_now([ask])
            if r:
                times.append(1e3 * (clock() - t0))
        by_positions[positions] = statistics.median(times)
    short, long = DRAFT_POSITIONS
    return max(0.0, (by_positions[long] - by_positions[short]) / (long - short))
