"""A real multi-node Ray cluster on this host: a head and a worker node (two raylets, as
``ray start`` makes them, token authentication on), the shipped config's layout (Serve's proxy
and the ingress on the head) with the nodes labelled by Ray resources: one target replica per
``specserve_target`` node, the draft LM (placed ``separate``) only on the ``specserve_draft`` node.

In order, on one cluster: a burst scales the target out onto the other node and idle brings it
back, with no request failing either way; then the worker's raylet is SIGKILLed under streams:
no stream is lost (each resumes on the head's target, greedy output token for token the
in-process target's, float32), a new request is answered within seconds, and the draft whose
only node went away comes back when a node with its label joins.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from conftest import first_layers_draft, local_stack, stream_chat, wait_until
from specserve.cluster import local
from specserve.cluster.config import TARGET_DEPLOYMENT, draft_deployment
from specserve.cluster.redis_server import free_port
from specserve.cluster.serve_config import app_serve_config, local_serve_config, with_resources
from specserve.replicas.engine import SpecEngine, speculative_generate
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.target import Target

pytestmark = [pytest.mark.reference, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
DRAFT_LM = "first-2-layers"
PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain, step by step and in detail, how a bicycle gear system works.",
    "Write a Python class for a bank account with deposit, withdraw and a history of transactions.",
    "Describe a walk through a busy market in a city you imagine, with every sound and smell.",
]
# Prompts no replica has seen: the prefix-affinity router sends them to the least loaded replica.
FRESH = [
    "Write a letter from a sailor to his sister about the first week at sea.",
    "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
    "Write a JavaScript function that debounces another function, with comments.",
]
NEW_TOKENS = 160
TARGET_SLOTS = 12   # max_ongoing_requests of a target replica: one replica holds what two ran after a node loss
TARGET_LABEL, DRAFT_LABEL = "specserve_target", "specserve_draft"


def _config(draft_path: str) -> dict:
    args = {**local_serve_config()["applications"][0]["args"], "dtype": "float32", "max_batch": TARGET_SLOTS,
            "drafts": [{"name": "prompt-lookup"}, {"name": DRAFT_LM, "model": draft_path, "placement": "separate"}]}
    config = app_serve_config(args, target_replicas=1)
    entries = {d["name"]: d for d in config["applications"][0]["deployments"]}
    target = with_resources(entries[TARGET_DEPLOYMENT], {TARGET_LABEL: 1})   # one per labelled node
    target.update(max_ongoing_requests=TARGET_SLOTS)
    # The shipped policy's shape (out on load, back at idle) on a test's time scale. The downscale
    # delay outlasts a replica's start (load, the start-up cost probes): a burst that ends while the
    # new replica starts must not stop it before it runs.
    target["autoscaling_config"].update(min_replicas=1, max_replicas=2, target_ongoing_requests=2,
                                        upscale_delay_s=1, downscale_delay_s=45, look_back_period_s=3,
                                        metrics_interval_s=1)
    with_resources(entries[draft_deployment(DRAFT_LM)], {DRAFT_LABEL: 1})
    return config


def _start_node(head: bool, gcs_port: int, labels: dict[str, int]) -> int:
    """A raylet on this host (``ray start``), its CPUs and labels given; returns its node-manager
    port, by which its raylet process is found."""
    manager_port = free_port()
    node = ["--num-cpus", "2", "--resources", json.dumps(labels), "--node-manager-port", str(manager_port),
            "--disable-usage-stats"]
    if head:
        local.start_head("--port", str(gcs_port), *node)
    else:
        result = local._ray("start", "--address", f"127.0.0.1:{gcs_port}", *node, timeout_s=300)
        assert result.returncode == 0, result.stdout + result.stderr
    return manager_port


def _raylet(manager_port: int) -> psutil.Process:
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "raylet" and f"--node_manager_port={manager_port}" in (proc.info["cmdline"] or []):
            return proc
    raise LookupError(f"no raylet on node-manager port {manager_port}")


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(dtype="float32")


@pytest.fixture(scope="module")
def expected(engine):
    target = Target(engine.loaded.model)
    return [speculative_generate(target, None, engine.encode(p), NEW_TOKENS, SamplingParams(),
                                 eos_token_ids=engine.loaded.eos_token_ids).token_ids for p in PROMPTS + FRESH]


@pytest.fixture(scope="module")
def cluster(engine, tmp_path_factory):
    """(the served stack, {"head" | "worker": node-manager port}, the GCS port)."""
    assert not local._ray_running(), "a Ray cluster is already running on this host"
    home = tmp_path_factory.mktemp("specserve-multinode")
    first_layers_draft(engine, home / DRAFT_LM)
    if local.auth_token() is None:
        local._ray("get-auth-token", "--generate", timeout_s=60, check=True)
    gcs_port = free_port()
    nodes = {}
    try:   # whatever fails, no node (nor a dashboard holding its port) outlives the module
        nodes["head"] = _start_node(True, gcs_port, {TARGET_LABEL: 1})
        nodes["worker"] = _start_node(False, gcs_port, {TARGET_LABEL: 1, DRAFT_LABEL: 1})
        with local_stack(_config(str(home / DRAFT_LM)), home) as state:
            yield state, nodes, gcs_port
    finally:
        local._ray("stop", "--force", timeout_s=120)


def chat_body(i: int, max_tokens: int = NEW_TOKENS) -> dict:
    """Prompt ``i``: of PROMPTS cycled, or FRESH[i - 100] for i >= 100."""
    prompt = FRESH[i - 100] if i >= 100 else PROMPTS[i % len(PROMPTS)]
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}


class Streams:
    """Streamed chat requests on threads; each one's token ids, last spec and error, and whether
    it has produced a token yet."""

    def __init__(self, url: str):
        self.url, self.pool = url, concurrent.futures.ThreadPoolExecutor(32)
        self.started: list[threading.Event] = []
        self.futures: list[concurrent.futures.Future] = []

    def add(self, i: int, max_tokens: int = NEW_TOKENS) -> None:
        started = threading.Event()
        self.started.append(started)
        self.futures.append(self.pool.submit(self._one, chat_body(i, max_tokens), started))

    def _one(self, body: dict, started: threading.Event) -> tuple[list[int], dict | None, dict | None]:
        return stream_chat(self.url, body, on_first=started.set, timeout=600)

    def results(self) -> list[tuple[list[int], dict | None, dict | None]]:
        try:
            return [f.result(timeout=600) for f in self.futures]
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _replica_nodes(deployment: str) -> list[str]:
    """The node ids of the deployment's live replica actors."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=10_000)
    return sorted(a.node_id for a in actors if a.name and f"#{deployment}#" in a.name)


def _labelled(label: str) -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(label)}


def _running(deployment: str) -> int:
    return local.app_status()["deployments"][deployment]["replicas"]


def _timeline(since: float, deployment: str = TARGET_DEPLOYMENT) -> tuple[float, int]:
    return round(time.monotonic() - since, 1), _running(deployment)


def test_a_burst_scales_the_target_out_onto_the_other_node_and_idle_brings_it_back(cluster, expected):
    state, _, _ = cluster
    assert wait_until(lambda: _running(TARGET_DEPLOYMENT), lambda n: n == 1, timeout=60, interval=1) == 1
    start, timeline = time.monotonic(), []
    streams = Streams(state.http_url)
    for i in range(8):   # 8 at once on 1 replica, 2 ongoing per replica wanted
        streams.add(i)
    assert wait_until(lambda: timeline.append(_timeline(start)) or timeline[-1][1], lambda n: n == 2, timeout=120,
                      interval=1) == 2, timeline
    # One target replica on each labelled node: the placement constraint holds as it scales.
    nodes = _replica_nodes(TARGET_DEPLOYMENT)
    assert len(set(nodes)) == 2 and set(nodes) <= _labelled(TARGET_LABEL), nodes
    assert _replica_nodes(draft_deployment(DRAFT_LM)) and set(_replica_nodes(draft_deployment(DRAFT_LM))) <= _labelled(DRAFT_LABEL)
    for i, (ids, _, error) in enumerate(streams.results()):
        assert error is None and ids == expected[i % len(PROMPTS)], (i, error)
    # Idle, but for one request at a time: back to the minimum, and the request in flight while
    # a replica drains is served.
    trickle = []
    while _running(TARGET_DEPLOYMENT) > 1 and time.monotonic() - start < 240:
        timeline.append(_timeline(start))
        one = Streams(state.http_url)
        one.add(len(trickle) % len(PROMPTS), max_tokens=24)
        trickle.extend(one.results())
    timeline.append(_timeline(start))
    assert _running(TARGET_DEPLOYMENT) == 1, timeline
    for i, (ids, _, error) in enumerate(trickle):
        assert error is None and ids == expected[i % len(PROMPTS)][:24], (i, error)
    print("target replicas over time (s, running):", timeline)


def test_losing_a_worker_node_loses_no_stream_and_its_draft_returns_with_a_node(cluster, expected):
    state, nodes, gcs_port = cluster
    streams = Streams(state.http_url)
    for i in range(6):
        streams.add(i)
    assert wait_until(lambda: _running(TARGET_DEPLOYMENT), lambda n: n == 2, timeout=120, interval=1) == 2
    for i in range(100, 100 + len(FRESH)):   # new prompts go to the least loaded: the new replica
        streams.add(i)
    want = [expected[i % len(PROMPTS)] for i in range(6)] + expected[len(PROMPTS):]
    for started in streams.started:
        assert started.wait(timeout=180)

    _raylet(nodes["worker"]).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    answered = httpx.post(state.http_url + "/v1/chat/completions", json={**chat_body(2, 8), "stream": False}, timeout=120)
    first_answer_s = time.monotonic() - killed
    assert answered.status_code == 200 and answered.json()["choices"][0]["token_ids"] == expected[2][:8]
    # The survivor has room for the resumed streams and this one (TARGET_SLOTS).
    assert first_answer_s < 20, first_answer_s

    results = streams.results()
    for i, (ids, _, error) in enumerate(results):
        assert error is None and ids == want[i], (i, error)   # zero lost streams
    resumed = sum(1 for _, spec, _ in results if (spec or {}).get("resumed"))
    assert resumed, "no stream was on the lost node's target"
    print(f"worker raylet killed: {resumed} of {len(results)} streams resumed, all complete; "
          f"a new request answered {first_answer_s:.1f} s after the kill")

    # The draft's only labelled node is gone; a node with the label joins and it runs again.
    assert wait_until(lambda: _running(draft_deployment(DRAFT_LM)), lambda n: n == 0, timeout=120, interval=1) == 0
    nodes["worker"] = _start_node(False, gcs_port, {TARGET_LABEL: 1, DRAFT_LABEL: 1})
    joined = time.monotonic()
    assert wait_until(lambda: _running(draft_deployment(DRAFT_LM)), lambda n: n == 1, timeout=180, interval=1) == 1
    print(f"the draft replica ran again {time.monotonic() - joined:.1f} s after a labelled node joined")
    done = httpx.post(state.http_url + "/v1/chat/completions",
                      json={**chat_body(1, 24), "stream": False, "spec": {"draft": DRAFT_LM}}, timeout=120)
    assert done.status_code == 200 and done.json()["choices"][0]["token_ids"] == expected[1][:24]
