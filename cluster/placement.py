"""Where each draft runs: inside every target replica, or as a Serve deployment of its own.

Per speculative step of γ drafted positions, a draft costs its target replica's step

    inside      γ·a_in                          its forwards on the replica's own model thread
    separate    h + γ·a_sep                     a handle call and its forwards on its own hardware
    separate,   (V' − V)                        drafting ahead (``replicas/step_loop.py``): while
    drafting    + P·max(0, h + (γ+1)·a_sep − V')    the target verifies (V' ms: V slowed by the
    ahead       + (1 − P)·(h + γ·a_sep              draft working beside it on the same host), the
                  + max(0, (γ+1)·a_sep − V'))       draft drafts the next step from the
                                                    all-accepted outcome; with P = α^(γ+1) (every
                                                    token accepted and the bonus guessed) the step
                                                    waits only for what that exceeds V'; otherwise
                                                    it asks again, behind the ahead call if that is
                                                    still running

and a separate draft replica holds CPUs (or a device) of its own even while no request uses it.
So a draft goes inside when its cost there is no more than separately, as its own deployment
when the config says so (``placement: separate``: a draft on a device of its own, or that scales
apart from the targets: GPU actors in production) or when the measurements say it is cheaper.

    model-free (prompt lookup)   always inside: an n-gram search costs microseconds, a handle
                                 call milliseconds (docs/benchmarks.md §2)
    model draft, ``auto``        measured on this host at build time with the target's thread
                                 count: a_in (``replicas/cost_probe.py``), V (the target's verify
                                 of 1 + γ tokens) alone and V' with the draft drafting on another
                                 thread (a draft replica on the same host shares its memory
                                 bandwidth; on a device of its own V' = V); a_sep = a_in unless the draft's own threads
                                 differ (then measured with them); h the handle call's floor
                                 below until a replica measures it live; α the draft's validation
                                 acceptance from its training record (else ``DEFAULT_ALPHA``)

Without drafting ahead, a_sep = a_in makes the separate side dearer by h, so on one kind of
hardware only drafting ahead can make it win. A target replica prices its draft deployments
again from live figures (its own handle calls, the draft replica's probe: ``StepLoop``), and the
router and policies use those. The decision and the figures that chose it are logged, returned
by ``GET /v1/models`` and shown by ``specserve status``.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field

from specserve.cluster.config import AUTO, INSIDE, SEPARATE, AppConfig, DraftSpec
from specserve.replicas.cost_probe import PRICED_WINDOW

logger = logging.getLogger("ray.serve")

# The least a Serve handle call costs a step (ms): the low end of what prompt lookup as its own
# deployment cost per step in ``bench serve`` (docs/benchmarks.md §2).
HANDLE_CALL_MS = 6.0
# The window placement prices a step at: the one every start-up price uses.
PLACEMENT_WINDOW = PRICED_WINDOW
# The per-token acceptance a draft is priced with when its training record gives none.
DEFAULT_ALPHA = 0.5


@dataclass(frozen=True)
class PlacementCosts:
    """Measured inputs of the decision, ms."""

    inside_ms_per_position: float        # a_in
    handle_ms: float = HANDLE_CALL_MS    # h
    separate_ms_per_position: float | None = None   # a_sep; None: the same hardware, = a_in
    window: int = PLACEMENT_WINDOW       # γ
    verify_ms: float | None = None       # V at 1 + γ tokens; None: no drafting ahead is priced
    # V while the draft drafts beside it on the same host (they share its memory bandwidth); None: as V
    verify_beside_ms: float | None = None
    alpha: float = DEFAULT_ALPHA         # α, the chance each drafted token is accepted
    # Whether the draft can draft ahead: not a hidden-state-reuse head, which needs the target's
    # states of the very tokens being verified.
    drafts_ahead: bool = True

    @property
    def inside_ms(self) -> float:
        return self.window * self.inside_ms_per_position

    @property
    def a_sep(self) -> float:
        return self.inside_ms_per_position if self.separate_ms_per_position is None else self.separate_ms_per_position

    @property
    def separate_ms(self) -> float:
        """Without drafting ahead."""
        return self.handle_ms + self.window * self.a_sep

    @property
    def hit_rate(self) -> float:
        """P: the chance a chain drafted ahead is the next step's proposal."""
        return self.alpha ** (self.window + 1)

    @property
    def separate_ahead_ms(self) -> float | None:
        """With drafting ahead (None without a measured verify, or for a draft that cannot)."""
        if self.verify_ms is None or not self.drafts_ahead:
            return None
        verify = self.verify_ms if self.verify_beside_ms is None else max(self.verify_ms, self.verify_beside_ms)
        ahead = (self.window + 1) * self.a_sep
        beyond = max(0.0, ahead - verify)
        hit = max(0.0, self.handle_ms + ahead - verify)
        slowed = verify - self.verify_ms   # what drafting beside costs the verify itself
        return slowed + self.hit_rate * hit + (1 - self.hit_rate) * (self.separate_ms + beyond)

    @property
    def best_separate_ms(self) -> float:
        ahead = self.separate_ahead_ms
        return self.separate_ms if ahead is None else min(self.separate_ms, ahead)


@dataclass(frozen=True)
class Placement:
    draft: str
    where: str                  # INSIDE or SEPARATE
    reason: str
    figures: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"where": self.where, "reason": self.reason, **({"figures": self.figures} if self.figures else {})}


def place(spec: DraftSpec, costs: PlacementCosts | None = None, draft_ahead: bool = True) -> Placement:
    """The placement of one draft from its spec and, for an ``auto`` model draft, measured costs.
    ``draft_ahead``: whether a separate draft would draft ahead (the application's setting)."""
    if spec.placement != AUTO:
        return Placement(spec.name, spec.placement, "configured")
    if spec.model is None:
        return Placement(spec.name, INSIDE, "model-free: a search costs less than any handle call")
    if spec.reads_pictures:
        return Placement(spec.name, INSIDE, "its views read the target's pictures, which only its replica holds")
    if costs is None:
        raise ValueError(f"draft {spec.name!r}: an auto placement of a model draft needs its measured costs")
    ahead = costs.separate_ahead_ms if draft_ahead else None
    separate = costs.separate_ms if ahead is None else min(costs.separate_ms, ahead)
    figures = {"window": costs.window, "inside_ms_per_step": round(costs.inside_ms, 3),
               "separate_ms_per_step": round(costs.separate_ms, 3),
               "inside_ms_per_position": round(costs.inside_ms_per_position, 3), "handle_ms": costs.handle_ms}
    if costs.separate_ms_per_position is not None:
        figures["separate_ms_per_position"] = round(costs.separate_ms_per_position, 3)
    if ahead is not None:
        figures.update({"separate_ahead_ms_per_step": round(ahead, 3), "verify_ms": round(costs.verify_ms, 3),
                        "alpha": round(costs.alpha, 4), "ahead_hit_rate": round(costs.hit_rate, 4)})
        if costs.verify_beside_ms is not None:
            figures["verify_beside_ms"] = round(costs.verify_beside_ms, 3)
    if costs.inside_ms <= separate:
        return Placement(spec.name, INSIDE, "measured: cheaper inside than a handle call and its own replica", figures)
    why = "drafting ahead while the target verifies" if ahead is not None and ahead < costs.separate_ms else "its own hardware"
    return Placement(spec.name, SEPARATE, f"measured: faster on its own replica, {why}, despite the handle call", figures)


def measure(spec: DraftSpec, config: AppConfig) -> PlacementCosts:
    """A model draft's costs, measured on this host with the target's thread count (the models
    loaded for the measurement, then dropped): a_in, a_sep where the draft's own threads differ,
    the target's verify alone and with the draft drafting beside it (on one host they share the
    memory bandwidth), and α from the draft's training record."""
    import threading

    from specserve.replicas.cost_probe import draft_ms_per_position
    from specserve.replicas.draft_server import DraftServer
    from specserve.replicas.model_worker import ModelWorker

    def loaded(threads: int) -> tuple[ModelWorker, DraftServer]:
        worker = ModelWorker(f"placement-{spec.name}", threads=threads)
        server = DraftServer(spec.name, spec.model, config.dtype, worker=worker, kv_sessions_idle=0,
                             ensemble=spec.ensemble.model_dump() if spec.ensemble else None,
                             quantization=spec.quantization)
        return worker, server

    def per_position(worker: ModelWorker, server: DraftServer, rounds: int = 3) -> float:
        return worker.call(draft_ms_per_position, server.propose_now, server.vocab_size or 1 << 15,
                           server.features_size, rounds)

    threads = config.torch_threads or 1
    worker, server = loaded(threads)
    try:
        a_in = per_position(worker, server)
        a_sep = None
        if spec.torch_threads and spec.torch_threads != threads:
            other, other_server = loaded(spec.torch_threads)
            try:
                a_sep = per_position(other, other_server)
            finally:
                other.close()
        ahead = config.draft_ahead and server.features_size is None
        verify = beside = None
        target = _placement_target(config.target, config.dtype) if ahead else None
        if target is not None:
            target_worker = ModelWorker("placement-target", threads=threads)
            try:
                verify = target_worker.call(_verify_ms, target)
                stop = threading.Event()

                def keep_drafting() -> None:
                    while not stop.is_set():
                        per_position(worker, server, rounds=1)

                neighbour = threading.Thread(target=keep_drafting, daemon=True)
                neighbour.start()
                try:
                    beside = target_worker.call(_verify_ms, target)
                finally:
                    stop.set()
                    neighbour.join()
            finally:
                target_worker.close()
    finally:
        worker.close()
    return PlacementCosts(inside_ms_per_position=a_in, separate_ms_per_position=a_sep, verify_ms=verify,
                          verify_beside_ms=beside, alpha=trained_alpha(spec.model), drafts_ahead=ahead)


@functools.lru_cache(maxsize=1)
def _placement_target(target: str, dtype: str):
    """The target, loaded once for a plan's measurements (``plan`` drops it after); None for a VLM
    target (its language model is priced by its replicas)."""
    from specserve.replicas.model_store import load_causal_lm
    from specserve.replicas.target import Target
    from specserve.replicas.vlm import is_vlm_folder

    return None if is_vlm_folder(target) else Target(load_causal_lm(target, dtype=dtype).model, slots=1)


def _verify_ms(target, window: int = PLACEMENT_WINDOW) -> float:
    """The target's verify forward of 1 + ``window`` tokens at batch 1 (ms, ``cost_probe``)."""
    from specserve.replicas.cost_probe import verify_points

    return min(verify_points(target, 0), key=lambda p: abs(p[0] - (1 + window)))[1]


def trained_alpha(model: str) -> float:
    """The draft's first-position acceptance on its training's held-out answers
    (``training.json``'s ``validation_acceptance_1``, written by ``specserve zoo``), else
    ``DEFAULT_ALPHA``."""
    from specserve.replicas.model_store import resolve_model_path

    try:
        record = json.loads((resolve_model_path(model) / "training.json").read_text())
        alpha = float(record["validation_acceptance_1"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_ALPHA
    return alpha if 0.0 < alpha < 1.0 else DEFAULT_ALPHA


def plan(config: AppConfig, measure_costs=measure) -> dict[str, Placement]:
    """Every draft's placement, in config order; logged (the Serve controller's log when the
    application is built from a config file)."""
    placements = {}
    for spec in config.drafts:
        needs_costs = spec.placement == AUTO and spec.model is not None and not spec.reads_pictures
        placements[spec.name] = place(spec, measure_costs(spec, config) if needs_costs else None, config.draft_ahead)
        logger.info("draft %s placed %s (%s) %s", spec.name, placements[spec.name].where,
                    placements[spec.name].reason, placements[spec.name].figures or "")
    _placement_target.cache_clear()
    return placements
