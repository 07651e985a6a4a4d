"""End to end with a tiny image generator on a real local Ray cluster: POST /v1/images/generations
and gRPC GenerateImage give the plain guided decoder's pictures under greedy decoding, with the
generator's draft inside the target replica and ADT-Tree adapting its trees; a bad prompt is a 400
/ INVALID_ARGUMENT and the text routes say where pictures are served. Last, ``down`` from this
process (which keeps running, as a notebook or ``bench soak`` against its own stack does) leaves
nothing behind that calls Ray again."""

from __future__ import annotations

import base64
import contextlib
import io
import time

import grpc
import httpx
import pytest
from PIL import Image

from conftest import local_stack
from specserve.cluster.serve_config import app_serve_config
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress import specserve_pb2_grpc
from specserve.replicas.imagegen import generate, load_generator, to_pictures
from tiny_models import tiny_generator_draft, tiny_generator_folder

PROMPT = "a green circle on a plain background"   # class 5 of the tiny generator's 6
LABEL = 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    generator = tiny_generator_folder(tmp_path_factory.mktemp("models"), grid=8)
    return generator, tiny_generator_draft(generator)


@pytest.fixture(scope="module")
def expected(folders):
    model, settings, tokenizer = load_generator(folders[0])
    ids = generate(model, settings.layout, [LABEL], settings.tokens, cfg_scale=settings.cfg_scale)
    return list(to_pictures(tokenizer, ids, settings.grid)[0].getdata())


# Serve's handles push autoscaling metrics every 10 s (RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S).
METRICS_PUSH_S = 10.0


@pytest.fixture(scope="module")
def stack(folders, tmp_path_factory):
    """(the served stack, what takes it down): the last test takes it down itself."""
    generator, draft = folders
    config = app_serve_config({"target": str(generator), "dtype": "float32", "policy": "adt-tree",
                               "default_draft": "draft", "default_window": 4,
                               "drafts": [{"name": "draft", "model": str(draft), "placement": "inside"}]})
    with contextlib.ExitStack() as down:
        yield down.enter_context(local_stack(config, tmp_path_factory.mktemp("specserve-home"))), down


@pytest.fixture(scope="module")
def served(stack):
    return stack[0]


def pixels(b64_or_png) -> list:
    data = b64_or_png if isinstance(b64_or_png, bytes) else base64.b64decode(b64_or_png)
    with Image.open(io.BytesIO(data)) as picture:
        return list(picture.convert("RGB").getdata())


def test_http_pictures_are_the_plain_guided_decoders(served, expected):
    reply = httpx.post(f"{served.http_url}/v1/images/generations", timeout=300,
                       json={"prompt": PROMPT, "n": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [pixels(d["b64_json"]) for d in body["data"]] == [expected, expected]
    assert all(spec["draft"] == "draft" and spec["policy"] == "adt-tree" for spec in body["spec"])
    assert any(spec["mean_accepted_len"] > 1 for spec in body["spec"]), body["spec"]
    model = httpx.get(f"{served.http_url}/v1/models", timeout=30).json()["data"][0]
    assert model["output_modalities"] == ["image"]


def test_grpc_generate_image_gives_the_same_picture_and_names_a_relaxed_one(served, expected):
    with grpc.insecure_channel(served.grpc_address) as channel:
        reply = specserve_pb2_grpc.SpecServeStub(channel).GenerateImage(
            pb.ImageRequest(prompt=PROMPT, temperature=0), timeout=300)
        relaxed = specserve_pb2_grpc.SpecServeStub(channel).GenerateImage(
            pb.ImageRequest(prompt=PROMPT, temperature=0, spec=pb.SpecOptions(acceptance="lantern")), timeout=300)
    assert [pixels(p.png) for p in reply.pictures] == [expected]
    assert not reply.pictures[0].spec.HasField("acceptance")
    assert relaxed.pictures[0].spec.acceptance.rule == "lantern" and len(pixels(relaxed.pictures[0].png)) == len(expected)


def test_bad_requests_are_answered_and_the_replica_serves_on(served, expected):
    bad = httpx.post(f"{served.http_url}/v1/images/generations", timeout=60, json={"prompt": "a green circle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    chat = httpx.post(f"{served.http_url}/v1/chat/completions", timeout=60,
                      json={"model": "gen", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "/v1/images/generations" in chat.json()["error"]["message"]
    with grpc.insecure_channel(served.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            specserve_pb2_grpc.SpecServeStub(channel).GenerateImage(pb.ImageRequest(prompt="red"), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    again = httpx.post(f"{served.http_url}/v1/images/generations", timeout=300, json={"prompt": PROMPT, "temperature": 0})
    assert again.status_code == 200 and pixels(again.json()["data"][0]["b64_json"]) == expected


# Last in the module: it takes the module's stack down.
@pytest.mark.slow
def test_down_leaves_no_handle_that_starts_a_new_ray_cluster(stack):
    """A deployment handle's router pushes metrics from a background thread; left running after
    ``down``, its next Ray call would start a fresh local cluster inside this process, which the
    next ``up`` would join (with too few CPUs for its replicas) and whose ``ray stop`` would kill
    the process."""
    import ray
    from ray import serve

    state, down = stack
    handle = serve.get_deployment_handle("target", state.app_name)
    assert handle.load.remote().result(timeout_s=120)["running"] == 0
    down.close()
    assert not ray.is_initialized()
    time.sleep(2.5 * METRICS_PUSH_S)
    assert not ray.is_initialized(), "something called Ray after down and started a new cluster in this process"
