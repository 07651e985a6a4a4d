"""Where each draft runs: inside every target replica, or as a Serve deployment of its own.

Per speculative step of γ drafted positions, a draft costs its target replica

    inside      γ·a_in                the draft's forwards on the replica's own thread/device
    separate    h + γ·a_sep           a handle call (the step waits for its round trip) and the
                                      forwards on the draft replica's hardware

and a separate draft replica holds CPUs (or a device) of its own even while no request uses it.
So a draft goes inside when γ·a_in ≤ h + γ·a_sep; as its own deployment when the config says so
(``placement: separate``: a draft on a device of its own, or that scales apart from the targets:
GPU actors in production) or when measurement says its own hardware is that much faster.

    model-free (prompt lookup)   always inside: an n-gram search costs microseconds, a handle
                                 call milliseconds (a sixth to a third of a CPU step;
                                 docs/benchmarks.md §2)
    model draft, ``auto``        a_in measured on this host at build time with the target's thread
                                 count (``replicas/cost_probe.py``); a_sep = a_in unless measured
                                 on other hardware (a separate replica on the same kind of host
                                 runs the same forward); h the handle call's measured floor below

With a_sep = a_in the separate side is dearer by h, so on one kind of hardware ``auto`` puts every
draft inside (what the measurements on CPU say: with prompt lookup behind a handle, the shipped
config served 0.55x vLLM's n-gram one request at a time). The decision and the figures that chose
it are logged, returned by ``GET /v1/models`` and shown by ``specserve status``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specserve.cluster.config import AUTO, INSIDE, SEPARATE, AppConfig, DraftSpec

logger = logging.getLogger("ray.serve")

# The least a Serve handle call costs a step (ms): the low end of what prompt lookup as its own
# deployment cost per step in ``bench serve`` (docs/benchmarks.md §2).
HANDLE_CALL_MS = 6.0
# The window placement prices a step at: the shipped default window.
PLACEMENT_WINDOW = 4


@dataclass(frozen=True)
class PlacementCosts:
    """Measured inputs of the decision, ms."""

    inside_ms_per_position: float        # a_in
    handle_ms: float = HANDLE_CALL_MS    # h
    separate_ms_per_position: float | None = None   # a_sep; None: the same hardware, = a_in
    window: int = PLACEMENT_WINDOW       # γ

    @property
    def inside_ms(self) -> float:
        return self.window * self.inside_ms_per_position

    @property
    def separate_ms(self) -> float:
        a_sep = self.inside_ms_per_position if self.separate_ms_per_position is None else self.separate_ms_per_position
        return self.handle_ms + self.window * a_sep


@dataclass(frozen=True)
class Placement:
    draft: str
    where: str                  # INSIDE or SEPARATE
    reason: str
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"where": self.where, "reason": self.reason, **({"figures": self.figures} if self.figures else {})}


def place(spec: DraftSpec, costs: PlacementCosts | None = None) -> Placement:
    """The placement of one draft from its spec and, for an ``auto`` model draft, measured costs."""
    if spec.placement != AUTO:
        return Placement(spec.name, spec.placement, "configured")
    if spec.model is None:
        return Placement(spec.name, INSIDE, "model-free: a search costs less than any handle call")
    if spec.reads_pictures:
        return Placement(spec.name, INSIDE, "its views read the target's pictures, which only its replica holds")
    if costs is None:
        raise ValueError(f"draft {spec.name!r}: an auto placement of a model draft needs its measured costs")
    figures = {"window": costs.window, "inside_ms_per_step": round(costs.inside_ms, 3),
               "separate_ms_per_step": round(costs.separate_ms, 3),
               "inside_ms_per_position": round(costs.inside_ms_per_position, 3), "handle_ms": costs.handle_ms}
    if costs.inside_ms <= costs.separate_ms:
        return Placement(spec.name, INSIDE, "measured: cheaper inside than a handle call and its own replica", figures)
    return Placement(spec.name, SEPARATE, "measured: faster on its own replica despite the handle call", figures)


def measure(spec: DraftSpec, config: AppConfig) -> PlacementCosts:
    """A model draft's in-replica cost, measured on this host with the target's thread count
    (loaded for the measurement, then dropped)."""
    from specserve.replicas.cost_probe import draft_ms_per_position
    from specserve.replicas.draft_server import DraftServer
    from specserve.replicas.model_worker import ModelWorker

    worker = ModelWorker(f"placement-{spec.name}", threads=config.torch_threads or 1)
    try:
        server = DraftServer(spec.name, spec.model, config.dtype, worker=worker, kv_sessions_idle=0,
                             ensemble=spec.ensemble.model_dump() if spec.ensemble else None)
        vocab = server.vocab_size or 1 << 15
        ms = worker.call(draft_ms_per_position, server.propose_now, vocab, server.features_size)
    finally:
        worker.close()
    return PlacementCosts(inside_ms_per_position=ms)


def plan(config: AppConfig, measure_costs=measure) -> dict[str, Placement]:
    """Every draft's placement, in config order; logged (the Serve controller's log when the
    application is built from a config file)."""
    placements = {}
    for spec in config.drafts:
        needs_costs = spec.placement == AUTO and spec.model is not None and not spec.reads_pictures
        placements[spec.name] = place(spec, measure_costs(spec, config) if needs_costs else None)
        logger.info("draft %s placed %s (%s) %s", spec.name, placements[spec.name].where,
                    placements[spec.name].reason, placements[spec.name].figures or "")
    return placements
