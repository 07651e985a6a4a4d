"""Faults, bad input and API keys on a real local Ray cluster: two target replicas, prompt
lookup and a real-weights draft LM as deployments, a real redis-server and the policy service,
API keys required. Replicas are killed with ``ray.kill`` while requests stream; every greedy
output must still equal the in-process target-only greedy output token for token (float32), or
end with a retriable error, never a 500 and never a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import first_layers_draft, local_stack, stream_chat, wait_until
from specserve.cluster import local
from specserve.cluster.serve_config import app_serve_config, local_serve_config
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.target import Target
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress import specserve_pb2_grpc
from specserve.replicas.engine import SpecEngine, speculative_generate

pytestmark = [pytest.mark.reference, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
DRAFT_LM = "first-2-layers"
KEY = "sk-test-8d1f0c2e"
WRONG_KEY = "sk-wrong-77aa21"
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise in one sentence: The quick brown fox jumps over the lazy dog. The dog did not react.",
    "List five colours of the rainbow, one per line.",
    "Explain in two sentences why the sky is blue.",
    "Repeat after me: the rain in Spain stays mainly in the plain.",
    "Write a haiku about a cold morning.",
]
NEW_TOKENS = 40
LONG_ASK = "Write a long story, at least 500 words, about a lighthouse keeper and a storm."
TARGET_SLOTS = 4      # max_ongoing_requests (= max_batch) of each target replica
TARGET_QUEUE = 8      # max_queued_requests at the (one) ingress replica (a burst waits here while
                      # Serve's router picks replicas, so much smaller would turn bursts away)
RESUME_TIMEOUT_S = 45
EXPLORE = 1.0         # the router's exploration weight (LinUCB's β) in this stack


def _config(draft_path: str, keys_file: str) -> dict:
    args = {**local_serve_config()["applications"][0]["args"], "dtype": "float32", "max_batch": TARGET_SLOTS,
            "api_keys_file": keys_file, "resume_timeout_s": RESUME_TIMEOUT_S,
            "drafts": [{"name": "prompt-lookup"}, {"name": DRAFT_LM, "model": draft_path, "placement": "separate"}],
            # Wide enough a bonus that the separate draft LM, dearer than prompt lookup and
            # predicted no better before it is observed, gets explored (the exploration test).
            "router_explore": EXPLORE}
    config = app_serve_config(args, target_replicas=2)
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    deployments["target"].update(max_ongoing_requests=TARGET_SLOTS, max_queued_requests=TARGET_QUEUE)
    # Two replicas, whatever room the machine has: the back-pressure arithmetic counts on it.
    deployments["target"]["autoscaling_config"].update(max_replicas=2)
    # One ingress replica, so the back-pressure arithmetic is one queue.
    deployments["ingress"]["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    return config


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(dtype="float32")


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    home = tmp_path_factory.mktemp("specserve-faults")
    first_layers_draft(engine, home / DRAFT_LM)
    keys = home / "api-keys"
    keys.write_text(f"# test keys\n{KEY}\n")
    with local_stack(_config(str(home / DRAFT_LM), str(keys)), home) as state:
        yield state


@pytest.fixture(scope="module")
def expected(engine):
    """In-process target-only greedy output for each prompt, chat-rendered, NEW_TOKENS long at most."""
    target = Target(engine.loaded.model)
    return [speculative_generate(target, None, engine.encode(p), NEW_TOKENS, SamplingParams(),
                                 eos_token_ids=engine.loaded.eos_token_ids).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.grpc_address) as channel:
        yield specserve_pb2_grpc.SpecServeStub(channel)


def headers(key: str | None = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def chat_body(i: int, spec: dict | None = None, stream: bool = False, max_tokens: int = NEW_TOKENS) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, "return_token_ids": True, "spec": spec or {}}


def streamed(url: str, body: dict, on_first=None) -> tuple[list[int], dict | None, dict | None]:
    """(token ids, the last chunk's spec, an in-band error) of one streamed chat request."""
    return stream_chat(url, body, headers(), on_first)


def text_of(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def replicas(deployment: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"])


def kill(name: str) -> None:
    import ray

    namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=False)


def serving_states() -> dict:
    return {n: d["replica_states"] for n, d in local.app_status()["deployments"].items()}


# ---- API keys and limits -----------------------------------------------------------------------


def test_every_route_but_health_needs_the_key_over_http_and_grpc(served, stub, expected, engine):
    url = served.http_url
    routes = [("GET", "/v1/models", None), ("GET", "/v1/policy", None), ("GET", "/v1/routing/recent", None),
              ("POST", "/v1/chat/completions", chat_body(0)),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})]
    for method, path, body in routes:
        for key in (None, WRONG_KEY):
            response = httpx.request(method, url + path, json=body, headers=headers(key), timeout=60)
            assert response.status_code == 401, (path, key, response.text)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    assert httpx.get(url + "/v1/models", headers=headers(), timeout=60).json()["data"][0]["id"] == MODEL
    assert httpx.get(url + "/v1/routing/recent", headers={"x-api-key": KEY}, timeout=60).status_code == 200
    done = httpx.post(url + "/v1/chat/completions", json=chat_body(0), headers=headers(), timeout=300).json()
    assert done["choices"][0]["token_ids"] == expected[0]

    request = pb.CompletionRequest(model=MODEL, prompt="hi", max_tokens=2)
    for metadata in ((), (("authorization", f"Bearer {WRONG_KEY}"),)):
        for call in (stub.Complete, lambda r, **kw: list(stub.CompleteStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    out = stub.Complete(request, timeout=300, metadata=(("authorization", f"Bearer {KEY}"),))
    assert len(out.token_ids) == 2


def test_keys_never_reach_a_log(served):
    import ray

    # The logs of the cluster this process joined (``session_latest`` can point at another
    # cluster's session, or at one already cleaned up).
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"   # private in Ray 2.60
    assert logs.is_dir() and any(logs.glob("serve/replica_*")), logs
    for path in logs.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert KEY.encode() not in content and WRONG_KEY.encode() not in content, path


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(served):
    huge = {"model": MODEL, "prompt": "x" * (5 << 20), "max_tokens": 1}
    response = httpx.post(served.http_url + "/v1/completions", json=huge, headers=headers(), timeout=120)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_max_model_len_bounds_prompt_plus_completion(served):
    response = httpx.post(served.http_url + "/v1/chat/completions", json={**chat_body(0), "max_tokens": 2040},
                          headers=headers(), timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and "2048" in error["message"]
    listed = httpx.get(served.http_url + "/v1/models", headers=headers(), timeout=60).json()["data"][0]
    assert listed["max_model_len"] == 2048


def test_a_full_target_answers_503_with_retry_after_and_serves_the_rest(served):
    """2 replicas x 4 slots + 8 queued: of 28 requests at once, the ones beyond are turned away
    at once with Retry-After; every accepted one is served; nothing fails otherwise."""
    body = chat_body(2, {"draft": "none"}, max_tokens=24)

    def one(_):
        return httpx.post(served.http_url + "/v1/chat/completions", json=body, headers=headers(), timeout=300)

    with concurrent.futures.ThreadPoolExecutor(28) as pool:
        responses = list(pool.map(one, range(28)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503}, codes
    busy = [r for r in responses if r.status_code == 503]
    assert busy, "28 at once must exceed 2 x 4 slots + 8 queued"
    assert codes.count(200) >= 2 * TARGET_SLOTS, codes
    for r in busy:
        assert "retry-after" in r.headers, (r.headers, r.text)
        assert int(r.headers["retry-after"]) > 0 and r.json()["error"]["code"] == "unavailable"
    assert one(0).status_code == 200


def test_a_full_target_answers_grpc_unavailable_with_a_retry_after_trailer(served, stub):
    request = pb.CompletionRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=PROMPTS[2])],
                                   max_tokens=24, temperature=0, spec=pb.SpecOptions(draft="none"))

    def one(_):
        try:
            stub.Complete(request, timeout=300, metadata=(("authorization", f"Bearer {KEY}"),))
            return None
        except grpc.RpcError as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(28) as pool:
        errors = [e for e in pool.map(one, range(28)) if e is not None]
    assert errors, "28 at once must exceed 2 x 4 slots + 8 queued"
    assert len(errors) <= 28 - 2 * TARGET_SLOTS, [e.code() for e in errors]
    for err in errors:
        trailer = dict(err.trailing_metadata() or ())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and int(trailer["retry-after"]) > 0, (err.code(), trailer)
        assert "retry in" in err.details()


# ---- one client's values never hurt another -------------------------------------------------------

# Temperatures the API admits whose float32 form underflows (1e-45 is subnormal, 5e-324 is 0, 1e-300
# is 0): dividing logits by them overflows, and a NaN once failed every request of the step.
POISON_TEMPERATURES = [1e-300, 5e-324, 1e-45]


def test_poison_sampling_values_fail_alone_over_http_and_grpc(served, stub, expected):
    """Six greedy streams run while requests with underflowing temperatures arrive over HTTP and
    gRPC (through the separate draft LM, whose q they also reach): every innocent stream ends with
    its exact output and was never resumed; each poison request is answered 200 or 400."""
    innocent: dict[int, tuple] = {}
    poison_codes: list = []

    def stream(i: int) -> None:
        innocent[i] = streamed(served.http_url, chat_body(i, stream=True))

    def poison_http(t: float) -> None:
        body = {**chat_body(1, {"draft": DRAFT_LM, "window": 3}, max_tokens=16), "temperature": t}
        poison_codes.append(httpx.post(served.http_url + "/v1/chat/completions", json=body, headers=headers(),
                                       timeout=300).status_code)

    def poison_grpc(t: float) -> None:
        request = pb.CompletionRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=PROMPTS[3])],
                                       max_tokens=16, temperature=t, spec=pb.SpecOptions(draft=DRAFT_LM, window=3))
        try:
            list(stub.CompleteStream(request, timeout=300, metadata=(("authorization", f"Bearer {KEY}"),)))
            poison_codes.append(200)
        except grpc.RpcError as err:
            poison_codes.append(err.code())

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream, i) for i in range(len(PROMPTS))]
        time.sleep(1.0)   # the innocent streams are running
        poisons = [pool.submit(poison_http, t) for t in POISON_TEMPERATURES]
        poisons += [pool.submit(poison_grpc, t) for t in POISON_TEMPERATURES]
        for future in [*streams, *poisons]:
            future.result()
    for i, (ids, spec, error) in sorted(innocent.items()):
        assert error is None and ids == expected[i], (i, error)
        assert "resumed" not in spec, (i, spec)
    assert set(poison_codes) <= {200, 400, grpc.StatusCode.INVALID_ARGUMENT}, poison_codes
    assert len(poison_codes) == 2 * len(POISON_TEMPERATURES)


def test_a_grpc_message_larger_than_an_http_body_is_refused_before_the_ingress_holds_it(stub):
    request = pb.CompletionRequest(model=MODEL, prompt="x" * (64 << 20), max_tokens=1)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Complete(request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
    assert time.monotonic() - start < 10


def test_slow_bodies_do_not_keep_other_clients_waiting(served):
    """300 connections that send headers and a trickle of body hold no one else up: a normal
    request is answered within 5 s, and the slow ones end at the body deadline."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(served.http_url)
    slow = []
    try:
        for _ in range(300):
            conn = socket.create_connection((url.hostname, url.port), timeout=10)
            conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                         f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100000\r\n\r\n{\"model\"".encode())
            slow.append(conn)
        time.sleep(1.0)
        start = time.monotonic()
        response = httpx.post(served.http_url + "/v1/chat/completions", headers=headers(), timeout=60,
                              json=chat_body(2, {"draft": "none"}, max_tokens=4))
        assert response.status_code == 200, response.text
        assert time.monotonic() - start < 5.0
    finally:
        for conn in slow:
            conn.close()


# Every key family the replicas and the policy service read, overwritten with values of the wrong
# shape, size and Redis type (docs/design.md §7: Redis is an optimisation, and input like any other).
GARBAGE = {
    "specserve:policy:snapshot": ("string", json.dumps({"version": 99, "published_at": "x", "priors": "garbage"})),
    "specserve:policy:version": ("string", "x"),
    "specserve:router:weights": ("string", json.dumps({"version": 1, "models": {DRAFT_LM: {"dims": 40000}}})),
    "specserve:router:version": ("list", ["not", "a", "counter"]),
    "specserve:router:outcomes": ("string", "{" * 10_000),
    "specserve:outputs:" + MODEL: ("hash", {"tokens": "-1"}),
    "specserve:stats:index": ("string", "garbage"),
}


def openai_client(served):
    from openai import OpenAI

    return OpenAI(base_url=served.http_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_a_tree_rules_state_flows_through_redis_to_every_replica(served, engine):
    """adt-tree requests leave where their walks ended; the counts reach Redis and the policy
    service's snapshot (a prior's `learned`), and each of the two target replicas starts new tree
    requests of that draft and bucket (prompt length and task topic) from the cluster's sums."""
    from collections import Counter

    from counters import counts
    from specserve.policies.redis_stats import RedisStats
    from specserve.data.prompts import topic_corpus
    from specserve.policies.stats import StatsKey, task_bucket
    from specserve.router.router_factory import RouterFactory, topic_basis

    client, spec = openai_client(served), {"draft": "prompt-lookup", "policy": "adt-tree"}

    def tree_request(prompt, salt):   # salted apart: no prefix affinity, the least loaded replica takes each
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"spec": spec, "cache_salt": salt}).model_extra["spec"]

    walks = [tree_request(prompt, f"walk-{i}") for i, prompt in enumerate(PROMPTS)]
    assert all(s["policy"] == "adt-tree" and s["trees"] for s in walks), walks

    def prior_of(bucket):
        body = httpx.get(served.http_url + "/v1/policy", headers=headers(), timeout=30).json()
        return next((p for p in (body["snapshot"] or {}).get("priors", [])
                     if p["draft"] == "prompt-lookup" and p["bucket"] == bucket), {})

    # Replica -> Redis -> policy service: the walks' end states are in the pooled prior (decayed a little).
    pooled = wait_until(lambda: prior_of("all"), lambda p: p.get("learned", {}).get("adt_requests", 0) >= 0.9 * len(PROMPTS),
                        timeout=90, interval=1)
    assert pooled.get("learned", {}).get("adt_requests", 0) >= 0.9 * len(PROMPTS), pooled
    # Another replica's counts, written as a replica flushes them and heavy enough to set the mean:
    # walks that ended at depth 7, top-k 5.
    # The bucket a replica counts PROMPTS[0] under: its length and its task topic (the router's basis).
    basis = topic_basis(pooled["target"], engine.tokenizer, topic_corpus, RouterFactory.topic_dims)
    ids = engine.encode(PROMPTS[0])
    bucket = task_bucket(len(ids), topic=basis.topic(ids))
    elsewhere = counts(600, 200, window=4) + Counter(adt_requests=10_000, adt_depth=70_000, adt_top_k=50_000)
    key = StatsKey(pooled["target"], "prompt-lookup", bucket, int(time.time()) // 60 * 60)
    assert RedisStats(served.redis_url, "specserve").flush("another-replica", 1, {key: elsewhere})
    wait_until(lambda: prior_of(bucket), lambda p: p.get("learned", {}).get("adt_requests", 0) > 9000,
               timeout=60, interval=1)
    # Policy service -> every replica: each one's next adt-tree request starts there.
    started: dict[str, list] = {}
    deadline, sent = time.monotonic() + 120, 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while len(started) < 2 and time.monotonic() < deadline:
            for s in pool.map(lambda i: tree_request(PROMPTS[0], f"tree-{i}"), range(sent, sent + 4)):
                if s.get("prior") and s["trees"][0][:2] == [7, 5]:
                    started.setdefault(s["replica"], s["trees"][0])
            sent += 4
    assert len(started) == 2, f"adt-tree requests started from the cluster's sums on {sorted(started)} only"


def test_garbage_in_every_redis_key_family_costs_no_request_and_publishing_resumes(served):
    import redis as redis_client

    from specserve.policies.redis_schema import PolicySnapshot, parse

    r = redis_client.Redis.from_url(served.redis_url)
    saved = {key: r.dump(key) for key in GARBAGE}

    def version() -> int:
        response = httpx.get(served.http_url + "/v1/policy", headers=headers(), timeout=60)
        snapshot = response.json().get("snapshot") if response.status_code == 200 else None
        return snapshot["version"] if isinstance(snapshot, dict) and isinstance(snapshot.get("version"), int) else -1

    before = version()
    try:
        for key, (kind, value) in GARBAGE.items():
            r.delete(key)
            {"string": lambda: r.set(key, value), "list": lambda: r.rpush(key, *value),
             "hash": lambda: r.hset(key, mapping=value)}[kind]()
        time.sleep(7)   # every replica has re-read the snapshot and weights (every 5 s)
        asks = [{}, {"draft": "auto"}, {"draft": "prompt-lookup", "window": 3}, {"draft": "none"},
                {"draft": DRAFT_LM, "tree": {"depth": 3, "top_k": 2, "budget": 6}}]
        for i, spec in enumerate(asks):
            response = httpx.post(served.http_url + "/v1/chat/completions", json=chat_body(i, spec, max_tokens=8),
                                  headers=headers(), timeout=300)
            assert response.status_code == 200, (spec, response.text)
        # The service repairs the counter it publishes under and publishes over the garbage.
        def stored() -> int:
            raw = r.get("specserve:policy:snapshot")
            document = parse(PolicySnapshot, raw, "policy_snapshot", "snapshot") if raw else None
            return -1 if document is None else document.version

        assert wait_until(stored, lambda v: v > before, timeout=60, interval=1) > before
        assert version() > before
    finally:
        for key, dumped in saved.items():
            r.delete(key)
            if dumped is not None:
                r.restore(key, 0, dumped)


# ---- bad input, generated -----------------------------------------------------------------------

# Text a JSON body can carry but UTF-8 cannot: lone surrogates, and control characters, beside letters.
ODD_TEXT = st.text(st.characters(categories=["Cs", "Cc", "Lu", "Zs"]), max_size=12)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=20), ODD_TEXT)
ANY_JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                        max_leaves=6)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", 7]),
                                 "content": st.one_of(st.text(max_size=40), ODD_TEXT, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=20) | ODD_TEXT}),
                                     max_size=2), ANY_JSON)})
SPEC = st.fixed_dictionaries({}, optional={
    "draft": st.sampled_from(["auto", "none", "prompt-lookup", DRAFT_LM, "nope", ""]) | ANY_JSON,
    "window": st.integers(-3, 20) | ANY_JSON,
    "tree": st.fixed_dictionaries({"depth": st.integers(-1, 20), "top_k": st.integers(-1, 10),
                                   "budget": st.integers(-1, 70)}) | ANY_JSON,
    "policy": st.sampled_from(["online", "fsm", "sage", "nope"]) | ANY_JSON,
    "extra": ANY_JSON,
})
COMMON = {
    "model": st.sampled_from([MODEL, "gpt-9", "", "\udc00"]) | ANY_JSON,
    "max_tokens": st.integers(-2, 6) | st.integers(8000, 2**40) | ANY_JSON,
    # down to float64's subnormals: admitted values that underflow in float32
    "temperature": st.floats(-1, 3) | st.floats(0, 1e-30) | st.sampled_from([math.nan, math.inf, 5e-324]) | ANY_JSON,
    "top_p": st.floats(-0.5, 1.5) | ANY_JSON,
    "top_k": st.integers(-3, 100_000) | ANY_JSON,
    "seed": st.integers(-2**70, 2**70) | ANY_JSON,
    "stop": st.lists(st.text(max_size=300), max_size=6) | st.text(max_size=4) | ANY_JSON,
    "stream": st.booleans() | ANY_JSON,
    "n": st.integers(0, 3),
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(-5, 5), max_size=2),
    "spec": SPEC | ANY_JSON,
    "unknown_field": ANY_JSON,
}
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | ANY_JSON}, optional=COMMON)
COMPLETION = st.fixed_dictionaries({"prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60_000), max_size=8)
                                    | st.lists(st.text(max_size=10), max_size=2) | ANY_JSON}, optional=COMMON)


def _check_answer(response: httpx.Response, body) -> None:
    assert response.status_code < 500, (body, response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (body, error)
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in response.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            assert "error" not in chunk, (body, chunk)
    else:
        assert response.json()["choices"], body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), chat=CHAT, completion=COMPLETION,
       body_shape=st.sampled_from(["object", "list", "string", "raw"]))
def test_no_generated_http_body_gets_a_500_or_hurts_a_replica(served, path, chat, completion, body_shape):
    body = chat if path.endswith("chat/completions") else completion
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 6:
        pass                                      # small enough to run for real
    elif "max_tokens" not in body or isinstance(body.get("max_tokens"), int) and body["max_tokens"] < 8000:
        body["max_tokens"] = 4                    # keep real generations short
    content = {"object": json.dumps(body, allow_nan=True), "list": json.dumps([body], allow_nan=True),
               "string": json.dumps("hello"), "raw": "{" + json.dumps(body, allow_nan=True)[:30]}[body_shape]
    response = httpx.post(served.http_url + path, content=content.encode(), timeout=300,
                          headers={**headers(), "content-type": "application/json"})
    _check_answer(response, body)


GRPC_REQUEST = st.builds(
    lambda prompt, messages, max_tokens, temperature, top_p, top_k, seed, stop, spec, model: pb.CompletionRequest(
        model=model, prompt=prompt, messages=[pb.ChatMessage(role=r, content=c) for r, c in messages],
        stop=stop, spec=spec, **{k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                                                   ("top_p", top_p), ("top_k", top_k), ("seed", seed)) if v is not None}),
    prompt=st.text(max_size=40) | st.text(st.characters(categories=["Cc", "Lu"]), max_size=12),
    messages=st.lists(st.tuples(st.sampled_from(["user", "system", "bot", ""]), st.text(max_size=30)), max_size=2),
    max_tokens=st.none() | st.integers(-2**31, 6) | st.integers(8000, 2**31 - 1),
    temperature=st.none() | st.floats(-2, 3, width=32) | st.floats(0, 1.1754943508222875e-38, width=32) | st.sampled_from([math.nan, math.inf]),
    top_p=st.none() | st.floats(-1, 2, width=32), top_k=st.none() | st.integers(-2**31, 2**31 - 1),
    seed=st.none() | st.integers(-2**63, 2**63 - 1), stop=st.lists(st.text(max_size=300), max_size=6),
    spec=st.none() | st.builds(lambda d, w, p: pb.SpecOptions(draft=d, policy=p, **({} if w is None else {"window": w})),
                               st.sampled_from(["", "auto", "none", "prompt-lookup", "nope"]),
                               st.none() | st.integers(-2**31, 2**31 - 1), st.sampled_from(["", "online", "nope"])),
    model=st.sampled_from(["", MODEL, "gpt-9"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(request=GRPC_REQUEST, streaming=st.booleans())
def test_no_generated_grpc_request_gets_internal_or_hurts_a_replica(stub, request, streaming):
    if not request.HasField("max_tokens") or 6 < request.max_tokens < 8000:
        request.max_tokens = 4
    metadata = (("authorization", f"Bearer {KEY}"),)
    try:
        if streaming:
            list(stub.CompleteStream(request, timeout=300, metadata=metadata))
        else:
            stub.Complete(request, timeout=300, metadata=metadata)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (request, err.code(), err.details())
        assert err.details()


def test_the_generated_inputs_left_every_replica_as_it_was(served):
    states = serving_states()
    assert all(set(s) == {"RUNNING"} for s in states.values()), states


# ---- replicas killed mid-stream ------------------------------------------------------------------


def _streams_with_a_kill(served, deployment: str, bodies: list[dict], kill_after_s: float):
    """Stream every body at once; ``kill_after_s`` after the first chunk arrived, kill one replica
    of ``deployment``. Returns each stream's (ids, spec, error)."""
    first = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(streamed, served.http_url, body, first.set) for body in bodies]
        assert first.wait(120)
        time.sleep(kill_after_s)
        # A replica killed by the test before may still be on its way back (Serve restarts it).
        victims = wait_until(lambda: replicas(deployment), timeout=120)
        assert victims, deployment
        kill(victims[0])
        return [f.result(timeout=600) for f in futures]


@pytest.mark.parametrize("kill_after_s", [0.0, 0.7, 2.0])
def test_a_draft_replica_killed_at_any_point_costs_speed_not_a_request(served, expected, kill_after_s):
    local.wait_healthy(served.app_name, timeout_s=300)
    bodies = [chat_body(i, {"draft": DRAFT_LM, "window": 3}) for i in range(len(PROMPTS))]
    for i, (ids, spec, error) in enumerate(_streams_with_a_kill(served, f"draft-{DRAFT_LM}", bodies, kill_after_s)):
        assert error is None, (i, error)
        assert ids == expected[i], i


def test_a_target_replica_killed_mid_stream_resumes_elsewhere_where_it_stopped(served, expected):
    local.wait_healthy(served.app_name, timeout_s=300)
    bodies = [chat_body(i, {"draft": "prompt-lookup" if i % 2 else "none"}) for i in range(len(PROMPTS))]
    results = _streams_with_a_kill(served, "target", bodies, 0.5)
    for i, (ids, spec, error) in enumerate(results):
        assert error is None, (i, error)
        assert ids == expected[i], i
    assert any((spec or {}).get("resumed") for _, spec, _ in results), "the killed replica held some of the streams"
    local.wait_healthy(served.app_name, timeout_s=300)
    done = httpx.post(served.http_url + "/v1/chat/completions", json=chat_body(1), headers=headers(), timeout=300)
    assert done.json()["choices"][0]["token_ids"] == expected[1]


def test_with_every_target_replica_killed_a_request_completes_or_ends_retriable_in_bounded_time(served, expected):
    local.wait_healthy(served.app_name, timeout_s=300)
    body = chat_body(0, {"draft": "none"})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        future = pool.submit(httpx.post, served.http_url + "/v1/chat/completions", json=body, headers=headers(),
                             timeout=600)
        time.sleep(1.0)
        for name in replicas("target"):
            kill(name)
        response = future.result()
        took = time.monotonic() - start
    assert took < RESUME_TIMEOUT_S + 60, took
    if response.status_code == 200:     # Serve replaced a replica in time: the rest was generated there
        assert response.json()["choices"][0]["token_ids"] == expected[0]
    else:
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 0, response.text
    local.wait_healthy(served.app_name, timeout_s=300)
    done = httpx.post(served.http_url + "/v1/chat/completions", json=body, headers=headers(), timeout=300)
    assert done.json()["choices"][0]["token_ids"] == expected[0]


# ---- what a request that leaves gives back --------------------------------------------------------


def _target_loads(served, seen: dict[str, dict]) -> dict[str, dict]:
    """``load()`` of target replicas, latest by replica (calls land on replicas at random, and a
    handle learns of a replica that just started a little later)."""
    from ray import serve

    handle = serve.get_deployment_handle("target", served.app_name)
    for _ in range(8):
        load = handle.load.remote().result(timeout_s=60)
        seen[load["replica_id"]] = load
    return seen


def test_a_client_that_hangs_up_or_times_out_frees_its_slot_and_kv(served, stub):
    local.wait_healthy(served.app_name, timeout_s=300)
    body = {**chat_body(3, {"draft": "none"}), "max_tokens": 400,
            "messages": [{"role": "user", "content": LONG_ASK}]}
    with httpx.stream("POST", served.http_url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=headers(), timeout=300) as response:
        next(response.iter_lines())                     # started; now hang up
    with pytest.raises(grpc.RpcError) as err:           # and one that passes its deadline
        stub.Complete(pb.CompletionRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=LONG_ASK)],
                                           max_tokens=400, temperature=0), timeout=1.0,
                      metadata=(("authorization", f"Bearer {KEY}"),))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    loads: dict[str, dict] = {}

    def freed() -> dict[str, dict]:
        nonlocal loads
        loads = _target_loads(served, loads)     # both replicas' loads, as calls reach them
        return loads

    loads = wait_until(freed, lambda seen: len(seen) == 2 and all(
        v["running"] == 0 and v["kv_positions_in_use"] == 0 for v in seen.values()), timeout=60, interval=0.5)
    assert len(loads) == 2, loads
    assert all(v["running"] == 0 and v["kv_positions_in_use"] == 0 for v in loads.values()), loads


# ---- the policy service killed ---------------------------------------------------------------------


def test_the_policy_service_killed_costs_nothing_and_counts_arrive_once(served, expected):
    from specserve.policies.redis_stats import RedisStats

    local.wait_healthy(served.app_name, timeout_s=300)
    stats = RedisStats(served.redis_url, "specserve")

    def steps() -> int:
        return sum(c["drafts"] + c["plain_steps"] for c in stats.read().values())

    def version() -> int:
        response = httpx.get(served.http_url + "/v1/policy", headers=headers(), timeout=60)
        return response.json()["snapshot"]["version"] if response.status_code == 200 else -1

    time.sleep(3)                                       # earlier requests' counts flushed
    before_steps, before_version = steps(), version()
    for name in replicas("policy"):
        kill(name)
    served_steps = 0
    for i in range(3):
        out = httpx.post(served.http_url + "/v1/chat/completions", json=chat_body(i, {"draft": "prompt-lookup", "window": 3}),
                         headers=headers(), timeout=300).json()
        assert out["choices"][0]["token_ids"] == expected[i]
        served_steps += out["spec"]["steps"]
    local.wait_healthy(served.app_name, timeout_s=300)
    wait_until(lambda: (steps(), version()),
               lambda seen: seen[0] >= before_steps + served_steps and seen[1] > before_version, timeout=60, interval=1)
    assert steps() == before_steps + served_steps       # every step once: none lost, none twice
    assert version() > before_version                   # the restarted service publishes again


def test_a_repeated_prompt_goes_to_the_replica_that_holds_its_prefix(served):
    # Two target replicas: by chance alone, four repeats would all land on the first one's replica
    # with probability 1/16. The prefix-affinity router sends them there, and the usage says so.
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content":
            "Affinity check: " + " ".join(f"item {i} is {i * i};" for i in range(30))}]}
    usages = []
    for _ in range(5):
        response = httpx.post(served.http_url + "/v1/chat/completions", json=body, headers=headers(), timeout=300)
        assert response.status_code == 200, response.text
        usages.append(response.json()["usage"])
    prompt_tokens = usages[0]["prompt_tokens"]
    assert prompt_tokens > 64
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] < prompt_tokens // 2 and cached[1:] == [prompt_tokens - 1] * 4, cached
    # Another tenant's salt reuses none of it (vLLM's cache_salt).
    salted = httpx.post(served.http_url + "/v1/chat/completions", json={**body, "cache_salt": "tenant-b"},
                        headers=headers(), timeout=300)
    assert salted.status_code == 200 and salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_draft_deployment_with_no_running_replica_costs_a_deadline_not_the_target(served, engine, expected):
    """A draft deployment whose replica cannot be placed (a lost node, a full cluster: here it asks
    for a resource no node has) has no replica to answer: Serve's handle would queue a call for
    ever. The call is cut at its deadline, the draft is marked down, the request goes on by plain
    decoding with the target's exact output, and the next calls fail at once."""
    from ray import serve

    from specserve.replicas.draft_deployment import DraftDeployment
    from specserve.replicas.engine import run_batch
    from specserve.replicas.remote_draft import DraftUnavailable, RemoteDraft
    from specserve.replicas.request import SpecRequest

    app = DraftDeployment.options(name="draft-unplaceable", ray_actor_options={"num_cpus": 0, "resources": {"no-such-node": 1}}
                                  ).bind("unplaceable", None, "float32", 1, 0)
    # serve.run waits for the application to be healthy, which this one never is: its private
    # twin can return at once.
    handle = serve._run(app, _blocking=False, name="unplaceable-draft", route_prefix=None)
    try:
        remote = RemoteDraft(handle, "unplaceable", min_deadline_s=2.0, cooldown_s=600.0)
        prompt = engine.encode(PROMPTS[3])
        start = time.monotonic()
        got = run_batch(Target(engine.loaded.model), {"unplaceable": remote},
                        [SpecRequest(prompt, NEW_TOKENS, SamplingParams(), "unplaceable", 3, request_id="r0")],
                        eos_token_ids=engine.loaded.eos_token_ids)[0]
        assert got.token_ids == expected[3]
        assert remote.down and "no answer within 2.0 s" in remote.last_error
        assert time.monotonic() - start < 2.0 + 60.0   # one deadline, then plain decoding
        quick = time.monotonic()
        with pytest.raises(DraftUnavailable, match="is down"):
            asyncio.run(remote.propose_batch([]))
        assert time.monotonic() - quick < 1.0
    finally:
        serve.delete("unplaceable-draft", _blocking=False)


class MalformedProbs:
    """A draft deployment whose proposals carry ``draft_probs`` that are not the distribution the
    tokens were drawn from: NaN, mass above 1, rows summing to 2, and q(x) = 0 for a proposed
    token (which the rejection test would always accept), in turn."""

    def __init__(self, vocab: int):
        self.vocab, self.calls = vocab, 0

    async def info(self) -> dict:
        return {"needs_features": False, "vocab_size": self.vocab}

    async def propose_batch(self, asks):
        import torch

        from specserve.replicas.step import Proposal

        out = []
        for ask in asks:
            self.calls += 1
            tokens = [ask.context[-1]] * max(ask.window, 1)
            q = torch.full((len(tokens), self.vocab), 1.0 / self.vocab)
            kind = self.calls % 4
            if kind == 0:
                q[0, 0] = float("nan")
            elif kind == 1:
                q[0] = 0.0
                q[0, (tokens[0] + 1) % self.vocab] = 1.0
            elif kind == 2:
                q *= 2
            else:
                q[0, 0] = 1.5
            out.append(Proposal.chain(tokens, draft_probs=q))
        return out

    async def release(self, session_ids, endings=None) -> None:
        return None


def test_a_draft_replica_answering_malformed_probabilities_costs_speculation_never_the_distribution(served, engine):
    """The draft runs as its own Serve deployment, so its proposals cross the wire as a remote
    draft's do; the target drops each one and the sampled output is target-only's for the seed."""
    import sys

    import ray.cloudpickle
    from ray import serve

    from specserve.replicas.engine import run_batch
    from specserve.replicas.remote_draft import RemoteDraft
    from specserve.replicas.request import SpecRequest

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the test's class, by value
    target = Target(engine.loaded.model)
    app = serve.deployment(MalformedProbs, name="draft-malformed", ray_actor_options={"num_cpus": 0}).bind(target.vocab)
    handle = serve.run(app, name="malformed-draft", route_prefix=None)
    try:
        prompt, params = engine.encode(PROMPTS[0]), SamplingParams(temperature=1.0, seed=17)
        drafted = run_batch(target, {"malformed": RemoteDraft(handle, "malformed")},
                            [SpecRequest(prompt, 16, params, "malformed", 3, request_id="m0")],
                            eos_token_ids=engine.loaded.eos_token_ids)[0]
        plain = run_batch(Target(engine.loaded.model), {}, [SpecRequest(prompt, 16, params, "none", 0, request_id="p0")],
                          eos_token_ids=engine.loaded.eos_token_ids)[0]
        assert drafted.token_ids == plain.token_ids
        # Every step's proposal dropped (the last may have had no room to draft).
        assert drafted.stats.proposal_errors >= max(1, drafted.stats.steps - 1)
    finally:
        serve.delete("malformed-draft", _blocking=False)


def test_the_router_explores_and_every_replica_routes_with_what_the_cluster_learned(served, tmp_path):
    """Exploration on (``router_explore`` EXPLORE): auto requests on prompts unlike the earlier
    tests' show a draft chosen for LinUCB's bonus (``spec.router.reason`` "explore").
    Pinned requests of that draft on that prompt teach its model as routed ones do; their outcomes
    reach the policy service through Redis, it retrains over the cluster's whole stream (its model
    at the prompt moves towards the α realised there; a linear model of every prompt need not reach
    it), and auto requests on the prompt answered by each target replica then predict with it."""
    import itertools
    from urllib.parse import unquote, urlsplit

    from specserve.cluster.redis_server import RedisServer, ping
    from specserve.policies.redis_stats import RedisStats
    from specserve.router.acceptance import ROUTER_PRIOR_ALPHA, LinearAcceptance
    from specserve.router.retrain import WeightsDocument, retrain, weights_for

    novel = [
        "Name three rivers in Africa and the countries they flow through.",
        "Write a haiku about autumn leaves falling in a quiet forest.",
        "Continue the pattern: one two three, one two three, one two three, one two three,",
        "Explain in two sentences why the sky looks blue at noon and red at sunset.",
        "SELECT name, age FROM users WHERE age > 30 ORDER BY age; -- what does this query return?",
    ]
    client = openai_client(served)
    teach = 12
    near = 0.03   # two predictions of one model at one prompt's features, measured apart (within 1e-2)
    salts = itertools.count()

    def ask(prompt, spec):
        # Salted apart: no request reuses another's prefix, so every prefill measures the prompt's
        # perplexity and one prompt has one feature vector.
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"spec": spec, "cache_salt": f"explore-{next(salts)}"})
        return out.id.removeprefix("chatcmpl-"), out.model_extra["spec"]

    restarted = None
    if not ping(served.redis_url):   # the Redis test stopped it: back on its port and password, which the replicas know
        url = urlsplit(served.redis_url)
        restarted = RedisServer.start(tmp_path, port=url.port, password=unquote(url.password))
    try:
        # 1. An auto request explores (one at a time, so that no prefill skips the perplexity).
        seen, explored, deadline = [], None, time.monotonic() + 300
        while explored is None and len(seen) < 60 and time.monotonic() < deadline:
            prompt = novel[len(seen) % len(novel)]
            _, spec = ask(prompt, {"draft": "auto"})
            seen.append((spec["router"]["choice"], spec["router"]["reason"], spec["replica"]))
            if spec["router"]["reason"] == "explore":
                explored = prompt, spec["router"]
        assert explored is not None, f"no auto request explored in {len(seen)} (choice, reason, replica): {seen}"
        prompt, decision = explored
        draft = decision["choice"]

        # 2. Pinned requests of the explored draft on its prompt (a pinned window drafts every step).
        taught = [ask(prompt, {"draft": draft, "window": 3}) for _ in range(teach)]
        assert all(spec["router"]["reason"] == "pinned" for _, spec in taught), [spec["router"] for _, spec in taught]
        ids = {request_id for request_id, _ in taught}

        def outcomes():
            body = httpx.get(served.http_url + "/v1/routing/recent", params={"limit": 1000}, headers=headers(), timeout=30).json()
            # A request resumed on another replica carries its id with a suffix.
            return body, [o for o in body["data"] if o["request_id"].partition("-")[0] in ids]

        body, arrived = wait_until(outcomes, lambda got: len(got[1]) >= teach, timeout=60, interval=1)
        assert body["source"] == "cluster" and len(arrived) >= teach, \
            f"{len(arrived)} of {teach} outcomes in the cluster's stream (source {body['source']})"
        features = arrived[0]["features"]
        assert all(o["features"] == pytest.approx(features, abs=1e-2) for o in arrived), [o["features"] for o in arrived]
        observed = [(s["alpha"], s["weight"]) for o in arrived for s in o["observations"] if s["draft"] == draft]
        assert len(observed) >= teach, arrived
        realised = sum(a * w for a, w in observed) / sum(w for _, w in observed)

        # 3. The policy service retrains: the first publication after the outcomes arrived may have
        # read the stream before them, the second has them (versions count from 1 again in a
        # restarted Redis, so changes are counted, not compared).
        def service():
            return httpx.get(served.http_url + "/v1/policy", headers=headers(), timeout=30).json()["service"]

        versions = [service()["router_weights_version"]]

        def published():
            version = service()["router_weights_version"]
            if version != versions[-1]:
                versions.append(version)
            return versions

        wait_until(published, lambda v: len(v) >= 3, timeout=60, interval=1)
        assert len(versions) >= 3, f"router weights published as versions {versions} in 60 s (every 10 s expected)"
        stats = RedisStats(served.redis_url, "specserve")
        document = stats.read_snapshot("router", WeightsDocument)

        def at_prompt(weights: dict, fitted: bool = True) -> float:
            models = weights_for(weights, arrived[0]["target"], arrived[0]["basis"], len(features))
            if draft not in models and not fitted:   # no observation of the draft: the prior
                return LinearAcceptance(len(features), prior_alpha=ROUTER_PRIOR_ALPHA).predict(features)
            assert draft in models, f"no retrained model of {draft} for this target and basis: {sorted(models)}"
            return LinearAcceptance.from_dict(models[draft]).predict(features)

        # What the service published is the ridge over the stream as it stands (nothing has run since
        # the teaching), and the teaching moved it towards what the draft realised at the prompt.
        routes = stats.read_routes()
        learned = at_prompt(document)
        assert learned == pytest.approx(at_prompt(retrain(routes)), abs=1e-6)
        kept = [o for o in routes if o.get("request_id", "").partition("-")[0] not in ids]
        assert len(routes) - len(kept) >= teach, f"{len(routes) - len(kept)} of {teach} taught outcomes in the stream"
        untaught = at_prompt(retrain(kept), fitted=False)
        assert abs(learned - realised) < abs(untaught - realised) + 1e-6, (
            f"{draft}: realised α {realised:.3f}; the cluster predicts {learned:.3f}, {untaught:.3f} without the teaching")

        # 4. Each target replica (they reload the weights every 5 s) routes the prompt with them: the
        # first request after a reload predicts the cluster's α (later ones add that replica's own
        # observations, and the service publishes again every 10 s with the probes' outcomes).
        predicted: dict[str, list[float]] = {}

        def probe():
            with concurrent.futures.ThreadPoolExecutor(2) as pool:   # two at once: both replicas take one
                for _, spec in pool.map(lambda _: ask(prompt, {"draft": "auto"}), range(2)):
                    predicted.setdefault(spec["replica"], []).append(spec["router"]["predicted_alpha"][draft])
            return predicted

        def with_cluster(got):
            return len(got) >= 2 and all(any(abs(p - learned) <= near for p in seen) for seen in got.values())

        wait_until(probe, with_cluster, timeout=120, interval=1)
        assert len(predicted) >= 2, f"auto requests on {prompt!r} reached replicas {sorted(predicted)} only"
        assert with_cluster(predicted), (
            f"{draft} on {prompt!r}: the cluster's model predicts {learned:.3f}; predicted "
            f"{decision['predicted_alpha'][draft]} when explored, since by replica {predicted}")
    finally:
        if restarted is not None:
            restarted.stop()
