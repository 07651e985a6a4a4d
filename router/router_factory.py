"""Builds a target replica's draft router where the replica runs (Serve ships this picklable
factory with the target's arguments, as it ships ``policies.replica_learning``'s).

The TF-IDF topic basis depends on the target's tokenizer, so it is made on the replica's machine:
read from the local cache when present, else fitted from ``corpus`` (texts the caller supplies:
the application passes ``data.prompts.topic_corpus``, prompts no benchmark uses) and cached.
Without a corpus (or when it cannot be read, e.g. the dataset packages are not installed) the
router runs on length, perplexity and repetition alone, and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass

from specserve.policies.redis_stats import RedisStats
from specserve.router.draft_router import LearnedDraftRouter
from specserve.router.route_learning import RouteLearning
from specserve.router.route_metrics import RouteMetrics
from specserve.replicas.prompt_ids import encode_chat
from specserve.router.topics import TopicBasis, cached_basis, fit_texts

logger = logging.getLogger("ray.serve")


def encode_user(tokenizer, text: str) -> list[int]:
    """A corpus text as the ingress encodes a one-message chat (so template tokens weigh alike)."""
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


# Task topics the priors are kept under (``TopicBasis.topic``): about as many as the kinds of
# prompt the corpus holds, few enough that each topic's prior fills within minutes of traffic.
TASK_TOPICS = 4


def topic_basis(name: str, tokenizer, corpus: Callable[[], Iterable[str]] | None, dims: int,
                topics: int = TASK_TOPICS) -> TopicBasis | None:
    """The cached or freshly fitted basis for target ``name``, with ``topics`` task topics; None
    without a corpus."""
    if corpus is None:
        return None
    try:
        return cached_basis(f"{name}-d{dims}-k{topics}",
                            lambda: fit_texts(corpus(), lambda t: encode_user(tokenizer, t), dims, clusters=topics))
    except Exception as err:  # noqa: BLE001 - topics improve routing; their absence must not stop a replica
        logger.warning("router: no TF-IDF topics (%s: %s); routing on length, perplexity and repetition",
                       type(err).__name__, err)
        return None


@dataclass(frozen=True)
class ReplicaRouter:
    """A target replica's draft router and, with Redis, its learning with the cluster."""

    router: LearnedDraftRouter
    learning: RouteLearning | None = None

    def background(self) -> list[Coroutine]:
        """The replica's background tasks for the router: sending outcomes, loading weights."""
        return [] if self.learning is None else self.learning.background()


@dataclass(frozen=True)
class RouterFactory:
    """Picklable; called in each target replica. With ``redis_url`` the router learns with the
    cluster (``route_learning.py``): the ``ReplicaRouter``'s background tasks send outcomes and
    load weights. ``metrics``: its decisions on Ray's metrics endpoint (``route_metrics.py``)."""

    explore: float = 0.2
    corpus: Callable[[], Iterable[str]] | None = None
    topic_dims: int = 8
    topics: int = TASK_TOPICS
    redis_url: str | None = None
    redis_prefix: str = "specserve"

    metrics: bool = True

    def __call__(self, target: str, drafts: Sequence[str], tokenizer) -> ReplicaRouter:
        basis = topic_basis(target, tokenizer, self.corpus, self.topic_dims, self.topics)
        router = LearnedDraftRouter(drafts, basis, topic_dims=self.topic_dims, explore=self.explore)
        if self.metrics:
            router.on_outcome.append(RouteMetrics(target).observe)
        learning = None
        if self.redis_url:
            learning = RouteLearning(router, target, RedisStats(self.redis_url, self.redis_prefix))
        return ReplicaRouter(router, learning)
