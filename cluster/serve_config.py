"""The Serve config (Ray's ``ServeDeploySchema``) of the local default application.

``deploy/serve.yaml`` is this config written out (a test keeps the two equal), so that
``specserve up`` with no ``--config``, ``serve run deploy/serve.yaml`` and ``serve deploy`` all
deploy the same thing, and an installed specserve needs no file from the repository.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from specserve.cluster.config import INGRESS_DEPLOYMENT, PROMPT_LOOKUP, TARGET_DEPLOYMENT, draft_deployment

APP_NAME = "specserve"
BUILDER = "specserve.cluster.app:build_app"
GRPC_SERVICER = "specserve.router.specserve_pb2_grpc.add_SpecServeServicer_to_server"


# The package's trained drafts (specserve zoo), each its own deployment, selectable by name.
ZOO_DRAFTS = ("smollm2-draft-2l", "smollm2-hsr")


def local_serve_config(http_port: int = 8000, grpc_port: int = 9000) -> dict:
    """The reference target with prompt lookup and the zoo's drafts, sized for one small machine
    (2 cores here).

    The target asks for one logical CPU but runs torch on two threads: its forwards never overlap
    the draft's or the ingress's work (a step waits for its proposal), so it may use every core.
    It stays at one replica here because a second one would only split the same two cores; the
    ingress and the draft, which are cheap, scale out under load.
    """

    def deployment(name: str, num_cpus: float, max_ongoing: int, max_replicas: int, target_ongoing: int) -> dict:
        return {
            "name": name,
            "max_ongoing_requests": max_ongoing,
            "ray_actor_options": {"num_cpus": num_cpus},
            "autoscaling_config": {"min_replicas": 1, "max_replicas": max_replicas,
                                   "target_ongoing_requests": target_ongoing},
            "health_check_period_s": 10,
            "health_check_timeout_s": 30,
        }

    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": BUILDER,
            "args": {"dtype": "auto", "torch_threads": 2, "default_draft": PROMPT_LOOKUP, "default_window": 4,
                     "drafts": [{"name": PROMPT_LOOKUP}, *({"name": name, "model": name} for name in ZOO_DRAFTS)]},
            "deployments": [
                deployment(INGRESS_DEPLOYMENT, 0.1, 256, 2, 32),
                deployment(TARGET_DEPLOYMENT, 1, 16, 1, 8),
                deployment(draft_deployment(PROMPT_LOOKUP), 0.1, 64, 2, 32),
                # A draft model's forward waits for no one but its step: a fraction of a core each.
                *(deployment(draft_deployment(name), 0.2, 64, 1, 32) for name in ZOO_DRAFTS),
            ],
        }],
    }


def load_serve_config(path: Path) -> dict:
    """A Serve config file, checked with Ray's own schema (so a typo fails here, not mid-deploy)."""
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(Path(path).read_text())
    ServeDeploySchema.model_validate(config)
    return config


def with_overrides(config: dict, *, http_port: int | None = None, grpc_port: int | None = None,
                   redis_url: str | None = None) -> dict:
    """A copy of ``config`` with the ports and the Redis URL that ``specserve up`` chose."""
    config = yaml.safe_load(yaml.safe_dump(config))   # deep copy of plain data
    if http_port is not None:
        config.setdefault("http_options", {})["port"] = http_port
    if grpc_port is not None:
        config.setdefault("grpc_options", {})["port"] = grpc_port
    if redis_url is not None:
        for app in config.get("applications", []):
            if app.get("import_path") == BUILDER:
                app.setdefault("args", {})["redis_url"] = redis_url
    return config
