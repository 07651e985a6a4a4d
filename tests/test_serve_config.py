"""deploy/serve.yaml is the config `specserve up` deploys by default, and Ray accepts it."""

from pathlib import Path

import yaml

from specserve.cluster.config import AppConfig
from specserve.cluster.serve_config import BUILDER, load_serve_config, local_serve_config, with_overrides

SERVE_YAML = Path(__file__).parent.parent / "deploy" / "serve.yaml"


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
