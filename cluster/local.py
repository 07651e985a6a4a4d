"""``specserve up / status / down``: a local Ray cluster, a Redis server and the application.

``up`` joins the Ray cluster this machine is part of, or starts one (``ray start --head`` with
token authentication on, as Ray 2.60 wants), starts a Redis server unless given one, deploys the
Serve config through the dashboard's REST API (what ``serve deploy`` does) and waits until every
deployment is healthy. What it started is written to a state file, so that ``down`` stops
exactly that and nothing a user started themselves.

The Redis ``up`` starts requires a random password (``redis_server``); the application and this
module reach it through its URL, kept in the state file, which only its owner may read (0600).
Status and logs show the URL redacted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Ray 2.60 reads its authentication mode once, when ray is first imported: set it before that
# (the CLI and the tests import this module first). Calls that must work whatever the import
# order (the ray CLI, the dashboard's REST API) get the mode or the token passed explicitly.
os.environ.setdefault("RAY_AUTH_MODE", "token")

from specserve.cluster.prometheus_server import SERVICE_DISCOVERY_FILE, PrometheusServer, prometheus_binary  # noqa: E402
from specserve.cluster.config import TARGET_DEPLOYMENT  # noqa: E402
from specserve.cluster.redis_server import RedisServer, free_port, ping, redact  # noqa: E402
from specserve.cluster.serve_config import (  # noqa: E402
    APP_NAME,
    local_ray_cpus,
    local_serve_config,
    proxy_env,
    with_overrides,
)

DASHBOARD_PORT = 8265


def state_dir() -> Path:
    """``$SPECSERVE_HOME``, else ``~/.cache/specserve/run``: the state file and the Redis log."""
    return Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve" / "run")).expanduser()


@dataclass
class LocalState:
    ray_started: bool = False
    http_url: str = ""
    grpc_address: str = ""
    dashboard_url: str = ""
    metrics_url: str = ""
    redis_url: str = ""
    redis_pid: int | None = None   # set only when specserve started the Redis server
    prometheus_url: str = ""
    prometheus_pid: int | None = None
    app_name: str = APP_NAME

    @classmethod
    def path(cls) -> Path:
        return state_dir() / "state.json"

    @classmethod
    def load(cls) -> "LocalState | None":
        try:
            return cls(**json.loads(cls.path().read_text()))
        except FileNotFoundError:
            return None

    def save(self) -> None:
        # It holds the Redis password: owner only, also when an older file was more open.
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(asdict(self), indent=2))


def _ray_cli() -> str:
    """The ``ray`` of this environment first: another one on PATH may be another Ray version."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


# Serve's proxy forwards each request (and each streamed piece) to the ingress over gRPC instead of
# Ray actor calls, which cost the proxy and the ingress more CPU per streamed piece (figures:
# docs/benchmarks.md §2.5). An explicit value in the environment wins.
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def _ray(*args: str, timeout_s: float = 120, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**CLUSTER_ENV, **os.environ, **(env or {}), "RAY_AUTH_MODE": "token"}
    return subprocess.run([_ray_cli(), *args], capture_output=True, text=True, timeout=timeout_s, env=env, check=check)


def auth_token() -> str | None:
    """The cluster token, where Ray itself looks: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token")).expanduser()
    return path.read_text().strip() if path.exists() else None


# What the ray CLI says when no cluster runs on this host (Ray 2.60's wording).
NO_CLUSTER = "Could not find any running Ray instance"
# What ``ray start`` says when its own wait for the node to register ran out (a busy host).
NODE_START_TIMED_OUT = "timed out during startup"


def _ray_running() -> bool:
    """Whether a Ray cluster runs on this host: ``ray status`` answers, or fails for another reason
    than finding none (a cluster that is starting, stopping or overloaded is still one: a second
    started beside it would share its ports)."""
    result = _ray("status", timeout_s=60)
    return result.returncode == 0 or NO_CLUSTER not in result.stdout + result.stderr


def _port_held(port: int, wait_s: float = 0.0, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` is still held after waiting up to ``wait_s`` for it to be freed."""
    deadline = time.monotonic() + wait_s
    while True:
        with socket.socket() as sock:   # as Ray tests its dashboard port: address reuse on
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                return False
            except OSError:
                if time.monotonic() >= deadline:
                    return True
        time.sleep(0.5)


def start_head(*args: str, env: dict | None = None, dashboard_port: int | None = None) -> None:
    """``ray start --head`` with its dashboard on ``dashboard_port`` (``DASHBOARD_PORT``), and ``args``.

    A held dashboard port is refused first: Ray would start without a dashboard, and the deploy
    would reach whatever holds the port (a dashboard left by a cluster that failed to start
    answers 500 to everything). A start that fails stops what it left (``ray stop --force``: no
    other cluster runs here, or the caller would have joined it); one that failed only because
    Ray's own wait for the node ran out is tried once more."""
    dashboard_port = dashboard_port or DASHBOARD_PORT
    for attempt in range(2):
        # A dashboard the failed attempt left may hold its port a moment after ``ray stop``.
        if _port_held(dashboard_port, wait_s=30.0 if attempt else 0.0):
            raise RuntimeError(f"port {dashboard_port}, the Ray dashboard's, is in use: by a dashboard left behind "
                               "by a Ray cluster that is gone (`ray stop --force` stops it), or by another program")
        try:
            result = _ray("start", "--head", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                          *args, timeout_s=300, env=env)
        except subprocess.TimeoutExpired as timeout:
            said = f"no answer in {timeout.timeout:.0f} s"
        else:
            if result.returncode == 0:
                return
            said = result.stdout + result.stderr
        _ray("stop", "--force", timeout_s=120)
        if NODE_START_TIMED_OUT not in said:
            break
    raise RuntimeError(f"`ray start --head` failed:\n{said}")


def _machine_cpus() -> int:
    """The CPUs ``ray start`` would give the node by itself (it reads cgroup limits, which
    ``os.cpu_count`` does not)."""
    try:
        from ray._private.utils import get_num_cpus   # private in Ray 2.60

        return int(get_num_cpus())
    except (ImportError, AttributeError):
        return os.cpu_count() or 1


def _start_ray(metrics_port: int, num_cpus: int, prometheus_url: str | None = None,
               env: dict[str, str] | None = None) -> None:
    """``num_cpus``: Ray's logical CPUs, which may exceed the cores (``local_ray_cpus``);
    ``prometheus_url``: where the dashboard reads metrics from (Ray's ``RAY_PROMETHEUS_HOST``);
    ``env``: more of the head's environment (``serve_config.proxy_env``: the proxies run there)."""
    if auth_token() is None:
        _ray("get-auth-token", "--generate", timeout_s=60, check=True)
    env = {**(env or {}), **({"RAY_PROMETHEUS_HOST": prometheus_url} if prometheus_url else {})}
    start_head("--metrics-export-port", str(metrics_port), "--num-cpus", str(num_cpus), "--disable-usage-stats",
               env=env)


def deploy(config: dict, dashboard_url: str) -> None:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    token = auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    ServeSubmissionClient(dashboard_url, headers=headers).deploy_applications(config)


def app_status(app_name: str = APP_NAME) -> dict:
    """``{"status", "message", "deployments": {name: {"status", "replicas", "message"}}}`` from Serve."""
    from ray import serve

    status = serve.status()
    app = status.applications.get(app_name)
    if app is None:
        return {"status": "NOT_STARTED", "message": f"no application {app_name!r}", "deployments": {}}
    return {
        "status": str(app.status.value if hasattr(app.status, "value") else app.status),
        "message": app.message,
        "deployments": {
            name: {"status": str(d.status.value if hasattr(d.status, "value") else d.status),
                   "replicas": d.replica_states.get("RUNNING", 0), "replica_states": dict(d.replica_states),
                   "message": d.message}
            for name, d in app.deployments.items()
        },
    }


def connect() -> None:
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    if ray.is_initialized():
        return
    if not is_token_auth_enabled() and auth_token() is not None:
        raise RuntimeError("ray was imported before RAY_AUTH_MODE=token was set, so this process cannot join the "
                           "token-authenticated cluster: import specserve.cluster.local before ray, or export "
                           "RAY_AUTH_MODE=token")
    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)


def wait_healthy(app_name: str, timeout_s: float, on_progress: Callable[[dict], None] = lambda s: None) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = app_status(app_name)
        on_progress(status)
        if status["status"] == "RUNNING" and all(d["status"] == "HEALTHY" for d in status["deployments"].values()):
            return status
        if status["status"] == "DEPLOY_FAILED":
            raise RuntimeError(f"the application failed to deploy: {status['message']}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the application was not healthy after {timeout_s:.0f} s: {json.dumps(status)}")
        time.sleep(1.0)


def ensure_redis(state: LocalState, redis_url: str | None = None) -> None:
    """``redis_url`` when it answers; else the Redis of ``state`` when it still answers; else a
    new password-protected one (``redis_server``). Saves the state once it has started one, so
    that ``down`` stops it whatever happens next."""
    if redis_url is not None:
        if not ping(redis_url, timeout_s=3.0):
            raise ConnectionError(f"no Redis answers at {redact(redis_url)}: start it, or leave out --redis-url "
                                  "and specserve starts one")
        state.redis_url, state.redis_pid = redis_url, None
    elif not (state.redis_url and ping(state.redis_url)):
        server = RedisServer.start(state_dir())
        state.redis_url, state.redis_pid = server.url, server.pid
        state.save()


def up(config: dict | None = None, redis_url: str | None = None, http_port: int = 8000, grpc_port: int = 9000,
       timeout_s: float = 600.0, on_progress: Callable[[dict], None] = lambda s: None,
       prometheus: bool = False) -> LocalState:
    """``prometheus``: also start a Prometheus server scraping the cluster (``prometheus_server``);
    the Ray dashboard reads from it when ``up`` starts Ray (a running cluster keeps its own setting)."""
    config = config or local_serve_config()
    state = LocalState.load() or LocalState()
    if prometheus:
        prometheus_binary()   # missing: say so before anything starts
        if state.prometheus_url and not PrometheusServer(state.prometheus_url, state.prometheus_pid or 0).ready():
            state.prometheus_url, state.prometheus_pid = "", None   # gone since: start another
    ensure_redis(state, redis_url)
    config = with_overrides(config, http_port=http_port, grpc_port=grpc_port, redis_url=state.redis_url)
    prometheus_port = free_port() if prometheus and not state.prometheus_url else None
    if not _ray_running():
        metrics_port = free_port()
        # Each model asks Ray for the CPUs it runs threads on, which on one machine add up to
        # more than its cores (the target and its drafts take turns within a step; see
        # serve_config.cpus_requested): Ray gets that many logical CPUs, so every replica the
        # config starts with can be placed (those autoscaling adds wait for room). A cluster this
        # machine already belongs to is used as it is.
        _start_ray(metrics_port, local_ray_cpus(config, _machine_cpus()),
                   f"http://127.0.0.1:{prometheus_port}" if prometheus_port else state.prometheus_url or None,
                   env=proxy_env(config))
        state.ray_started = True
        state.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    state.dashboard_url = state.dashboard_url or f"http://127.0.0.1:{DASHBOARD_PORT}"
    state.save()   # from here on `down` can clean up whatever happens next

    app_name = config["applications"][0]["name"]
    http = config.get("http_options", {})
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host == "0.0.0.0" else host
    state.http_url = f"http://{host}:{http.get('port', http_port)}"
    state.grpc_address = f"{host}:{config.get('grpc_options', {}).get('port', grpc_port)}"
    state.app_name = app_name
    state.save()
    deploy(config, state.dashboard_url)
    connect()
    if prometheus_port:
        import ray

        temp_dir = Path(ray._private.worker._global_node.get_temp_dir_path())   # private in Ray 2.60
        server = PrometheusServer.start(state_dir(), temp_dir / SERVICE_DISCOVERY_FILE, prometheus_port)
        state.prometheus_url, state.prometheus_pid = server.url, server.pid
        state.save()
    wait_healthy(app_name, timeout_s, on_progress)
    return state


def status() -> dict:
    state = LocalState.load()
    if state is None:
        raise RuntimeError("specserve is not up here (no state file at "
                           f"{LocalState.path()}): run `specserve up`")
    connect()
    application = app_status(state.app_name)
    return {
        "application": application,
        "http": state.http_url + "/v1",
        "grpc": state.grpc_address,
        "dashboard": state.dashboard_url,
        "metrics": state.metrics_url or None,
        "redis": {"url": redact(state.redis_url), "pid": state.redis_pid, "up": ping(state.redis_url)},
        "prometheus": state.prometheus_url or None,
        "placement": draft_placement(state.http_url),
        "cluster_learning": cluster_learning(state.http_url),
        "kv": {name: target_kv(state.app_name, name) for name, d in application["deployments"].items()
               if name == TARGET_DEPLOYMENT and d["replicas"]},
    }


# What ``TargetDeployment.load`` says of a replica's KV capacity.
KV_FIELDS = ("kv_slots", "kv_max_len", "kv_capacity_tokens", "kv_sized_by")
STEP_FIELDS = ("cuda_graphs", "fused_elementwise")   # how its steps run, where a replica reports it


def target_kv(app_name: str, deployment: str = TARGET_DEPLOYMENT, timeout_s: float = 10.0) -> dict | None:
    """The KV capacity of the target replica one call reaches (``KV_FIELDS`` of its ``load``,
    and ``STEP_FIELDS``: its CUDA graphs and fused kernels); replicas share the configuration,
    but one on a device with less free memory may hold fewer slots. None when no replica answers
    in time."""
    from ray import serve

    try:
        load = serve.get_deployment_handle(deployment, app_name).load.remote().result(timeout_s=timeout_s)
        return {key: load[key] for key in KV_FIELDS + STEP_FIELDS if key in load}
    except Exception:  # noqa: BLE001 - a status report names what it cannot reach, whatever the reason
        return None


def draft_placement(http_url: str, timeout_s: float = 5.0) -> dict | None:
    """Where each draft runs and why (``GET /v1/models``' ``placement``); None when the ingress
    does not answer."""
    import httpx

    from specserve.ingress.auth import client_headers

    try:
        response = httpx.get(http_url + "/v1/models", headers=client_headers(), timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0].get("placement")
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def cluster_learning(http_url: str, timeout_s: float = 5.0) -> str | None:
    """Whether the replicas learn together, as the application says it (``GET /v1/policy``'s
    ``cluster_learning``: "on", or "off: ..." with what to set); None when the ingress does not answer.
    Asked of the running application: only it knows the Redis URL it was built with."""
    import httpx

    from specserve.ingress.auth import client_headers

    try:
        response = httpx.get(http_url + "/v1/policy", headers=client_headers(), timeout=timeout_s)
        if response.status_code == 503 and response.json()["error"]["code"] == "policy_service_unavailable":
            return "on, but the policy service is not answering: no new snapshot until it is back"
        response.raise_for_status()
        return response.json()["cluster_learning"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def _leave_serve() -> None:
    """Before this process leaves a cluster: shut down the deployment handles it made and drop
    Serve's cached controller client.

    A handle's router keeps pushing autoscaling metrics from a background thread; after
    ``ray.shutdown`` its next ``ray.wait`` makes Ray auto-start a fresh local cluster inside
    this process, which a later ``up`` then takes for a cluster to join (with the wrong CPUs)
    and whose ``ray stop`` kills this process (the test suite died that way, exit 1 mid-run).
    The client cache is keyed by the driver's job id, which the first job on the next cluster
    reuses: Serve would call the stopped cluster's controller."""
    from ray.serve import context

    client = getattr(context, "_global_client", None)   # private in Ray 2.60
    if client is not None:
        try:
            client.shutdown_cached_handles()
        except Exception:  # noqa: BLE001 - the cluster may already be gone; the handles go with us
            pass
    disconnect = getattr(context, "_disconnect", None)   # private in Ray 2.60
    if disconnect is not None:
        disconnect()


def down() -> list[str]:
    """Stop what ``up`` started; returns what was stopped."""
    state = LocalState.load()
    if state is None:
        return []
    stopped = []
    import ray

    if ray.is_initialized():   # leave the cluster before stopping it, or its raylet dies under us
        _leave_serve()
        ray.shutdown()
    if state.ray_started:
        _ray("stop", "--force")
        # `ray stop` can return while the GCS still answers: an `up` right after would take the
        # dying cluster for one to join, and find its CPUs only partly free.
        deadline = time.monotonic() + 60
        while _ray_running() and time.monotonic() < deadline:
            time.sleep(1)
        stopped.append("ray (started by specserve)")
    elif _ray_running():
        from ray import serve

        connect()
        serve.delete(state.app_name)
        _leave_serve()
        ray.shutdown()
        stopped.append(f"serve application {state.app_name}")
    if state.redis_pid:
        RedisServer(state.redis_url, state.redis_pid).stop()
        stopped.append(f"redis-server pid {state.redis_pid}")
    if state.prometheus_pid:
        PrometheusServer(state.prometheus_url, state.prometheus_pid).stop()
        stopped.append(f"prometheus pid {state.prometheus_pid}")
    LocalState.path().unlink(missing_ok=True)
    return stopped
