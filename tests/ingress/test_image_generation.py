"""POST /v1/images/generations' handler over a real target replica of a tiny image generator (the
class Serve constructs, called in this process through a handle-shaped adapter): pictures decoded
from the replica's guided image tokens, equal to the plain guided decoder's under greedy decoding;
bad fields answered 400 with OpenAI's body fields, before any model work."""

import asyncio
import base64
import io

import pytest
from PIL import Image
from pydantic import ValidationError

from specserve.ingress.config import IngressConfig
from specserve.ingress.image_generation import ImageGenerationRequest, NoText, PictureFace
from specserve.ingress.openai_api import OpenAIError
from specserve.ingress.resumable import TargetStreams
from specserve.policies.per_request import PolicyByRequest
from specserve.replicas.imagegen import generate, load_generator, to_pictures
from specserve.replicas.target_deployment import TargetConfig, TargetDeployment
from tiny_models import tiny_generator_draft, tiny_generator_folder


class LocalHandle:
    """A target deployment's handle over one replica object in this process."""

    def __init__(self, replica):
        self.replica = replica

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        replica = self.replica

        class Stream:
            def __aiter__(self):
                return replica.generate(request).__aiter__()

            def cancel(self):
                pass

        return Stream()


@pytest.fixture(scope="module")
def face(tmp_path_factory):
    folder = tiny_generator_folder(tmp_path_factory.mktemp("models"), grid=4)
    replica = TargetDeployment.func_or_class(TargetConfig(str(folder), dtype="float32", max_batch=4),
                                             policy=PolicyByRequest("static"),
                                             drafts={"draft": {"model": str(tiny_generator_draft(folder))}})
    config = IngressConfig(str(folder), "scenes", ["draft"], "draft", 3)
    return PictureFace(config, TargetStreams(LocalHandle(replica), NoText(), config)), folder


def decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_greedy_pictures_are_the_plain_guided_decoders(face):
    pictures, folder = face
    model, settings, tokenizer = load_generator(folder)
    body = asyncio.run(pictures.generate(ImageGenerationRequest(
        prompt="a red circle on a striped background", n=2, temperature=0, spec={"tree": {"depth": 3, "top_k": 2, "budget": 6}})))
    assert len(body["data"]) == 2 and body["data"][0]["revised_prompt"] == "a red circle on a striped background"
    # Class 2 (circle, red, stripes), guided at the generator's scale, greedy.
    want = to_pictures(tokenizer, generate(model, settings.layout, [2], settings.tokens, cfg_scale=settings.cfg_scale), 4)[0]
    for item in body["data"]:
        got = decoded(item["b64_json"])
        assert got.format == "PNG" and got.size == (16, 16)
        assert list(got.convert("RGB").getdata()) == list(want.getdata())
    assert all(spec["draft"] == "draft" for spec in body["spec"])


def test_seeded_pictures_repeat(face):
    pictures, _ = face
    ask = ImageGenerationRequest(prompt="A green circle on a plain background", n=2, seed=11, temperature=1.0)
    first, again = (asyncio.run(pictures.generate(ask)) for _ in range(2))
    assert [d["b64_json"] for d in first["data"]] == [d["b64_json"] for d in again["data"]]


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "a red circle"}, "prompt"),                                    # no background
    ({"prompt": "a red square on a plain background"}, "prompt"),              # a class the tiny model lacks
    ({"prompt": "a red circle on a plain background", "size": "1024x1024"}, "size"),
    ({"prompt": "a red circle on a plain background", "response_format": "url"}, "response_format"),
    ({"prompt": "a red circle on a plain background", "top_k": 33}, "top_k"),
    ({"prompt": "a red circle on a plain background", "spec": {"draft": "nope"}}, "spec.draft"),
    ({"prompt": "a red circle on a plain background", "spec": {"policy": "nope"}}, "spec.policy"),
    ({"prompt": "a red circle on a plain background", "spec": {"acceptance": "lantern", "lantern": {"k": 32}}},
     "spec.lantern.k"),                                                        # the tiny codebook has 32 codes
    ({"prompt": "a red circle on a plain background", "spec": {"lantern": {"delta": 0.3}}}, "spec.lantern"),
])
def test_bad_fields_are_400s_naming_the_field(face, fields, param):
    pictures, _ = face
    with pytest.raises(OpenAIError) as caught:
        asyncio.run(pictures.generate(ImageGenerationRequest(**fields)))
    assert caught.value.status == 400 and caught.value.param == param


def test_relaxed_acceptance_is_asked_for_and_named_in_each_pictures_spec(face):
    from scripted_target import GrpcContext
    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress.auth import ApiKeys
    from specserve.ingress.grpc_api import GrpcFace

    pictures, _ = face
    prompt = "a red circle on a striped background"
    body = asyncio.run(pictures.generate(ImageGenerationRequest(
        prompt=prompt, n=2, temperature=0, spec={"acceptance": "lantern", "tree": {"depth": 3, "top_k": 2, "budget": 6}})))
    assert len(body["data"]) == 2
    # The defaults: the ADT-Tree paper's δ, an eighth of the 32 codes.
    assert all(spec["acceptance"] == {"rule": "lantern", "delta": 0.4, "k": 4} for spec in body["spec"])
    exact = asyncio.run(pictures.generate(ImageGenerationRequest(prompt=prompt, temperature=0, spec={"acceptance": "exact"})))
    assert "acceptance" not in exact["spec"][0]
    rpc = GrpcFace("scenes", ApiKeys(), None, pictures.streams, pictures)
    got = asyncio.run(rpc.generate_image(pb.ImageRequest(
        prompt=prompt, temperature=0, spec=pb.SpecOptions(acceptance="lantern", lantern=pb.Relaxation(delta=0.2, k=3))),
        GrpcContext()))
    assert (got.pictures[0].spec.acceptance.rule, got.pictures[0].spec.acceptance.k) == ("lantern", 3)
    assert abs(got.pictures[0].spec.acceptance.delta - 0.2) < 1e-9


def test_another_model_is_a_404_and_the_body_is_checked_by_its_schema(face):
    pictures, _ = face
    with pytest.raises(OpenAIError) as caught:
        asyncio.run(pictures.generate(ImageGenerationRequest(prompt="a red circle on a plain background", model="gpt")))
    assert caught.value.status == 404
    for bad in ({"prompt": "x", "n": 9}, {"prompt": ""}, {"prompt": "x", "cfg_scale": 0}, {"prompt": "x", "quality": "hd"}):
        with pytest.raises(ValidationError):
            ImageGenerationRequest(**bad)


def test_grpc_generate_image_gives_the_same_pictures_as_png_bytes(face):
    import grpc

    from scripted_target import GrpcContext
    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress.auth import ApiKeys
    from specserve.ingress.grpc_api import GrpcFace

    pictures, _ = face
    rpc = GrpcFace("scenes", ApiKeys(), None, pictures.streams, pictures)
    prompt = "a red circle on a striped background"
    got = asyncio.run(rpc.generate_image(pb.ImageRequest(prompt=prompt, temperature=0, n=1), GrpcContext()))
    http = asyncio.run(pictures.generate(ImageGenerationRequest(prompt=prompt, temperature=0)))
    assert [p.png for p in got.pictures] == [base64.b64decode(d["b64_json"]) for d in http["data"]]
    assert got.pictures[0].revised_prompt == prompt and got.pictures[0].spec.draft == "draft"
    bad = GrpcContext()
    asyncio.run(rpc.generate_image(pb.ImageRequest(prompt="a red circle"), bad))
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT and "background" in bad.details
    text_only = GrpcContext()
    asyncio.run(GrpcFace("m", ApiKeys(), None, pictures.streams).generate_image(pb.ImageRequest(prompt=prompt), text_only))
    assert text_only.code == grpc.StatusCode.INVALID_ARGUMENT and "Complete" in text_only.details
