"""deploy/serve.yaml is the config `specserve up` deploys by default, and Ray accepts it."""

from pathlib import Path

import pytest
import yaml

from specserve.cluster.config import PROMPT_LOOKUP, TARGET_DEPLOYMENT, AppConfig, draft_deployment
from specserve.cluster.serve_config import (
    BUILDER,
    GRPC_MAX_MESSAGE_ENV,
    INGRESS_QUEUE,
    TARGET_REPLICAS,
    TARGET_THREADS,
    ZOO_DRAFTS,
    app_serve_config,
    cpus_requested,
    load_serve_config,
    local_ray_cpus,
    local_serve_config,
    imagegen_serve_config,
    multimodal_serve_config,
    proxy_env,
    video_serve_config,
    with_overrides,
)

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


def test_deploy_serve_yaml_is_the_local_default():
    assert yaml.safe_load(SERVE_YAML.read_text()) == local_serve_config(), (
        "deploy/serve.yaml drifted from specserve.cluster.serve_config.local_serve_config: regenerate it")


def test_deploy_serve_imagegen_yaml_is_the_reference_generator_config():
    path = SERVE_YAML.with_name("serve-imagegen.yaml")
    assert yaml.safe_load(path.read_text()) == imagegen_serve_config(), (
        "deploy/serve-imagegen.yaml drifted from specserve.cluster.serve_config.imagegen_serve_config: regenerate it")
    args = AppConfig.model_validate(imagegen_serve_config()["applications"][0]["args"])
    # The draft reads the conditional row inside the target replica; ADT-Tree adapts its trees.
    assert [(d.name, d.placement) for d in args.drafts] == [("scenes-imagegen-draft", "inside")]
    assert args.policy == "adt-tree"


def test_deploy_serve_multimodal_yaml_is_the_reference_vlm_config():
    path = SERVE_YAML.with_name("serve-multimodal.yaml")
    assert yaml.safe_load(path.read_text()) == multimodal_serve_config(), (
        "deploy/serve-multimodal.yaml drifted from specserve.cluster.serve_config.multimodal_serve_config: regenerate it")
    args = load_serve_config(path)["applications"][0]["args"]
    assert AppConfig.model_validate(args).target == "smollm2-vlm"


def test_deploy_serve_video_yaml_is_the_reference_video_model_config():
    path = SERVE_YAML.with_name("serve-video.yaml")
    assert yaml.safe_load(path.read_text()) == video_serve_config(), (
        "deploy/serve-video.yaml drifted from specserve.cluster.serve_config.video_serve_config: regenerate it")
    args = AppConfig.model_validate(load_serve_config(path)["applications"][0]["args"])
    assert args.target == "smollm2-vlm-video"
    # Sparrow's windowed head by default; the video draft reads the frames inside the replica.
    drafts = {d.name: d for d in args.drafts}
    assert args.default_draft == "smollm2-vlm-video-sparrow" and drafts[args.default_draft].windowed
    assert drafts["smollm2-vlm-video-draft"].ensemble.views == ["multimodal"]


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


def test_the_shipped_config_deploys_no_draft_replica_the_placement_puts_inside_the_target():
    config = local_serve_config()
    args = AppConfig.model_validate(config["applications"][0]["args"])
    # Every draft is placed by measurement (auto), which on one kind of hardware is inside the
    # target: so no draft deployment holds a CPU the target replicas need.
    assert {spec.placement for spec in args.drafts} == {"auto"}
    assert set(_num_cpus(config)) == {"ingress", TARGET_DEPLOYMENT}
    # What the CPUs pay for is what runs from the start: two one-thread target replicas and an
    # ingress's event loop (the replicas autoscaling adds wait for room: a node joining).
    assert cpus_requested(config) == pytest.approx(2 * 1 + 0.1)
    assert local_ray_cpus(config, cores=2) == 3
    assert local_ray_cpus(config, cores=16) == 16


def test_any_app_gets_an_entry_for_exactly_its_deployments_sized_by_its_threads():
    config = app_serve_config({"target": "/models/t", "torch_threads": 3, "drafts": [
        {"name": PROMPT_LOOKUP}, {"name": "lm", "model": "/models/d"}, {"name": "big", "model": "/models/b", "torch_threads": 2},
        {"name": "near", "model": "/models/d", "placement": "inside"},
        {"name": "measured", "model": "/models/d"}]})
    for spec in config["applications"][0]["args"]["drafts"][:3]:
        spec["placement"] = "separate"
    config = app_serve_config(config["applications"][0]["args"])
    args = AppConfig.model_validate(config["applications"][0]["args"])
    # Only drafts placed separate have deployments (an auto one is placed when the app is built).
    assert _num_cpus(config) == {"ingress": 0.1, "target": 3, "draft-prompt-lookup": 0.1, "draft-lm": 1, "draft-big": 2}
    assert {d.name: d.torch_threads for d in args.drafts} == {PROMPT_LOOKUP: None, "lm": 1, "big": 2, "near": None, "measured": None}
    default = app_serve_config({"target": "/models/t"})
    assert default["applications"][0]["args"]["torch_threads"] == _num_cpus(default)["target"] == TARGET_THREADS


def test_the_shipped_config_autoscales_the_target_and_keeps_the_ingress_beside_the_proxy():
    config = local_serve_config()
    assert config["proxy_location"] == "HeadOnly"
    entries = {d["name"]: d for d in config["applications"][0]["deployments"]}
    target = entries[TARGET_DEPLOYMENT]
    scaling = target["autoscaling_config"]
    assert scaling["min_replicas"] == TARGET_REPLICAS < scaling["max_replicas"]
    assert scaling["upscale_delay_s"] < scaling["downscale_delay_s"]
    # A removed replica finishes its streams (a longer one resumes elsewhere), bounded.
    assert target["graceful_shutdown_timeout_s"] > 0
    # Losing a worker node never loses the ingress, where streams resume: it runs with the proxy.
    assert entries["ingress"]["ray_actor_options"]["resources"] == {"node:__internal_head__": pytest.approx(0.001)}


@pytest.mark.parametrize("build", [local_serve_config, multimodal_serve_config, video_serve_config])
def test_the_local_configs_bound_the_ingress_queue_and_the_grpc_message_size(build):
    config = build()
    entries = {d["name"]: d for d in config["applications"][0]["deployments"]}
    # Past this many waiting at a proxy, a 503 at once (Ray reads -1 as no bound).
    assert entries["ingress"]["max_queued_requests"] == INGRESS_QUEUE > 0
    # Serve's gRPC proxy reads its limit from the head's environment only: what `ray start` gets.
    max_body = AppConfig.model_validate(config["applications"][0]["args"]).max_body_bytes
    assert 0 < int(proxy_env(config)[GRPC_MAX_MESSAGE_ENV]) <= max_body


def test_the_grpc_message_size_follows_the_apps_http_body_limit():
    config = app_serve_config({"target": "/models/t", "max_body_bytes": 1 << 20})
    assert proxy_env(config) == {GRPC_MAX_MESSAGE_ENV: str(1 << 20)}
    assert proxy_env({"applications": []}) == {}   # no specserve app: Serve's own default stands
