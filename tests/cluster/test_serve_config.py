"""deploy/serve.yaml is the config `specserve up` deploys by default, and Ray accepts it."""

from pathlib import Path

import pytest
import yaml

from specserve.cluster.config import PROMPT_LOOKUP, TARGET_DEPLOYMENT, AppConfig, draft_deployment
from specserve.cluster.serve_config import (
    BUILDER,
    DRAFT_MODEL_THREADS,
    TARGET_THREADS,
    ZOO_DRAFTS,
    app_serve_config,
    cpus_requested,
    load_serve_config,
    local_ray_cpus,
    local_serve_config,
    with_overrides,
)

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


def test_deploy_serve_yaml_is_the_local_default():
    assert yaml.safe_load(SERVE_YAML.read_text()) == local_serve_config(), (
        "deploy/serve.yaml drifted from specserve.cluster.serve_config.local_serve_config: regenerate it")


def test_ray_accepts_it_and_its_args_are_an_app_config():
    config = load_serve_config(SERVE_YAML)   # Ray's ServeDeploySchema
    app = config["applications"][0]
    assert app["import_path"] == BUILDER
    AppConfig.model_validate(app["args"])


def test_overrides_set_ports_and_redis_without_touching_the_original():
    base = local_serve_config()
    out = with_overrides(base, http_port=1, grpc_port=2, redis_url="redis://x:3/0")
    assert (out["http_options"]["port"], out["grpc_options"]["port"]) == (1, 2)
    assert out["applications"][0]["args"]["redis_url"] == "redis://x:3/0"
    assert "redis_url" not in base["applications"][0]["args"]
    # With a Redis the app builds a policy service; its entry makes its CPU count.
    assert _num_cpus(out)["policy"] == 0.1 and "policy" not in _num_cpus(base)
    assert cpus_requested(out) == pytest.approx(cpus_requested(base) + 0.1)
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(out)


def _num_cpus(config: dict) -> dict[str, float]:
    return {d["name"]: d["ray_actor_options"]["num_cpus"] for d in config["applications"][0]["deployments"]}


def test_each_model_asks_ray_for_the_threads_it_runs():
    config = local_serve_config()
    args = AppConfig.model_validate(config["applications"][0]["args"])
    cpus = _num_cpus(config)
    # Written out, not left to Ray's OMP_NUM_THREADS: the replica sets exactly this many.
    assert args.torch_threads == TARGET_THREADS == 1
    assert cpus[TARGET_DEPLOYMENT] == args.torch_threads
    models = [spec for spec in args.drafts if spec.model]
    assert [spec.name for spec in models] == list(ZOO_DRAFTS)
    for spec in models:
        assert spec.torch_threads == DRAFT_MODEL_THREADS
        assert cpus[draft_deployment(spec.name)] == spec.torch_threads, spec.name
    assert cpus[draft_deployment(PROMPT_LOOKUP)] < 1   # no model: an event loop


def test_the_local_ray_cluster_has_room_for_every_replica_on_two_cores():
    config = local_serve_config()
    # Two one-thread target replicas and 1 thread for each zoo draft, on 2 cores: more than the machine ...
    requested = cpus_requested(config)
    assert requested == pytest.approx(2 * 1 + 2 * 0.1 + 2 * 0.1 + 2 * 1)
    # ... so `specserve up` starts Ray with that many logical CPUs, and never fewer than the cores.
    assert local_ray_cpus(config, cores=2) == 5
    assert local_ray_cpus(config, cores=16) == 16


def test_any_app_gets_an_entry_for_exactly_its_deployments_sized_by_its_threads():
    config = app_serve_config({"target": "/models/t", "torch_threads": 3, "drafts": [
        {"name": PROMPT_LOOKUP}, {"name": "lm", "model": "/models/d"}, {"name": "big", "model": "/models/b", "torch_threads": 2},
        {"name": "near", "model": "/models/d", "colocated": True}]})
    args = AppConfig.model_validate(config["applications"][0]["args"])
    assert _num_cpus(config) == {"ingress": 0.1, "target": 3, "draft-prompt-lookup": 0.1, "draft-lm": 1, "draft-big": 2}
    assert {d.name: d.torch_threads for d in args.drafts} == {PROMPT_LOOKUP: None, "lm": 1, "big": 2, "near": None}
    default = app_serve_config({"target": "/models/t"})
    assert default["applications"][0]["args"]["torch_threads"] == _num_cpus(default)["target"] == TARGET_THREADS
