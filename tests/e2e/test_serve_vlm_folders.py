"""VLM folders served end to end on a real local Ray cluster: tiny random folders of the classes
whose pictures the processor lays out itself (Idefics3's tiles, Qwen2-VL's native resolution),
saved by ``save_pretrained`` and served as a user would point specserve at them, each as a Serve
application of its own on one cluster. A picture over HTTP and a clip over gRPC answer as the
folder's own ``generate`` on its processor's inputs (float32 greedy): Idefics3's class reads a
clip as its frames, pictures one after another; Qwen2-VL's and Qwen2.5-VL's as a video, its
temporal patches given to its ``generate`` as video input (Qwen2.5-VL's at the clip's frame rate,
sent with it). Every class's folder is decoded in process in
``tests/replicas/test_vlm_folders.py``."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForImageTextToText

from conftest import local_stack
from specserve.cluster import local
from specserve.cluster.serve_config import app_serve_config
from specserve.data.synthetic_images import TEST_SEED, example
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress import specserve_pb2_grpc
from specserve.replicas.vlm import load_processor
from tiny_models import folder_generate_clip, tiny_vlm_folder

pytestmark = [pytest.mark.reference, pytest.mark.slow]

QUESTION = "What shape is this, and what colour?"
NEW_TOKENS = 8
# The classes with the most layout of their own: a picture as tiles among markers, a picture on a grid of its own.
KINDS = ("idefics3-tiles", "qwen2-vl", "qwen2.5-vl")
FPS = 2.5   # the clip's frame rate: Qwen2.5-VL's patches 1.6 time steps apart


def png(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def own_generate(folder, pictures) -> list[int]:
    """The folder's own greedy answer: its model's ``generate`` on its processor's inputs."""
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = load_processor(folder)
    content = [*({"type": "image"} for _ in pictures), {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = processor(text=text, images=list(pictures), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One cluster, one application per folder (Serve's applications side by side: the first at
    ``/``, the others under their names)."""
    apps = []
    for i, kind in enumerate(KINDS):
        folder = tiny_vlm_folder(kind, tmp_path_factory.mktemp("folders") / kind)
        app = app_serve_config({"target": str(folder), "dtype": "float32",
                                "drafts": [{"name": "prompt-lookup", "placement": "inside"}]})
        if i:
            app["applications"][0].update(name=kind, route_prefix=f"/{kind}")
        apps.append((kind, folder, app))
    config = apps[0][2]
    config["applications"] += [app["applications"][0] for _, _, app in apps[1:]]
    with local_stack(config, tmp_path_factory.mktemp("specserve-home")) as state:
        for app in config["applications"][1:]:
            local.wait_healthy(app["name"], timeout_s=600)
        yield state, [(kind, folder, app["applications"][0]) for kind, folder, app in apps]


@pytest.mark.parametrize("which", range(len(KINDS)), ids=KINDS)
def test_a_picture_over_http_and_a_clip_over_grpc_answer_as_the_folders_own_generate(served, which):
    state, apps = served
    kind, folder, app = apps[which]
    base = state.http_url + app["route_prefix"].rstrip("/")
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    square, wide = example(TEST_SEED + 721, "shape").image, example(TEST_SEED + 722, "shape").image.resize((64, 24))
    for picture in (square, wide):
        url = "data:image/png;base64," + base64.b64encode(png(picture)).decode()
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
            "spec": {"draft": "prompt-lookup", "window": 3},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == own_generate(folder, [picture]), kind
    frames = [square, example(TEST_SEED + 723, "shape").image, square]   # a clip's frames share one size
    with grpc.insecure_channel(state.grpc_address) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        reply = stub.Complete(pb.CompletionRequest(model=model, max_tokens=NEW_TOKENS, temperature=0, messages=[
            pb.ChatMessage(role="user", content=QUESTION, videos=[pb.Video(frames=[png(f) for f in frames], fps=FPS)])]),
            timeout=300, metadata=(("application", app["name"]),))
    expected = own_generate(folder, frames)
    if kind.startswith("qwen"):   # read as a video, which answers otherwise than its frames as pictures
        expected, as_pictures = folder_generate_clip(folder, frames, QUESTION, NEW_TOKENS, FPS), expected
        assert expected != as_pictures
        if kind == "qwen2.5-vl":   # and placed in time by the frame rate sent
            assert expected != folder_generate_clip(folder, frames, QUESTION, NEW_TOKENS)
    assert list(reply.token_ids) == expected, kind
