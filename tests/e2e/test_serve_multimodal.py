"""End to end with the reference VLM on a real local Ray cluster: pictures as OpenAI image_url
parts and clips as video_url parts over HTTP, both as bytes over gRPC; the served answer equals the in-process engine's (float32
greedy), a bad picture is a 400 / INVALID_ARGUMENT and the replica serves on."""

from __future__ import annotations

import base64
import io

import grpc
import httpx
import pytest

from conftest import local_stack
from specserve.bench.multimodal import MultimodalBenchConfig
from specserve.bench.multimodal_served import frames_served_config, run_served_multimodal_bench, served_config
from specserve.cluster.serve_config import app_serve_config
from specserve.data.synthetic_images import TEST_SEED, example
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress import specserve_pb2_grpc
from specserve.replicas.engine import GenerateRequest, SpecEngine

pytestmark = [pytest.mark.reference, pytest.mark.slow]

MODEL = "smollm2-vlm"
PICTURES = [example(TEST_SEED + 701, "bars"), example(TEST_SEED + 702, "shape")]
# The served scenario benchmark's rows: the VLM's own draft's multimodal and pooled views, their mixes.
ROWS = MultimodalBenchConfig(target=MODEL, views=("multimodal", "pooled"), scenarios=("single", "text-turn", "clip"),
                             pictures=1, repeats=1, max_tokens=12, frames=())
# Sparrow's served rows: clips of two frames.
FRAMES = MultimodalBenchConfig(target=MODEL, pictures=0, frames=(2,), frame_prompts=1, repeats=1, max_tokens=12,
                               head="smollm2-vlm-hsr", ivsb_head="smollm2-vlm-sparrow")


def png(picture) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def image_part(picture) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(picture)).decode()}}


@pytest.fixture(scope="module")
def expected():
    engine = SpecEngine.load(MODEL, dtype="float32", device="cpu")
    return [engine.generate(GenerateRequest(ex.question, max_tokens=12, draft="none", window=0, images=(ex.image,)))
            ["token_ids"] for ex in PICTURES]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    config = app_serve_config({"target": MODEL, "dtype": "float32", "drafts": [
        {"name": "prompt-lookup"},
        # TABED's caption view inside the replica: the VLM captions each new picture beside the request.
        {"name": "captioned", "model": "smollm2-draft-2l", "placement": "inside",
         "ensemble": {"views": ["caption", "text-only"]}},
        # The VLM's own draft reading the pictures' image tokens (inside the replica, where the
        # pictures are), its pooled view and both mixes of the two: the served scenario benchmark's rows.
        *served_config(ROWS, replicas=1)["applications"][0]["args"]["drafts"],
        # Sparrow's served rows: a head drafting with full and with windowed attention (the target's
        # states, text positions only: VATA), the IVSB head windowed, the VLM's own draft LM.
        *frames_served_config(FRAMES, replicas=1)["applications"][0]["args"]["drafts"]]})
    with local_stack(config, tmp_path_factory.mktemp("specserve-home")) as state:
        yield state


def ask(served, content, **spec):
    return httpx.post(f"{served.http_url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
        "return_token_ids": True, "spec": spec})


def test_models_lists_image_input(served):
    model = httpx.get(f"{served.http_url}/v1/models", timeout=30).json()["data"][0]
    assert model["id"] == MODEL and model["input_modalities"] == ["text", "image", "video"]
    assert model["max_video_frames"] == 16   # the config's default


def test_http_image_parts_answer_as_in_process(served, expected):
    for ex, want in zip(PICTURES, expected):
        reply = ask(served, [image_part(ex.image), {"type": "text", "text": ex.question}], draft="prompt-lookup", window=3)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want, ex.question


def test_the_vlms_own_draft_reads_the_pictures_inside_the_replica_losslessly(served, expected):
    for ex, want in zip(PICTURES, expected):
        reply = ask(served, [image_part(ex.image), {"type": "text", "text": ex.question}], draft="multimodal", window=3)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want, ex.question
        assert reply.json()["spec"]["draft"] == "multimodal"


def test_the_caption_view_is_served_losslessly(served, expected):
    ex = PICTURES[0]
    for _ in range(2):   # the caption is written beside the first request, read by the second
        reply = ask(served, [image_part(ex.image), {"type": "text", "text": ex.question}], draft="captioned", window=3)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected[0]
        assert reply.json()["spec"]["draft"] == "captioned"


def test_specserve_generate_sends_pictures_over_http_and_grpc(served, expected):
    from specserve.cli.client import RemoteRequest, generate_remote

    ex = PICTURES[1]
    request = RemoteRequest(ex.question, max_tokens=12, draft="prompt-lookup", window=3, model=MODEL,
                            images=(png(ex.image),))
    for server in (served.http_url, f"grpc://{served.grpc_address}"):
        assert generate_remote(server, request)["token_ids"] == expected[1], server


def test_a_bad_picture_is_a_400_and_the_replica_serves_on(served, expected):
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode()}}
    reply = ask(served, [broken, {"type": "text", "text": "What is it?"}])
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_image"
    remote = ask(served, [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                          {"type": "text", "text": "What is it?"}])
    assert remote.status_code == 400 and "data URL" in remote.json()["error"]["message"]
    ex = PICTURES[0]
    again = ask(served, [image_part(ex.image), {"type": "text", "text": ex.question}])
    assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == expected[0]


def test_grpc_carries_pictures(served, expected):
    ex = PICTURES[1]
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        reply = stub.Complete(pb.CompletionRequest(model=MODEL, max_tokens=12, temperature=0, messages=[
            pb.ChatMessage(role="user", content=ex.question, images=[png(ex.image)])]), timeout=300)
        assert list(reply.token_ids) == expected[1]
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(pb.CompletionRequest(model=MODEL, max_tokens=4, messages=[
                pb.ChatMessage(role="user", content="hi", images=[b"not a picture"])]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def apng(frames) -> bytes:
    buffer = io.BytesIO()
    frames[0].save(buffer, format="PNG", save_all=True, append_images=frames[1:], duration=100)
    return buffer.getvalue()


def test_sparrows_windowed_head_drafts_a_clip_losslessly(served):
    """Sparrow's head, windowed, on a clip of four frames: the target-only answer, and the head's
    drafts accepted (it reads the frames through the target's states at the text positions)."""
    frames = [example(TEST_SEED + 720 + i, "shape").image for i in range(4)]
    question = "What shape is in the last frame, and what colour is it?"
    engine = SpecEngine.load(MODEL, dtype="float32", device="cpu")
    want = engine.generate(GenerateRequest(question, max_tokens=12, draft="none", window=0, images=tuple(frames)))["token_ids"]
    data = "data:image/png;base64,"
    clip = {"type": "video_url", "video_url": {"frames": [data + base64.b64encode(png(f)).decode() for f in frames]}}
    reply = ask(served, [clip, {"type": "text", "text": question}], draft="windowed-ivsb", window=3)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == want
    assert reply.json()["spec"]["draft"] == "windowed-ivsb" and reply.json()["spec"]["acceptance_rate"] > 0


def test_a_clip_answers_as_its_frames_shown_in_process_over_http_and_grpc(served):
    """A clip of three frames (an animated PNG, or the frames as a list) is its frames as
    consecutive pictures before the question: the same answer as the in-process engine shown
    those pictures."""
    frames = [example(TEST_SEED + 710 + i, "shape").image for i in range(3)]
    question = "What shape is shown, and does it change?"
    engine = SpecEngine.load(MODEL, dtype="float32", device="cpu")
    want = engine.generate(GenerateRequest(question, max_tokens=12, draft="none", window=0, images=tuple(frames)))["token_ids"]
    data = "data:image/png;base64,"
    for source in ({"url": data + base64.b64encode(apng(frames)).decode()},
                   {"frames": [data + base64.b64encode(png(f)).decode() for f in frames]}):
        reply = ask(served, [{"type": "video_url", "video_url": source}, {"type": "text", "text": question}],
                    draft="prompt-lookup", window=3)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want, sorted(source)
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = specserve_pb2_grpc.SpecServeStub(channel)
        for video in (pb.Video(clip=apng(frames)), pb.Video(frames=[png(f) for f in frames])):
            reply = stub.Complete(pb.CompletionRequest(model=MODEL, max_tokens=12, temperature=0, messages=[
                pb.ChatMessage(role="user", content=question, videos=[video])]), timeout=300)
            assert list(reply.token_ids) == want
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(pb.CompletionRequest(model=MODEL, max_tokens=4, messages=[
                pb.ChatMessage(role="user", content="hi", videos=[pb.Video(clip=b"not a clip")])]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(pb.CompletionRequest(model=MODEL, max_tokens=4, messages=[
                pb.ChatMessage(role="user", content="hi", videos=[pb.Video(frames=[png(frames[0])], fps=0)])]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "video_url.fps" in err.value.details()


def test_the_served_scenario_benchmark_measures_every_row_over_http_with_the_targets_answers(served, tmp_path):
    """One conversation of each scenario, every row a draft of the deployment: each row's answers
    are target-only's (float32 greedy), each row is timed, and the verdict is written."""
    from dataclasses import replace

    config = replace(ROWS, json_path=tmp_path / "served.json", plot_path=tmp_path / "served.png")
    result = run_served_multimodal_bench(config, server=served.http_url, progress=False)
    assert result["served"]["answers_unlike_target_only"] == {"multimodal": 0, "pooled": 0, "ensemble": 0,
                                                               "ensemble-static": 0}
    answered_by = result["served"]["requests_per_replica"]
    assert sum(answered_by.values()) == 3 * 5 and "?" not in answered_by
    assert set(result["served"]["resumed"].values()) == {0}   # no step failed under any row
    slowest = result["served"]["slowest_request_s"]
    assert len(slowest) == 3 * 5 and min(slowest.values()) > 0
    cells = {(r["view"], r["category"]): r for r in result["rows"]}
    assert set(cells) == {(v, c) for v in ("multimodal", "pooled", "ensemble", "ensemble-static", "target-only")
                          for c in ("single", "text-turn", "clip", "mix")}
    assert all(r["tokens_per_s"] > 0 and r["mean_accepted_len"] >= 1 for r in result["rows"])
    assert cells[("target-only", "mix")]["mean_accepted_len"] == 1
    assert max(cells[("multimodal", c)]["mean_accepted_len"] for c in ("single", "clip")) > 1
    assert set(result["aims"]["ensemble_over_best_view"]) == {"single", "text-turn", "clip", "mix"}
    assert (tmp_path / "served.json").exists() and (tmp_path / "served.png").stat().st_size > 0


def test_sparrows_served_rows_answer_as_target_only_and_take_each_prefill_from_the_decode_time(served, tmp_path):
    """A clip of two frames to every row of Sparrow's served bench: each row answers as target-only
    (float32 greedy), the heads and the draft LM draft, and the decode rate leaves the prefill out."""
    from dataclasses import replace

    config = replace(FRAMES, json_path=tmp_path / "frames.json", plot_path=tmp_path / "frames.png")
    result = run_served_multimodal_bench(config, server=served.http_url, progress=False)
    assert result["served"]["answers_unlike_target_only"] == {"full": 0, "windowed": 0, "windowed+ivsb": 0,
                                                               "draft-lm": 0}
    assert set(result["served"]["resumed"].values()) == {0}   # no step failed under any row
    rows = {r["draft_attention"]: r for r in result["frames"]}
    assert set(rows) == {"target-only", "full", "windowed", "windowed+ivsb", "draft-lm"} and not result["rows"]
    assert all(rows[r]["mean_accepted_len"] > 1 and rows[r]["draft_ms_per_token"] > 0 for r in rows if r != "target-only")
    assert all(r["decode_tokens_per_s"] > r["tokens_per_s"] for r in rows.values())
    assert {"windowed_speedup_kept", "full_speedup_kept", "ivsb_tau_gain_at_fewest"} <= set(result["frame_aims"])
    assert (tmp_path / "frames.png").stat().st_size > 0
    assert all(r["acceptance_rate"] > 0 for name, r in rows.items() if name != "target-only")
    # More frames than the server reads of a clip would be measured on fewer: refused before any request.
    with pytest.raises(ValueError, match="reads 16 frames of a clip at most"):
        run_served_multimodal_bench(replace(config, frames=(2, 32)), server=served.http_url, progress=False)
