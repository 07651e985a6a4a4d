"""The target as a Ray Serve deployment: one step loop per replica batches all of its requests.

Why the loop runs here: each step needs the drafts' proposals and the target's verify. Driven
from the target replica a step costs one call per draft (for all of the step's requests), and
the tokens stream back to the ingress off the step's critical path. ``generate`` only enqueues a
request and relays what the loop emits for it; the loop (``StepLoop.serve_forever``) runs as a
background task, and model work runs on the replica's one model thread, with its thread count
set in that thread.

What the replica learns with comes from the application (``learning``, built by
``policies.replica_learning``): every step's record goes to its observers (statistics, metrics),
its background tasks flush counts to Redis and keep the policy service's snapshot, and each new
request may start from that snapshot (``spec.prior`` in the response says which); none of it
touches Redis on the request path.

A draft replica that fails mid-request costs speed, never the request: its requests go on with
plain decoding (docs/design.md §7). A client that leaves cancels its request: it leaves the batch at
the next step and its KV slot is freed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.replicas.model import cuda_graphs
from specserve.replicas.cost_probe import (LOADED_BATCH, PRICED_WINDOW, ProbedCosts, draft_ms_per_position,
                                           loaded_verify_points, verify_points)
from specserve.replicas.core_share import CoreShare
from specserve.replicas.draft_server import DraftServer
from specserve.replicas.grammar import grammar_tokenizer, warm_up
from specserve.replicas.model.kv_memory import check_utilization, choose_slots, model_bytes
from specserve.replicas.imagegen import is_generator_folder, load_generator
from specserve.replicas.lantern import latent_neighbours
from specserve.replicas.model_store import LoadedModel, default_device, load_causal_lm, resolve_dtype
from specserve.replicas.pictures import target_image_store
from specserve.replicas.vlm import is_vlm_folder, language_model, load_vlm, target_text
from specserve.replicas.model_worker import ModelWorker
from specserve.replicas.model.native_memory import release_free_memory
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT, Policy, RequestState, SpecRequest, StreamItem
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.remote_draft import RemoteDraft
from specserve.replicas.step import TreeShape
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import DEFAULT_FEATURE_LAYERS, Target

logger = logging.getLogger("ray.serve")


# Steps that fail one after another (every request of each failing) mean the model cannot run.
UNHEALTHY_AFTER_FAILED_STEPS = 3
# Freed native memory goes back to the OS when the replica runs out of work, at most this often.
RELEASE_MEMORY_EVERY_S = 2.0
# Finished outputs join the suffix drafts' indexes this often; shorter ones are not worth it.
SUFFIX_BUILD_EVERY_S = 0.5
MIN_REMEMBERED = 8
# Other replicas' outputs waiting for the next build (the oldest go first beyond).
MAX_ARRIVED = 4096


@dataclass(frozen=True)
class TargetConfig:
    """What a target replica runs, from the application's configuration (``cluster.config.AppConfig``,
    whose field descriptions are the user's documentation of the same settings)."""

    # A local folder, a .gguf file or a model-cache name: the only setting with no sensible default.
    model: str
    # bfloat16 only where it pays (``model_store.bf16_is_fast``: native bf16 dot products); float32
    # elsewhere, where bfloat16 would cost precision and gain no speed.
    dtype: str = "auto"
    # None: Ray's OMP_NUM_THREADS, which Ray sets to the replica's num_cpus: the CPUs it was given.
    torch_threads: int | None = None
    # A step may also run on the cores of the node's idle target replicas (``core_share``).
    share_cores: bool = False
    # Slots kept beyond the batch for finished requests' KV caches, a prefix cache for follow-up
    # turns; each is one more sequence of KV memory (a whole ``max_model_len`` when preallocated).
    kv_sessions_idle: int = 4
    # Requests verified together in one forward; more wait for a slot. 16 matches the shipped
    # target deployment's ``max_ongoing_requests``, so there every request Serve sends is in the batch.
    max_batch: int = 16
    # Prompt tokens prefilled per step (``Scheduler``): a long prompt stalls the running requests
    # for at most one chunk's forward, and a typical chat prompt still fits in one.
    prefill_chunk: int = 512
    # The name statistics, metrics and warm starts are kept under; None: the model's folder name,
    # as the application's model id is by default, so the cluster's priors match across replicas.
    stats_name: str | None = None
    # The draft of an ``auto`` request when no router chooses: none, since only the application
    # knows which drafts it deployed.
    default_draft: str = NO_DRAFT
    # The longest prompt + completion; the KV cache of every slot is allocated for it at start
    # (vLLM's preallocation: memory stays flat under load, where a cache grown on demand keeps
    # growing towards the longest sequence seen, docs/benchmarks.md §7.2). None: the model's context, the cache
    # growing as sequences do, for the in-process tests and small runs that never fill it; on CUDA
    # the model's context capped so that ``max_batch`` slots fit in the device's memory, allocated
    # at start too, since a cache that grows on a GPU runs out of memory mid-request.
    max_model_len: int | None = None
    # The tree a request starts from (the deployment's ``default_tree``): a hidden-state-reuse
    # head inside the replica captures its whole-tree graphs at start (``head_graphs``).
    default_tree: TreeShape | None = None
    # On CUDA, the fraction of the device's memory in use once the KV cache is allocated, counting
    # what was in use before it (weights, CUDA context, other processes) and an allowance for
    # activations (vLLM's rule): the slots are as many as fit, at most ``max_batch +
    # kv_sessions_idle``, idle sessions given up first (``kv_memory``). Elsewhere the slots are as
    # configured: the host's memory is no one device's to divide.
    gpu_memory_utilization: float = 0.9
    # Drafts that run apart from the model thread draft the next step while the target verifies.
    draft_ahead: bool = True
    grammar_draft: bool = True   # a grammar's forced tokens proposed as the step's draft

    def __post_init__(self) -> None:
        check_utilization(self.gpu_memory_utilization)


@runtime_checkable
class ServedPolicy(Policy, Protocol):
    """A replica's policy (``policies.per_request.PolicyByRequest``) also names the rule it applies
    to each request: the response's ``spec.policy``."""

    def name_for(self, state: RequestState) -> str: ...

    def seed_costs(self, verify: tuple[tuple[int, float], ...], draft_ms_per_position: dict[str, float],
                   loaded: tuple = ()) -> None:
        """The replica's costs measured at start (``cost_probe``), for the policies that price steps:
        batch-1 verify points, drafts' ms per position, and ``loaded``: (batch size, verify points) pairs."""

    def carry_into(self, sink: Callable[[str, str, dict[str, int]], None]) -> None:
        """Where finished requests' carried rule state goes besides the policy's own sums:
        (draft, task bucket, counts) to the replica's statistics, on their way to Redis."""


def merged(item: StreamItem, queue: asyncio.Queue) -> StreamItem:
    """``item`` and the items queued behind it as one: each item the replica yields is a message
    to the ingress, so a stream that fell behind catches up in one message, not one per step."""
    while not item.last and not queue.empty():
        more = queue.get_nowait()
        if more.error is not None:
            return more
        item = item.then(more)
    return item


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16, health_check_period_s=10)
class TargetDeployment:
    def __init__(self, config: TargetConfig, *, policy: ServedPolicy,
                 drafts: dict[str, DeploymentHandle | dict] | None = None,
                 learning: Callable[[str], object] | None = None, router: Callable[..., object] | None = None):
        """``policy``: chooses each request's speculation per step (``specserve.policies``).
        ``drafts``: a handle per draft deployment, or the ``DraftSpec`` fields of a draft placed inside.
        ``learning``: called with the stats name, what the replica learns with: the statistics,
        metrics and warm starts (``policies.replica_learning``); None: nothing. ``router``: called
        with the stats name, the draft names and the tokenizer, the draft router of ``auto``
        requests with its background tasks (``router/router_factory.py``); None: they get
        ``config.default_draft``."""
        drafts = drafts or {}
        if not isinstance(policy, ServedPolicy):
            raise TypeError(f"the replica's policy must name the rule it applies to each request (name_for) and "
                            f"take the replica's measured costs (seed_costs): {type(policy).__name__} does not; "
                            "wrap it in policies.per_request.PolicyByRequest")
        # An image generator's folder (``imagegen.py``) serves picture requests: token ids in and
        # out, no tokenizer (the ingress decodes its image tokens).
        self.generator, neighbours = None, None
        if is_generator_folder(config.model):
            model, self.generator, vq = load_generator(config.model, dtype=resolve_dtype(config.dtype, default_device()))
            neighbours = latent_neighbours(vq.codes().detach())   # what LANTERN's relaxed acceptance reads
            self.loaded = LoadedModel(Path(config.model).name, model, None)
        else:
            self.loaded = (load_vlm(config.model, dtype=config.dtype) if is_vlm_folder(config.model)
                           else load_causal_lm(config.model, dtype=config.dtype))
        # A VLM runs its language model; its pictures' image tokens embed from the image store.
        self.images = None
        text_model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        if self.generator is None:
            text = target_text(self.loaded.tokenizer, self.loaded.model.config)
            self.tokenizer = text.tokenizer
            if text.processor is not None:
                text_model = language_model(self.loaded.model)
                self.images = target_image_store(self.loaded.model, text.processor)
        # Ray sets OMP_NUM_THREADS to num_cpus; the model thread sets torch's count itself.
        threads = config.torch_threads or torch.get_num_threads()
        self._worker = ModelWorker("target", threads=threads)
        self.replica_id = uuid.uuid4().hex
        resolved = {}
        for name, d in drafts.items():
            if isinstance(d, dict):
                # A draft on its own thread gets a one-thread worker (and CUDA stream) of its own.
                worker = (ModelWorker(f"draft-{name}", threads=d.get("torch_threads") or 1, own_stream=True)
                          if d.get("own_thread") else self._worker)
                resolved[name] = DraftServer(name, d["model"], config.dtype, kv_sessions_idle=config.kv_sessions_idle,
                                             worker=worker, method=d.get("method"), seed_outputs=d.get("seed_outputs"),
                                             ensemble=d.get("ensemble"), images=self.images,
                                             windowed=d.get("windowed", False), quantization=d.get("quantization"),
                                             max_model_len=config.max_model_len,
                                             trees=(config.default_tree,) if config.default_tree else ())
            else:
                # Every call of this replica goes to one draft replica, which then holds the KV
                # caches of all its sessions (any replica would be correct, from the tokens).
                resolved[name] = RemoteDraft(d.options(session_id=self.replica_id), name)
        # Sized once every model on the device (this target's, drafts' inside) holds its weights.
        self.kv_sizing = choose_slots(config.max_batch, config.kv_sessions_idle, config.max_model_len,
                                     device=text_model.device, model_config=text_model.config, dtype=text_model.dtype,
                                     weights_bytes=model_bytes(self.loaded.model),
                                     gpu_memory_utilization=config.gpu_memory_utilization)
        if self.kv_sizing.slots < config.max_batch + config.kv_sessions_idle:
            logger.warning("target %s: %d KV slots of %d positions fit in %s's memory (gpu_memory_utilization %s), not "
                           "max_batch + kv_sessions_idle = %d: %d run at once", config.model, self.kv_sizing.slots,
                           self.kv_sizing.max_model_len, text_model.device, config.gpu_memory_utilization,
                           config.max_batch + config.kv_sessions_idle, self.kv_sizing.max_running)
        target = Target(text_model, slots=self.kv_sizing.slots, max_len=self.kv_sizing.max_model_len, images=self.images,
                        neighbours=neighbours)
        # The layers drafts inside read, tapped before any capture: a graph keeps the layers it was
        # captured with, and one tapped later would miss every graph captured now.
        for server in resolved.values():
            if isinstance(server, DraftServer) and server.needs_features:
                try:
                    target.tap_features(server.feature_layers or DEFAULT_FEATURE_LAYERS)
                except ValueError:
                    pass   # the step loop disables that draft, saying why, when it first asks
        if self.kv_sizing.max_model_len is not None:
            target.kv.reserve()
            # On CUDA the buckets of decode and windows now, before any request: a first step then waits on no capture.
            target.kv.capture_graphs(cuda_graphs.START_WIDTHS)
        self.stats_name = config.stats_name or Path(config.model).name.removesuffix(".gguf")
        # The router's features read text: a generator's requests keep the draft they name.
        self.routing = (None if router is None or self.tokenizer is None
                        else router(self.stats_name, list(drafts), self.tokenizer))
        self.learning = learning(self.stats_name) if learning is not None else None
        if self.learning is not None:
            policy.carry_into(self.learning.carry)
        self._priors: dict[str, dict] = {}   # request id -> the warm start a routed request began from
        self.scheduler = Scheduler(
            target, policy, self.loaded.eos_token_ids, prefill_chunk=config.prefill_chunk,
            max_running=self.kv_sizing.max_running, router=None if self.routing is None else self.routing.router, default_draft=config.default_draft,
            observers=self.learning.observers if self.learning is not None else (),
            on_draft=[self._routed] if self.learning is not None else (),
            # Grammars constrain text: a generator's replica refuses them (no tokenizer to compile with).
            grammar_tokenizer=(make_grammar_tokenizer := None if self.tokenizer is None else functools.partial(
                grammar_tokenizer, self.tokenizer, target.vocab, tuple(sorted(self.loaded.eos_token_ids)))),
            grammar_draft=config.grammar_draft)
        if make_grammar_tokenizer is not None:
            threading.Thread(target=warm_up, args=(make_grammar_tokenizer,), name="grammar-warm-up", daemon=True).start()
        self.loop = StepLoop(self.scheduler, resolved, self._worker, on_idle=self._release_free_memory,
                             draft_ahead=config.draft_ahead, on_draft_costs=self._price_separate,
                             on_carried=None if self.learning is None else self.learning.carry_draft)
        self._released_at = -math.inf
        self._task: asyncio.Task | None = None
        self._probe()   # the model runs before the replica reports healthy (and a reserved cache is allocated)
        # Priced before it serves: the router and the policy start from this replica's own costs.
        inside = {name: d for name, d in resolved.items() if isinstance(d, DraftServer)}
        self.costs = self._worker.call(self._measure_costs, inside)
        self.policy = policy
        policy.seed_costs(self.costs.verify, self.costs.draft_ms_per_position,
                          loaded=((LOADED_BATCH, self.costs.verify_loaded),) if self.costs.verify_loaded else ())
        if self.routing is not None:
            self.routing.router.costs.seed_verify(self.costs.verify)
            self.routing.router.costs.seed_verify(self.costs.verify_loaded, batch_size=LOADED_BATCH)
            for name, ms in self.costs.draft_ms_per_position.items():
                self.routing.router.costs.seed(name, ms)
        # Cores lent and borrowed from here on: the start-up above measured this replica's own threads.
        self.cores = self._worker.share = (CoreShare(threads, self.replica_id, lambda: self.scheduler.has_work)
                                           if config.share_cores else None)
        self._background: list[asyncio.Task] | None = None   # learning's tasks, once started
        # Suffix drafts inside learn from finished outputs: this replica's at once, the others'
        # through the learning's exchange (queued by its thread in ``_arrived``, taken here).
        self._suffixes = [d.suffix for d in inside.values() if d.suffix is not None]
        self._arrived: deque[tuple[str | None, object]] = deque(maxlen=MAX_ARRIVED)
        if self._suffixes and self.learning is not None:
            self.learning.receive_outputs(lambda salt, tokens: self._arrived.append((salt, tokens)), target.vocab)
        logger.info("target %s ready on %s (%s, %d threads), batch %d, %d KV slots of %s positions (%s), drafts: %s; "
                    "measured costs: %s", config.model, self.loaded.model.device, self.loaded.model.dtype, threads,
                    self.kv_sizing.max_running, target.slots, target.kv.max_len, self.kv_sizing.sized_by,
                    ", ".join(f"{n} ({'inside' if n in inside else 'separate'})" for n in drafts) or "none",
                    json.dumps(self.costs.to_dict()))

    def __del__(self) -> None:
        # Serve calls it as the replica shuts down: its cores leave the node's books at once.
        if getattr(self, "cores", None) is not None:
            self.cores.close()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self.loop.serve_forever())
        if self._background is None:
            work = [*(self.learning.background() if self.learning is not None else ()),
                    *(self.routing.background() if self.routing is not None else ()),
                    *([self._build_suffix_indexes()] if self._suffixes else ())]
            self._background = [loop.create_task(w) for w in work]

    async def _release_free_memory(self) -> None:
        """Out of work: lend this replica's cores (``core_share``) and give freed native memory
        back (``native_memory``), at most every few seconds, on the model thread (idle now; the
        event loop stays free)."""
        if self.cores is not None:
            self.cores.threads()
        now = time.monotonic()
        if now - self._released_at >= RELEASE_MEMORY_EVERY_S:
            self._released_at = now
            await self._worker.run(release_free_memory)

    def _remember(self, state: RequestState) -> None:
        """A finished request's output, for the suffix drafts here and on every other replica."""
        if len(state.out) < MIN_REMEMBERED or state.finish_reason == "error":
            return
        for suffix in self._suffixes:
            suffix.remember(state.out, state.request.cache_salt)
        if self.learning is not None:
            self.learning.share_output(state.request.cache_salt, state.out)

    async def _build_suffix_indexes(self) -> None:
        """Outputs join the suffix drafts' arrays in batches, built off the event loop (a build
        is a few numpy sorts, too long to hold the loop for), installed on it."""
        while True:
            await asyncio.sleep(SUFFIX_BUILD_EVERY_S)
            try:
                while self._arrived:
                    salt, tokens = self._arrived.popleft()
                    for suffix in self._suffixes:
                        suffix.remember(tokens, salt)
                for suffix in self._suffixes:
                    builds = suffix.pending()
                    if builds:
                        suffix.install(await asyncio.to_thread(suffix.build, builds))
            except Exception:  # noqa: BLE001 - the index stays as it was; serving goes on
                logger.exception("building the suffix index failed")

    def _routed(self, state: RequestState, previous: str | None) -> None:
        """A draft the router chose (or switched to): statistics count the request under it, and
        a first choice starts from the cluster's prior for that draft."""
        request, prior = self.learning.start(state.request, len(self.scheduler.running))
        if previous is None:
            state.request = request
            if prior is not None:
                self._priors[state.id] = prior

    def _spec(self, state: RequestState, asked: SpecRequest, prior: dict | None) -> dict:
        """The response's ``spec``, built once, when the request finishes: what speculation did
        (``SpecStats.summary``), the replica that answered, the policy that adapted it (unless it asked for none), the warm
        start it began from, and the router's decision."""
        spec = state.stats.summary()
        spec["replica"] = self.replica_id[:12]   # which target replica answered (the dashboard's view of balance)
        if not asked.speculation.plain:
            spec["policy"] = self.scheduler.policy.name_for(state)
        if prior is not None:
            spec["prior"] = prior
        if state.routing is not None:
            spec["router"] = state.routing
        return spec

    async def generate(self, request: SpecRequest) -> AsyncIterator[StreamItem]:
        """Yields the request's tokens as steps verify them (the first step's at once, then at
        least ``request.stream_interval`` at a time); the last item also carries
        ``finish_reason``, ``spec`` and ``cached_tokens``, or instead an ``error`` when a step
        failed (the ingress then resumes the request elsewhere)."""
        self._ensure_loop()
        if request.images:
            if self.images is None:
                raise ValueError(f"{self.stats_name} reads text only: a request with images needs a VLM target")
            for unit in request.images:   # the prompt's image ids name these very units
                self.images.add(unit)
        prior = None
        basis = None if self.routing is None else self.routing.router.basis
        if basis is not None and request.topic is None:   # priors are kept per task topic
            request = replace(request, topic=basis.topic(request.prompt_ids))
        if self.learning is not None and request.draft != AUTO_DRAFT:   # routed ones start in _routed
            request, prior = self.learning.start(request, len(self.scheduler.running) + 1)
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        state = self.loop.add(request, queue.put_nowait)
        held: StreamItem | None = None   # tokens not yet sent (``request.stream_interval``)
        sent = False
        try:
            while True:
                item = merged(await queue.get(), queue)
                if item.error is not None:
                    yield item
                    return
                if held is not None:
                    item, held = held.then(item), None
                if not item.last and sent and len(item.token_ids) < request.stream_interval:
                    held = item
                    continue
                if item.last:
                    item = replace(item, spec=self._spec(state, request, prior or self._priors.pop(state.id, None)))
                sent = True
                yield item
                if item.last:
                    return
        finally:
            if self._suffixes and state.done:
                self._remember(state)
            self._priors.pop(request.request_id, None)
            if self.learning is not None:
                self.learning.finish(request.request_id)
            if not state.done:   # the caller left (a client hung up, a stop string, a deadline)
                state.finish("abort")

    async def recent_routes(self, count: int = 50) -> list[dict]:
        """This replica's router's latest finished decisions with outcomes, oldest first."""
        if self.routing is None:
            return []
        return list(self.routing.router.recent)[-count:]

    async def load(self) -> dict:
        """What the replica holds now: requests in the batch and waiting, the KV slots they hold
        and the positions cached for them (what a finished, cancelled or timed-out request gives
        back at the next step), and the KV buffers allocated (fixed once grown); and its KV
        capacity: slots, positions each, their product, and whether the device's memory or the
        configuration set it (``kv_memory``)."""
        live = [s for s in self.scheduler.running if not s.done]
        kv = self.scheduler.target.kv
        return {"replica_id": self.replica_id, "running": len(live), "waiting": len(self.scheduler.waiting),
                "slots_in_use": len(live), "kv_slots": kv.slots,
                "kv_positions_in_use": sum(len(kv.tokens[s.slot]) for s in live if s.slot is not None),
                "kv_bytes_allocated": kv.allocated_bytes, "kv_max_len": kv.max_len,
                "kv_capacity_tokens": kv.slots * kv.max_len, "kv_sized_by": self.kv_sizing.sized_by,
                # Steps replayed as CUDA graphs and padded steps that fit no bucket (None: no graphs here).
                "cuda_graphs": None if kv.graphs is None else {"held": len(kv.graphs), "replays": kv.graphs.replays,
                                                               "eager": kv.graphs.eager},
                "fused_elementwise": kv.fused_elementwise,   # inductor's kernels between the products (CUDA)
                "failed_steps_in_a_row": self.loop.failures}

    def _probe(self) -> None:
        """Two tokens through the forward that serves requests, on the last KV slot (free when
        the replica is idle; its prefix cache is given up): what a replica must be able to do."""
        target, token = self.scheduler.target, min(self.loaded.eos_token_ids, default=0)
        slot = target.slots - 1
        target.kv.reset(slot)
        try:
            done = target.prefill(slot, [token], 1, next_token=token, score_rows=1)
        finally:
            target.kv.reset(slot)
        if not math.isfinite(done.nll):
            raise RuntimeError("the model's output is not finite")

    def _price_separate(self, name: str, ms_per_position: float, round_trip_ms: float) -> None:
        """A draft deployment's cost per drafted position to this replica's steps, at the default
        window: its own forwards plus its share of the handle call (the steps measure it after)."""
        ms = ms_per_position + round_trip_ms / PRICED_WINDOW
        self.policy.seed_costs((), {name: ms})
        if self.routing is not None:
            self.routing.router.costs.seed(name, ms)

    def _measure_costs(self, inside: dict[str, DraftServer]) -> ProbedCosts:
        """On the model thread: the verify forward's cost by tokens fed, and each in-replica
        draft's per drafted position (``cost_probe``), on the last KV slot (free at start)."""
        target = self.scheduler.target
        drafts = {}
        for name, draft in inside.items():
            try:
                probe = (draft_ms_per_position, draft.propose_now, target.vocab, draft.features_size)
                # A draft on its own thread is timed there, with that thread's count.
                drafts[name] = probe[0](*probe[1:]) if draft.worker is self._worker else draft.worker.call(*probe)
            except Exception as err:  # noqa: BLE001 - an unmeasured draft is only unpriced (the router only explores it)
                logger.warning("draft %s: its cost could not be measured (%s: %s); the router tries it only to explore it "
                               "until a request that drafts with it measures it", name, type(err).__name__, err)
        # The loaded probe takes the last slots (free at start); a replica with too few skips it.
        loaded = () if target.slots < LOADED_BATCH + 1 else loaded_verify_points(
            target, list(range(target.slots - LOADED_BATCH, target.slots)))
        return ProbedCosts(verify=verify_points(target, target.slots - 1), draft_ms_per_position=drafts,
                           verify_loaded=loaded)

    async def check_health(self) -> None:
        """Healthy means the model runs: a stuck forward, a dead step loop, steps failing in a row
        or an idle model that cannot run one token make the replica unhealthy (Serve replaces it).
        Never asks Redis or a draft: their outages cost speed, not the replica."""
        self._ensure_loop()   # also starts the background tasks of a replica that has not served yet
        self._worker.check()
        if self.cores is not None:
            self.cores.beat()
        if self._task is not None and self._task.done() and not self._task.cancelled() and self._task.exception():
            raise RuntimeError(f"the step loop died: {self._task.exception()!r}")
        if self.loop.failures >= UNHEALTHY_AFTER_FAILED_STEPS:
            raise RuntimeError(f"{self.loop.failures} steps failed in a row, the last with {self.loop.last_error}")
        if not self.scheduler.has_work:   # busy: the steps themselves show that the model runs
            try:
                await self._worker.run(self._probe)
            except Exception as err:  # noqa: BLE001 - any failure of the model is ill health
                raise RuntimeError(f"the model cannot run one token: {type(err).__name__}: {err}") from err
