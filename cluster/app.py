"""The Serve application builder: ingress -> target (with the drafts placed inside it) -> a
deployment per draft placed separately (``cluster/placement.py``), and with a Redis URL the
policy service (ingress -> policy for ``GET /v1/policy``).

    serve run specserve.cluster.app:app                  # defaults: the reference models
    serve run deploy/serve.yaml                          # the same builder, args and deployments from YAML

Deployments get their defaults here; Serve's config file overrides them by name (``ingress``,
``target``, ``draft-<name>``, ``policy``), which is where replicas, CPUs/GPUs and autoscaling are set.
"""

from __future__ import annotations

from dataclasses import replace

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from specserve.cluster.config import INGRESS_DEPLOYMENT, INSIDE, POLICY_DEPLOYMENT, TARGET_DEPLOYMENT, AppConfig, draft_deployment
from specserve.cluster.placement import plan
from specserve.data.prompts import topic_corpus
from specserve.policies.policy_service import PolicyService
from specserve.policies.replica_learning import ReplicaLearningFactory
from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.draft_deployment import DraftDeployment
from specserve.replicas.target_deployment import TargetConfig, TargetDeployment
from specserve.ingress.deployment import Ingress
from specserve.ingress.prefix_affinity import ROUTER_CLASS as PREFIX_AFFINITY_ROUTER
from specserve.router.retrain import retrain
from specserve.router.router_factory import RouterFactory

# A target replica's draft calls (each for all of its step's requests) should reach the draft
# replica that holds those sessions' KV caches: hash on the target replica's id.
# Any replica is still correct (the cache is rebuilt from the tokens), so a reshuffle on scaling
# costs one rebuild per session, not a wrong answer.
SESSION_AFFINITY = RequestRouterConfig(
    request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
)
# A request should reach the target replica whose free KV slots hold its prompt's prefix (a
# repeated prompt, a chat's next turn, a shared system prompt), while the load allows.
PREFIX_AFFINITY = RequestRouterConfig(request_router_class=PREFIX_AFFINITY_ROUTER)


def build_app(args: AppConfig) -> Application:
    # Serve calls a builder with exactly one argument: the app's args.
    config = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    placements = plan(config)
    # A draft placed inside is built in each target replica from its spec; the others are deployments.
    drafts = {
        spec.name: spec.model_dump() if placements[spec.name].where == INSIDE else DraftDeployment.options(
            name=draft_deployment(spec.name), request_router_config=SESSION_AFFINITY
        ).bind(spec.name, spec.model, config.dtype, spec.torch_threads, config.kv_sessions_idle,
               ensemble=spec.ensemble.model_dump() if spec.ensemble else None, windowed=spec.windowed,
               measure_cost=True, quantization=spec.quantization, max_model_len=config.max_model_len,
               trees=(config.tree_shape,))
        for spec in config.drafts
    }
    target_config = TargetConfig(
        model=config.target, dtype=config.dtype, torch_threads=config.torch_threads, share_cores=config.share_cores,
        kv_sessions_idle=config.kv_sessions_idle, max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
        stats_name=config.model_id, default_draft=config.default_draft, max_model_len=config.max_model_len,
        default_tree=config.tree_shape,
        gpu_memory_utilization=config.gpu_memory_utilization,
        draft_ahead=config.draft_ahead, grammar_draft=config.grammar_draft,
    )
    router = RouterFactory(config.router_explore, topic_corpus, redis_url=config.redis_url,
                           redis_prefix=config.redis_prefix) if config.router else None
    target = TargetDeployment.options(name=TARGET_DEPLOYMENT, request_router_config=PREFIX_AFFINITY).bind(
        target_config, policy=PolicyByRequest(config.policy), drafts=drafts,
        learning=ReplicaLearningFactory(config.redis_url, config.redis_prefix, config.tree_explore), router=router,
    )
    policy = None
    if config.redis_url:
        policy = PolicyService.options(name=POLICY_DEPLOYMENT).bind(config.redis_url, config.redis_prefix,
                                                                    router_retrain=retrain if config.router else None)
    ingress = replace(config.ingress_config(), placement={name: p.to_dict() for name, p in placements.items()})
    return Ingress.options(name=INGRESS_DEPLOYMENT).bind(target, ingress, policy)


# The reference models with every default, for `serve run specserve.cluster.app:app` and
# `serve build specserve.cluster.app:app` (binding loads nothing: models load in the replicas).
app = build_app(AppConfig())
