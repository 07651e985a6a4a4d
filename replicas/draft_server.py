"""A draft server: proposals for all of a target step's requests that use this draft, in one call.

It runs in one of three places:

- as its own Ray Serve deployment (``draft_deployment.DraftDeployment``): drafts scale and fail apart from the
  target, on their own GPUs, and a step pays one handle call for all its requests (milliseconds:
  docs/benchmarks.md §2);
- inside each target replica (``DraftSpec.placement``, inside): no call at all, sharing the target's model
  thread. Worth it when proposing is cheap next to the hop (prompt lookup) or the draft is
  small enough to sit beside the target;
- in-process (``specserve generate``, ``bench engine``, tests), built from a draft factory.

The server keeps each session's draft state between steps (``SessionPool``), so a step feeds only
the tokens a draft's cache lacks. Any replica can serve any call, since a draft's cache is rebuilt
from the tokens; a target replica sends all its calls to one draft replica only to save rebuilds.

A proposal that fails costs that request its speculation for the step, never the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from specserve.data.answers import answer_outputs
from specserve.replicas.cost_probe import draft_ms_per_position
from specserve.replicas.drafts.base import Draft, NeedFeatures, draft_model, needs_features, propose
from specserve.replicas.drafts.batched_lm import BatchedDraftLM
from specserve.replicas.drafts.ensemble import EnsembleDraftLM, user_turn_marker
from specserve.replicas.drafts.ensemble_carry import valid_ending
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.head_graphs import HeadGraphs
from specserve.replicas.drafts.hsr_draft import MissingFeatures
from specserve.replicas.drafts.hsr_head import HSRHead, feature_layers
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.model import cuda_graphs
from specserve.replicas.model.image_tokens import draft_view
from specserve.replicas.model.kv_memory import DRAFT_KV_FRACTION, MIN_DRAFT_RESERVATION, draft_reservation
from specserve.replicas.model_store import load_causal_lm
from specserve.replicas.model_worker import ModelWorker
from specserve.replicas.model.session_pool import SessionPool
from specserve.replicas.step import Proposal, ProposeRequest, TreeShape

# Served, it logs through Ray Serve's replica logger (the Serve log of its deployment).
logger = logging.getLogger("ray.serve")

# Seeded generators of sampled sessions in flight; far more than a replica serves at once.
MAX_GENERATORS = 4096


def text_view(ask: ProposeRequest) -> ProposeRequest:
    """``ask`` as a draft that reads no pictures sees it: a VLM request's image tokens as the
    placeholder (an id past a draft's vocabulary would fail its embedding)."""
    if ask.image_placeholder is None:
        return ask
    return replace(ask, context=draft_view(ask.context, ask.image_placeholder))


class DraftServer:
    def __init__(self, name: str, model: str | None = None, dtype: str = "auto", torch_threads: int | None = None,
                 kv_sessions_idle: int = 4, worker=None, make_draft: Callable[[], Draft] | None = None,
                 method: str | None = None, seed_outputs: str | None = None, ensemble: dict | None = None,
                 tokenizer=None, images=None, windowed: bool = False, measure_cost: bool = False,
                 quantization: str | None = None, max_model_len: int | None = None,
                 trees: tuple[TreeShape, ...] = ()):
        """``model``: a draft LM or HSR head to load; None: the model-free ``method``, prompt lookup
        or suffix (its index seeded with the answers in ``seed_outputs``). ``make_draft``: build
        the per-session drafts from a factory instead (in-process use). ``worker``: the thread
        model work runs on; a draft inside the target replica shares the target's. ``ensemble``:
        the draft LM's chains are TABED ensembles of these views (``EnsembleDraftLM``'s keywords:
        views, weights, distance, history); ``tokenizer`` finds the last-turn view's marker
        in-process (a loaded model brings its own). ``images``: the target's ``ImageStore`` when
        the draft runs beside it, so an ensemble's multimodal and pooled views read a VLM
        request's pictures; every other draft reads the image placeholder in their place.
        ``windowed``: a hidden-state-reuse head attends to a VLM request's text positions alone
        (Sparrow's text-anchored window, ``HSRDraft``). ``measure_cost``: a model draft times its
        own drafted position on its own thread and hardware before it serves (``cost_probe``),
        and ``info`` reports it: what a target prices a draft deployment with before using it.
        ``quantization``: how the loaded ``model``'s weights are rounded (``model_store.load_causal_lm``).
        ``max_model_len``: the longest context served (None: the model's); on CUDA a loaded
        hidden-state-reuse head captures its graphs for the buckets up to it now
        (``head_graphs``), and a loaded draft LM reserves its cache at that length and captures
        its graphs where the device holds them (``_reserve_cache``), so that no request waits on a
        capture. ``trees``: the tree shapes requests start from, whose whole-tree graphs such a
        head captures then too."""
        self.name = name
        self.images = images
        self._worker = worker or ModelWorker(f"draft-{name}", threads=torch_threads)
        self._generators: dict[str, torch.Generator] = {}
        # A model-free draft keeps no per-session state: one instance serves every session.
        self._stateless: Draft | None = None
        self.pool: SessionPool | None = None
        self.vocab_size: int | None = None
        # Chains of a causal-LM draft are drafted for all of a call's sessions together.
        self._batched: BatchedDraftLM | None = None
        self.device = torch.device("cpu")
        self._features_size: int | None = None
        self._feature_layers: list[int] | None = None
        # A suffix draft learns from finished outputs: the target replica feeds it (``remember``).
        self.suffix: SuffixDraft | None = None
        self._head_graphs: HeadGraphs | None = None   # a hidden-state-reuse head's, on CUDA
        if make_draft is not None:
            probe = make_draft()
            self._needs_features = needs_features(probe)
            if self._needs_features and draft_model(probe) is not None:
                self._reads(draft_model(probe))
            self._adopt(draft_model(probe))
            if draft_model(probe) is None:
                self._stateless = probe
                self.suffix = probe if isinstance(probe, SuffixDraft) else None
            else:
                self.pool = SessionPool(make_draft, keep_idle=kv_sessions_idle)
                if ensemble:
                    self._ensemble(draft_model(probe), ensemble, tokenizer)
        elif model is None and method == "suffix":
            seed = answer_outputs(seed_outputs) if seed_outputs else None
            self._stateless = self.suffix = SuffixDraft(seed=seed)
            self._needs_features = False
        elif model is None:
            self._stateless = PromptLookupDraft()
            self._needs_features = False
        else:
            loaded = load_causal_lm(model, dtype=dtype, quantization=quantization)
            self._needs_features = isinstance(loaded.model, HSRHead)
            if self._needs_features:
                self._reads(loaded.model)
            self._adopt(loaded.model)
            self.pool = SessionPool(lambda: draft_from_model(name, loaded.model, windowed), keep_idle=kv_sessions_idle)
            if ensemble:
                self._ensemble(loaded.model, ensemble, loaded.tokenizer)
            if self._needs_features and (graphs := HeadGraphs.for_head(loaded.model)) is not None:
                self._head_graphs = graphs
                held = self._worker.call(graphs.capture_buckets, max_model_len, tuple(trees))
                logger.info("draft %s: %d graphs captured, up to %s positions", name, held, max_model_len or "all")
            elif self._batched is not None and self._batched.kv.graphs is not None:
                self._worker.call(self._reserve_cache, max_model_len)
        self.ms_per_position: float | None = None
        if measure_cost and (self.pool is not None or self._batched is not None):
            self.ms_per_position = self._worker.call(draft_ms_per_position, self.propose_now,
                                                     self.vocab_size or 1 << 15, self._features_size)
        logger.info("draft %s ready (%s)", name, model or ("in-process" if make_draft else "suffix, no model" if self.suffix
                                                           else "prompt lookup, no model"))

    def _ensemble(self, model, ensemble: dict, tokenizer) -> None:
        """Chains through a TABED ensemble of the draft LM's views (trees: the full view alone)."""
        if isinstance(model, HSRHead):
            raise ValueError(f"draft {self.name!r}: an ensemble mixes views of a draft LM; a hidden-state-reuse "
                             "head reads the target's states, which have one view")
        settings = {k: v for k, v in ensemble.items() if v is not None}
        marker = settings.pop("turn_marker", None)
        if marker is None:
            marker = user_turn_marker(tokenizer) if tokenizer is not None else []
        self._batched = EnsembleDraftLM(self.name, model, turn_marker=marker, **settings)
        if self._batched.reads_images:
            if self.images is None:
                raise ValueError(f"draft {self.name!r}: the views {', '.join(self._batched.views)} read pictures, "
                                 "which only a draft inside its VLM target's replica (or in-process) has")
            if self._batched.reads_captions:
                if self.images.captions is None:
                    raise ValueError(f"draft {self.name!r}: the caption view needs the VLM's tokenizer to caption "
                                     "pictures, and this image store was built without one")
                self.images.captions.readers.add(self.name)   # its requests' pictures get captioned
            self._batched.kv.images = self.images

    def _reserve_cache(self, max_model_len: int | None) -> None:
        """A draft LM on CUDA: its slots at the longest context served (or as many positions as
        its share of the device holds, ``kv_memory.draft_reservation``) and its graphs of decode
        and windows captured now; a longer context grows the cache, each growth dropping the
        graphs."""
        kv = self._batched.kv
        length = draft_reservation(kv.slots, max_model_len, device=kv.device, model_config=kv.model.config,
                                   dtype=kv.model.dtype)
        if length is None:
            logger.info("draft %s: its KV cache grows on demand (%d slots of %d positions take more than %.0f%% "
                        "of the device, or more than is free)", self.name, kv.slots, MIN_DRAFT_RESERVATION,
                        100 * DRAFT_KV_FRACTION)
            return
        kv.reserve(length)
        held = kv.capture_graphs(cuda_graphs.START_WIDTHS)
        logger.info("draft %s: %d KV slots of %d positions reserved, %d graphs captured", self.name, kv.slots,
                    length, held)

    def _reads(self, head) -> None:
        """A hidden-state-reuse head: which of the target's layers it reads, and their width."""
        self._feature_layers = feature_layers(head.config)
        self._features_size = len(self._feature_layers) * int(head.config.hidden_size)

    def _adopt(self, model) -> None:
        if model is not None:
            # config.vocab_size, not the output layer: a pruned head scatters its logits back to
            # the full vocabulary's ids.
            self.vocab_size = int(model.config.vocab_size)
            self.device = model.device
            if not isinstance(model, HSRHead):
                self._batched = BatchedDraftLM(self.name, model)

    @property
    def feature_layers(self) -> list[int] | None:
        """The target's hidden states this draft reads (``info``'s ``feature_layers``), None when
        it reads none or leaves the choice to the target's default."""
        return list(self._feature_layers) if self._needs_features and self._feature_layers else None

    @property
    def needs_features(self) -> bool:
        return bool(self._needs_features)

    async def info(self) -> dict:
        """What a target checks before it trusts this draft: whether proposals need its hidden
        states and which (``feature_layers``: indices into transformers' ``hidden_states``, sent
        side by side), and the vocabulary the draft's ids come from (None: the target's own, as
        prompt lookup copies them from the context)."""
        return {"needs_features": self._needs_features, "vocab_size": self.vocab_size,
                **({"feature_layers": self._feature_layers} if self._feature_layers else {}),
                **({"ms_per_position": self.ms_per_position} if self.ms_per_position is not None else {})}

    async def propose_batch(self, asks: list[ProposeRequest]) -> list[Proposal | NeedFeatures]:
        """One proposal per ask, in order. An HSR head that holds fewer of a session's target
        states than the ask assumes (another replica had the session) answers ``NeedFeatures``
        for that ask: send them again from there."""
        if self._stateless is not None:   # an n-gram search: cheaper than a thread hand-off
            return [self._propose_one(self._stateless, text_view(ask)) for ask in asks]
        return await self._worker.run(self._propose_pooled, asks)

    def propose_now(self, asks: list[ProposeRequest]) -> list[Proposal | NeedFeatures]:
        """``propose_batch`` on the calling thread, which must be the one the draft's model work runs
        on (the start-up cost probe, ``cost_probe``); the asks' sessions are released after."""
        try:
            if self._stateless is not None:
                return [self._propose_one(self._stateless, text_view(ask)) for ask in asks]
            return self._propose_pooled(asks)
        finally:
            for ask in asks:
                self._generators.pop(ask.session_id, None)
            if self.pool is not None:
                self._release_caches([ask.session_id for ask in asks])

    def keep_learning_of(self, previous: "DraftServer") -> None:
        """Carry what ``previous`` (the same draft, before its caches were dropped) learned across
        requests: a TABED ensemble's prior weights. Its KV caches and sessions stay behind."""
        if isinstance(self._batched, EnsembleDraftLM) and isinstance(previous._batched, EnsembleDraftLM):
            self._batched.prior = previous._batched.prior

    @property
    def worker(self):
        """The thread this draft's model work runs on (the target's, when it shares it)."""
        return self._worker

    @property
    def graphs_captured(self) -> int:
        """The CUDA graphs a hidden-state-reuse head holds (``head_graphs``); 0 for the others."""
        return 0 if self._head_graphs is None else self._head_graphs.captured

    @property
    def features_size(self) -> int | None:
        """The width of the target states a hidden-state-reuse draft reads per position (n·H for
        n layers); None for the others."""
        return self._features_size

    def _propose_pooled(self, asks: list[ProposeRequest]) -> list[Proposal | NeedFeatures]:
        replies: list[Proposal | NeedFeatures | None] = [None] * len(asks)
        chains = [i for i, ask in enumerate(asks) if ask.tree is None and ask.window > 0]
        # An ensemble builds each view from the context as it is; every other path reads text.
        chained = asks if isinstance(self._batched, EnsembleDraftLM) else None
        asks = [text_view(a) for a in asks]
        chained = chained or asks
        if self._batched is not None and chains:
            for start in range(0, len(chains), self._batched.max_sessions):
                part = chains[start:start + self._batched.max_sessions]
                try:
                    proposals = self._batched.propose_chains([chained[i] for i in part],
                                                             [self._generator(asks[i]) for i in part])
                except Exception as err:  # noqa: BLE001 - costs these requests their speculation
                    logger.warning("draft %s: batched proposal failed (%s: %s); those steps go plain",
                                   self.name, type(err).__name__, err)
                    proposals = [Proposal.empty() for _ in part]
                for i, proposal in zip(part, proposals):
                    replies[i] = proposal
        for i, ask in enumerate(asks):
            if replies[i] is None:
                with self.pool.using(ask.session_id, ask.context, ask.cache_salt) as draft:
                    replies[i] = self._propose_one(draft, ask)
        return replies

    def _propose_one(self, draft: Draft, ask: ProposeRequest) -> Proposal | NeedFeatures:
        try:
            return propose(draft, ask, self._generator(ask))
        except MissingFeatures as missing:
            return NeedFeatures(missing.have)
        except Exception as err:  # noqa: BLE001 - one bad proposal costs that request's speculation
            logger.warning("draft %s: proposal for %s failed (%s: %s); that step goes plain",
                           self.name, ask.session_id, type(err).__name__, err)
            return Proposal.empty()

    def _generator(self, ask: ProposeRequest) -> torch.Generator | None:
        if ask.params.greedy:
            return None
        # The draft's own randomness never changes the output distribution (the target's rejection
        # test corrects for q); the derived seed only makes runs repeatable.
        generator = self._generators.get(ask.session_id)
        if generator is None:
            # Bounded: a target that died never calls release(); its entry ages out here.
            while len(self._generators) >= MAX_GENERATORS:
                self._generators.pop(next(iter(self._generators)))
            generator = torch.Generator(device=self.device)
            if ask.seed is None:
                generator.seed()
            else:
                generator.manual_seed(ask.seed)
            self._generators[ask.session_id] = generator
        return generator

    async def release(self, session_ids: list[str], endings: dict | None = None) -> dict[str, dict[str, int]]:
        """The sessions ended: their caches become idle prefix caches. Returns, by session, what a
        TABED ensemble's session leaves to the cluster (``ensemble_carry``; sessions that leave
        nothing are absent): the target checks it (``ensemble_carry.released_counts``) and counts
        it with its statistics. ``endings``: by session, its request's final context
        (``ensemble_carry.ending_of``), from which an ensemble scores its last block; each is
        checked here (the target is another deployment) and a bad one is ignored."""
        for session_id in session_ids:
            self._generators.pop(session_id, None)
        if self.pool is None:
            return {}
        # On the model thread, which owns the caches.
        return await self._worker.run(self._release_caches, session_ids, endings)

    def _release_caches(self, session_ids: list[str], endings: dict | None = None) -> dict[str, dict[str, int]]:
        endings = endings if isinstance(endings, dict) else {}
        left = {}
        for session_id in session_ids:
            self.pool.release(session_id)
            if isinstance(self._batched, EnsembleDraftLM):
                counts = self._batched.release(session_id, valid_ending(endings.get(session_id)))
                if counts:
                    left[session_id] = counts
            elif self._batched is not None:
                self._batched.release(session_id)
        return left

    def check_health(self) -> None:
        self._worker.check()

