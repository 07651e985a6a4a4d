"""The Serve config (Ray's ``ServeDeploySchema``) of the local default application.

``deploy/serve.yaml`` is this config written out (a test keeps the two equal), so that
``specserve up`` with no ``--config``, ``serve run deploy/serve.yaml`` and ``serve deploy`` all
deploy the same thing, and an installed specserve needs no file from the repository.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import yaml

from specserve.cluster.config import (INGRESS_DEPLOYMENT, POLICY_DEPLOYMENT, PROMPT_LOOKUP, SEPARATE, SHIPPED_ANSWERS, SUFFIX,
                                      TARGET_DEPLOYMENT, AppConfig, draft_deployment)
from specserve.replicas.image_engine import GENERATOR_DRAFT, REFERENCE_GENERATOR
from specserve.replicas.vlm import REFERENCE_VIDEO_VLM, REFERENCE_VLM

APP_NAME = "specserve"
BUILDER = "specserve.cluster.app:build_app"
GRPC_SERVICER = "specserve.ingress.specserve_pb2_grpc.add_SpecServeServicer_to_server"


# The package's trained drafts (specserve zoo), selectable by name; placed by measurement.
ZOO_DRAFTS = ("smollm2-draft-2l", "smollm2-eagle3")
# The suffix draft, its index seeded with the target's own answers shipped with specserve.
SUFFIX_DRAFT = {"name": SUFFIX, "method": SUFFIX, "seed_outputs": SHIPPED_ANSWERS}

# CPU accounting, in this one place: a deployment that runs a model asks Ray for as many CPUs as
# it runs torch threads (num_cpus = torch_threads), so Ray's books show what the replicas really
# use. The thread counts are written into the app's args, not left to Ray's OMP_NUM_THREADS, so
# that the two numbers cannot drift apart.
# The target runs ONE thread on a 2-core machine: served, it decodes faster with one thread than
# with two, because the ingress, the HTTP proxy and Ray's own processes need a core too, and an
# OpenMP team that spans every core stalls at each barrier whenever one of its threads is
# descheduled (docs/design.md §6). Give it cores - 1 (or its GPU) on a bigger machine.
TARGET_THREADS = 1
# ... and the second core runs a second target replica instead: two one-thread replicas share
# nothing but memory bandwidth, so they use both cores without OpenMP barriers and serve more
# under load than one replica on two threads (figures: docs/benchmarks.md §2.0c).
TARGET_REPLICAS = 2
DRAFT_MODEL_THREADS = 1   # a draft model: one thread (a small forward gains little from two)
MODEL_FREE_CPUS = 0.1     # the ingress and prompt lookup: an event loop and no model
# Prompt + completion at most on the local stack: each target replica's KV cache for its 20 slots
# is allocated for this many positions at start (0.9 GB in bfloat16), so memory stays flat.
LOCAL_MAX_MODEL_LEN = 2048
TARGET_QUEUE = 32         # requests an ingress replica holds for the target beyond its replicas' slots
# Requests an ingress replica holds at once. A slot is a coroutine (the target's queue bounds the
# real work), and a client trickling its body holds one until the body deadline: many slots keep
# a few hundred such clients from holding everyone else up for that long.
INGRESS_ONGOING = 1024
# Requests each proxy holds for the ingress beyond its replicas' slots; past it the proxy answers
# 503 at once instead of holding connections without end.
INGRESS_QUEUE = 256
# Serve's gRPC proxy takes messages of up to 2 GiB unless its process finds this variable set:
# Serve's gRPCOptions have no such field, so it belongs in the environment of the Ray node that
# runs the proxies (the head, proxy_location HeadOnly), set before `ray start` (``proxy_env``).
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
# Target autoscaling (Serve's autoscaling_config): from ``target_replicas`` (what this machine
# holds, running from the start: a replica takes seconds to load and probe, too long to wait for
# under a burst) up to twice that when each replica averages more than TARGET_ONGOING requests
# (its batch is then full enough that another replica pays). Up after UPSCALE_DELAY_S of such load,
# down after DOWNSCALE_DELAY_S below it: a replica's start costs more than a short lull saves.
# Replicas beyond what the cluster has room for wait (pending) until a node joins: on KubeRay its
# autoscaler adds one for them (deploy/rayservice.yaml), on one machine they never start and the
# running ones serve. A removed replica stops taking requests and finishes those it has for up to
# GRACEFUL_SHUTDOWN_S; a stream still running then resumes on another replica (ingress/resumable.py).
TARGET_ONGOING = 8
UPSCALE_DELAY_S = 10.0
DOWNSCALE_DELAY_S = 300.0
GRACEFUL_SHUTDOWN_S = 300.0
# Serve's proxies run on the head node only (proxy_location HeadOnly): the ingress runs there too,
# so that losing a worker node never loses the streams' edge (the ingress is where a request
# resumes after its target replica is lost). Ray gives every head node this resource.
HEAD_NODE = {"node:__internal_head__": 0.001}
REQUEST_TIMEOUT_S = 900   # a request past this is cancelled: it leaves its batch and frees its KV


def _drafts(args: dict) -> list[dict]:
    """The app's draft specs; ``AppConfig``'s default when the args give none."""
    return args.get("drafts", [{"name": PROMPT_LOOKUP}])


def separate(spec: dict) -> bool:
    """Whether a draft spec runs as its own deployment, as the config file must know before the
    build: a draft placed ``separate``. An ``auto`` one is placed at build time by measurement
    (``cluster/placement.py``); on one kind of hardware that is inside the target, and should it
    come out separate its deployment runs with the code's defaults."""
    return spec.get("placement") == SEPARATE


def model_threads(args: dict) -> dict[str, int | None]:
    """The torch threads of each deployment that runs a model, by deployment name: the target's
    ``torch_threads`` and that of each draft model placed as its own deployment (a draft inside
    the target runs on the target's model thread). ``None``: not set, so the replica runs as
    many as it asks Ray for (Ray's ``OMP_NUM_THREADS`` = ``num_cpus``)."""
    threads: dict[str, int | None] = {TARGET_DEPLOYMENT: args.get("torch_threads")}
    for spec in _drafts(args):
        if spec.get("model") and separate(spec):
            threads[draft_deployment(spec["name"])] = spec.get("torch_threads")
    return threads


def app_serve_config(args: dict, http_port: int = 8000, grpc_port: int = 9000, target_replicas: int = 1) -> dict:
    """A Serve config for the application with these ``AppConfig`` args, sized for one small
    machine: one entry for each deployment ``build_app`` creates (Serve refuses an entry for a
    deployment the app does not have), and each model's ``num_cpus`` equal to its torch threads
    (``TARGET_THREADS`` and ``DRAFT_MODEL_THREADS`` unless the args give them).

    ``target_replicas`` target replicas run from the start and autoscaling adds as many again
    under load (``TARGET_ONGOING``); the ingress, on the head node with the proxy, and prompt
    lookup, which are cheap, scale out under load.
    """
    args = copy.deepcopy(args)
    args["torch_threads"] = args.get("torch_threads") or TARGET_THREADS
    for spec in args.get("drafts", []):
        if spec.get("model") and separate(spec):
            spec["torch_threads"] = spec.get("torch_threads") or DRAFT_MODEL_THREADS
    threads = model_threads(args)

    def deployment(name: str, num_cpus: float, max_ongoing: int, max_replicas: int, target_ongoing: int,
                   min_replicas: int = 1) -> dict:
        return {
            "name": name,
            "max_ongoing_requests": max_ongoing,
            "ray_actor_options": {"num_cpus": num_cpus},
            "autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                   "target_ongoing_requests": target_ongoing},
            "health_check_period_s": 10,
            "health_check_timeout_s": 30,
        }

    target = deployment(TARGET_DEPLOYMENT, threads[TARGET_DEPLOYMENT], 16, 2 * target_replicas, TARGET_ONGOING,
                        target_replicas)
    target["autoscaling_config"].update(upscale_delay_s=UPSCALE_DELAY_S, downscale_delay_s=DOWNSCALE_DELAY_S)
    target["graceful_shutdown_timeout_s"] = GRACEFUL_SHUTDOWN_S
    # Back-pressure: past this many requests waiting in one ingress replica for a target slot, a
    # new one is a 503 with Retry-After, not an unbounded queue.
    target["max_queued_requests"] = TARGET_QUEUE
    drafts = []
    for spec in _drafts(args):
        name = draft_deployment(spec["name"])
        if not separate(spec):
            continue
        if name in threads:   # a draft model's forward waits for no one but its step
            drafts.append(deployment(name, threads[name], 64, 1, 32))
        else:                 # prompt lookup: an n-gram search
            drafts.append(deployment(name, MODEL_FREE_CPUS, 64, 2, 32))
    ingress = with_resources(deployment(INGRESS_DEPLOYMENT, MODEL_FREE_CPUS, INGRESS_ONGOING, 2, 32), HEAD_NODE)
    ingress["max_queued_requests"] = INGRESS_QUEUE
    return {
        "proxy_location": "HeadOnly",
        # A request still running after REQUEST_TIMEOUT_S is cancelled (and leaves its batch).
        "http_options": {"host": "127.0.0.1", "port": http_port, "request_timeout_s": REQUEST_TIMEOUT_S},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER],
                         "request_timeout_s": REQUEST_TIMEOUT_S},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": BUILDER,
            "args": args,
            "deployments": [
                ingress,
                target,
                *drafts,
            ],
        }],
    }


def proxy_env(config: dict) -> dict[str, str]:
    """The environment the head node's ``ray start`` needs for this Serve config: the gRPC proxy's
    largest message no larger than the smallest ``max_body_bytes`` of specserve's applications
    (the HTTP body limit), so that a gRPC request cannot be larger than an HTTP one."""
    default = AppConfig.model_fields["max_body_bytes"].default
    limits = [(app.get("args") or {}).get("max_body_bytes", default)
              for app in config.get("applications", []) if app.get("import_path") == BUILDER]
    return {GRPC_MAX_MESSAGE_ENV: str(min(limits))} if limits else {}


def with_resources(entry: dict, resources: dict[str, float]) -> dict:
    """A deployment entry whose replicas also need these Ray resources (a node label such as
    ``{"target_node": 1}`` given to ``ray start --resources``, or a node's own ``node:...``)."""
    options = entry.setdefault("ray_actor_options", {})
    options["resources"] = {**options.get("resources", {}), **resources}
    return entry


def local_serve_config(http_port: int = 8000, grpc_port: int = 9000) -> dict:
    """The reference target with prompt lookup, the suffix draft and the zoo's drafts, sized for one small machine
    (2 cores here): two target replicas of one thread each, every draft placed by measurement
    (inside the targets, on this hardware: no draft deployment holds a CPU the targets need)."""
    return app_serve_config({
        "dtype": "auto", "torch_threads": TARGET_THREADS, "default_draft": PROMPT_LOOKUP, "default_window": 4,
        "max_model_len": LOCAL_MAX_MODEL_LEN,
        "drafts": [{"name": PROMPT_LOOKUP}, dict(SUFFIX_DRAFT), *({"name": name, "model": name} for name in ZOO_DRAFTS)],
    }, http_port, grpc_port, TARGET_REPLICAS)


def multimodal_serve_config(http_port: int = 8000, grpc_port: int = 9000) -> dict:
    """The reference VLM (smollm2-vlm: the reference target reading pictures) with prompt lookup,
    the suffix draft, the EAGLE-3 head (which reads the language model's hidden states, image
    tokens included) and the VLM's own draft LM reading the pictures' image tokens (its
    ``multimodal`` view, inside each target replica), sized as the local default;
    ``deploy/serve-multimodal.yaml``."""
    return app_serve_config({
        "target": REFERENCE_VLM, "dtype": "auto", "torch_threads": TARGET_THREADS, "default_draft": PROMPT_LOOKUP,
        "default_window": 4, "max_model_len": LOCAL_MAX_MODEL_LEN,
        "drafts": [{"name": PROMPT_LOOKUP}, dict(SUFFIX_DRAFT), {"name": "smollm2-eagle3", "model": "smollm2-eagle3"},
                   {"name": "smollm2-vlm-draft", "model": "smollm2-vlm-draft", "ensemble": {"views": ["multimodal"]}}],
    }, http_port, grpc_port, TARGET_REPLICAS)


def video_serve_config(http_port: int = 8000, grpc_port: int = 9000) -> dict:
    """The reference video model (smollm2-vlm-video: the reference VLM taught clips) with prompt
    lookup, the suffix draft, its own draft LM reading the frames' image tokens (``multimodal``
    view, inside each target replica) and, by default, Sparrow's head drafting with the text-anchored
    window (VATA: its cost per drafted token stays flat as frames grow, where a draft reading the
    frames pays for each; docs/benchmarks.md §8.20), sized as the local default;
    ``deploy/serve-video.yaml``."""
    return app_serve_config({
        "target": REFERENCE_VIDEO_VLM, "dtype": "auto", "torch_threads": TARGET_THREADS,
        "default_draft": "smollm2-vlm-video-sparrow", "default_window": 4, "max_model_len": LOCAL_MAX_MODEL_LEN,
        "drafts": [{"name": PROMPT_LOOKUP}, dict(SUFFIX_DRAFT),
                   {"name": "smollm2-vlm-video-draft", "model": "smollm2-vlm-video-draft",
                    "ensemble": {"views": ["multimodal"]}},
                   {"name": "smollm2-vlm-video-sparrow", "model": "smollm2-vlm-video-sparrow", "windowed": True}],
    }, http_port, grpc_port, TARGET_REPLICAS)


def imagegen_serve_config(http_port: int = 8000, grpc_port: int = 9000) -> dict:
    """The reference image generator (scenes-imagegen: a class-conditional Llama over a VQ
    tokenizer's image tokens, ``replicas/imagegen.py``) with its distilled draft inside each target
    replica and ADT-Tree adapting every picture's trees from its neighbours' (Horizontal Repeat);
    ``deploy/serve-imagegen.yaml``. Pictures come from POST /v1/images/generations."""
    return app_serve_config({
        "target": REFERENCE_GENERATOR, "dtype": "auto", "torch_threads": TARGET_THREADS,
        "default_draft": GENERATOR_DRAFT, "default_window": 4, "policy": "adt-tree",
        "drafts": [{"name": GENERATOR_DRAFT, "model": GENERATOR_DRAFT, "placement": "inside"}],
    }, http_port, grpc_port, TARGET_REPLICAS)


def cpus_requested(config: dict) -> float:
    """The logical CPUs a Serve config's deployments ask for with the replicas they start with
    (each entry's ``num_cpus`` times its ``min_replicas``, or ``num_replicas``, or 1). Replicas
    autoscaling adds beyond those need room the cluster has or gains (a node added for them).

    On one machine this can be more than its cores (two one-thread target replicas and a draft
    model placed ``separate``, on 2 cores), and ``specserve up`` starts its local Ray cluster with this many logical CPUs rather
    than shrinking each model's share below the threads it runs. The cores are time-shared, not
    double-booked: a target replica's step first waits for its drafts' proposals and then runs
    its verify forward, so its threads and the drafts' are not busy at the same time (the drafts
    of one step run together: 1 + 1 threads). The extra logical CPUs say exactly that, in one
    place, instead of a fraction per deployment that hides how many threads it runs. Deployments
    the config does not list run with the code's defaults and are not counted.
    """
    total = 0.0
    for app in config.get("applications", []):
        for entry in app.get("deployments") or []:
            cpus = (entry.get("ray_actor_options") or {}).get("num_cpus")
            if cpus is None:
                continue
            replicas = (entry.get("autoscaling_config") or {}).get("min_replicas") or entry.get("num_replicas") or 1
            total += cpus * (replicas if isinstance(replicas, int) else 1)   # num_replicas may be "auto"
    return total


def local_ray_cpus(config: dict, cores: int) -> int:
    """The logical CPUs of a local Ray cluster started for ``config``: what the replicas it starts
    with ask for, and never fewer than the machine's cores."""
    return max(cores, math.ceil(cpus_requested(config) - 1e-9))


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
                # With a Redis the app has a policy service: its entry makes it count in the CPUs
                # the local cluster is sized for (an event loop, no model), and keeps it on the
                # head node beside the ingress, where it takes no worker's room from a target.
                deployments = app.setdefault("deployments", [])
                if not any(d.get("name") == POLICY_DEPLOYMENT for d in deployments):
                    deployments.append({"name": POLICY_DEPLOYMENT, "num_replicas": 1,
                                        "ray_actor_options": {"num_cpus": MODEL_FREE_CPUS, "resources": dict(HEAD_NODE)},
                                        "health_check_period_s": 10, "health_check_timeout_s": 30})
    return config
