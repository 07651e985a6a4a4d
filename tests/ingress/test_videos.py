"""Clips in requests (vLLM's ``video_url`` parts): an animated picture or a list of frames,
sampled evenly to ``max_video_frames`` before any frame is decoded; every limit a 400 that says
what to fix."""

import base64
import io

import pytest
from PIL import Image
from pydantic import ValidationError

from specserve.ingress.images import ImageLimits, decode_media, media_urls, sample_frames
from specserve.ingress.openai_api import ChatCompletionRequest, OpenAIError

LIMITS = ImageLimits(max_video_frames=4)


def frame(i: int, size=(16, 12)) -> Image.Image:
    return Image.new("RGB", size, (i * 5 % 256, 255 - i * 5 % 256, 40))


def clip_url(n: int, fmt: str = "GIF", size=(16, 12)) -> str:
    buffer = io.BytesIO()
    frames = [frame(i, size) for i in range(n)]
    frames[0].save(buffer, format=fmt, save_all=True, append_images=frames[1:], duration=40, lossless=True)
    return "data:image/gif;base64," + base64.b64encode(buffer.getvalue()).decode()


def picture_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def message(*parts) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What moves?"}]}]})


def test_frames_are_sampled_evenly_first_and_last_included():
    assert sample_frames(3, 4) == [0, 1, 2]
    assert sample_frames(40, 4) == [0, 13, 26, 39]
    assert sample_frames(1000, 16)[0] == 0 and sample_frames(1000, 16)[-1] == 999 and len(sample_frames(1000, 16)) == 16


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_an_animated_picture_is_a_clip_of_its_sampled_frames(fmt):
    request = message({"type": "video_url", "video_url": {"url": clip_url(40, fmt)}})
    (frames,) = decode_media(request.messages[0].media(), LIMITS)
    assert len(frames) == 4 and all(f.mode == "RGB" and f.size == (16, 12) for f in frames)
    for got, index in zip(frames, [0, 13, 26, 39]):
        expected = frame(index).getpixel((3, 3))
        assert all(abs(a - b) <= 8 for a, b in zip(got.getpixel((3, 3)), expected)), (fmt, index)


def test_a_list_of_frames_opens_only_the_sampled_ones():
    urls = [picture_url(frame(i)) for i in range(10)]
    urls[1] = "data:image/png;base64," + base64.b64encode(b"never opened").decode()   # not sampled: 0, 3, 6, 9
    request = message({"type": "image_url", "image_url": {"url": urls[0]}},
                      {"type": "video_url", "video_url": {"frames": urls}})
    picture, frames = decode_media(request.messages[0].media(), LIMITS)
    assert len(picture) == 1 and [f.getpixel((0, 0)) for f in frames] == [frame(i).getpixel((0, 0)) for i in (0, 3, 6, 9)]
    assert len(media_urls(request.messages[0].media())) == 11
    # The template sees the clip as its sampled frames, pictures one after another.
    content = request.messages[0].template_content(lambda part: 4)
    assert [p["type"] for p in content] == ["image"] * 5 + ["text"]
    urls[3] = urls[1]   # a sampled frame that is not a picture
    with pytest.raises(OpenAIError, match="could not be decoded") as err:
        decode_media(message({"type": "video_url", "video_url": {"frames": urls}}).messages[0].media(), LIMITS)
    assert err.value.status == 400


def test_a_video_url_has_a_clip_or_frames_not_both():
    for source in ({}, {"url": clip_url(2), "frames": [picture_url(frame(0))]}):
        with pytest.raises(ValidationError, match="either url"):
            message({"type": "video_url", "video_url": source})
    with pytest.raises(ValidationError):
        message({"type": "video_url", "video_url": {"frames": []}})


def test_clip_limits_are_400s_before_the_frames_are_decoded():
    clip = {"type": "video_url", "video_url": {"url": clip_url(12)}}
    with pytest.raises(OpenAIError, match="3 videos") as err:
        decode_media(message(clip, clip, clip).messages[0].media(), LIMITS)
    assert err.value.body()["error"]["code"] == "too_many_videos"
    with pytest.raises(OpenAIError, match="12 frames, more than 10"):
        decode_media(message(clip).messages[0].media(), ImageLimits(max_clip_frames=10))
    # 4 sampled frames of 16 x 12 pixels: 768 pixels, past a cap of 700 before any is decoded.
    with pytest.raises(OpenAIError, match="more than 700 pixels"):
        decode_media(message(clip).messages[0].media(), ImageLimits(max_video_frames=4, max_total_pixels=700))
    assert len(decode_media(message(clip).messages[0].media(), ImageLimits(max_video_frames=4, max_total_pixels=800))[0]) == 4
    with pytest.raises(OpenAIError, match="could not be decoded"):
        broken = {"type": "video_url", "video_url": {"url": "data:image/gif;base64," + base64.b64encode(b"GIF89a").decode()}}
        decode_media(message(broken).messages[0].media(), LIMITS)


@pytest.fixture(scope="module")
def qwen2_vl_preparer(tmp_path_factory):
    from specserve.ingress.config import IngressConfig
    from specserve.ingress.prepare import Preparer
    from specserve.replicas.vlm import load_target_text
    from tiny_models import tiny_vlm_folder

    folder = tiny_vlm_folder("qwen2-vl", tmp_path_factory.mktemp("qwen2-vl"))
    return Preparer(load_target_text(str(folder)), IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4))


def test_a_class_that_reads_clips_as_video_gets_one_video_part_of_temporal_patches(qwen2_vl_preparer):
    """Qwen2-VL's class: the clip is one video part of the template, its placeholder expanded to
    the clip's temporal patches (two frames a patch), every patch after the first continuing it;
    a picture beside it stays a picture."""
    from specserve.replicas.model.image_tokens import CLIP_FLAG, cell, is_picture_token, starts_picture

    frames = {"type": "video_url", "video_url": {"frames": [picture_url(frame(i, (32, 16))) for i in range(3)]}}
    request = message({"type": "image_url", "image_url": {"url": picture_url(frame(9, (16, 16)))}}, frames)
    prepared = qwen2_vl_preparer._prepare(request, request.messages[0].media())
    ids, units = prepared.spec_request.prompt_ids, prepared.spec_request.images
    starts = [t for t in ids if starts_picture(t)]
    assert len(units) == 1 + 2 and [bool(cell(t)[0] & CLIP_FLAG) for t in starts] == [False, False, True]
    assert [u.continues for u in units] == [False, False, True]
    assert sum(is_picture_token(t) for t in ids) == sum(u.grid.count for u in units)
    video = qwen2_vl_preparer.video_placeholder
    assert video not in ids and qwen2_vl_preparer.image_placeholder not in ids


@pytest.mark.parametrize("sizes", [[(32, 16), (16, 32)], [(32, 16), (32, 16), (16, 32)]], ids=["pair", "across-patches"])
def test_a_clip_whose_frames_differ_in_size_is_a_400_for_a_class_that_reads_video(qwen2_vl_preparer, sizes):
    urls = [picture_url(frame(i, size)) for i, size in enumerate(sizes)]
    request = message({"type": "video_url", "video_url": {"frames": urls}})
    with pytest.raises(OpenAIError, match="frames must share one size, got 16x32 and 32x16") as err:
        qwen2_vl_preparer._prepare(request, request.messages[0].media())
    assert err.value.param == "messages"


def test_a_clip_of_more_temporal_patches_than_its_grid_is_wide_is_a_400(qwen2_vl_preparer):
    # 16 x 16 px frames: a 2 x 2 grid of image tokens, so at most 2 patches (4 frames).
    fits = message({"type": "video_url", "video_url": {"frames": [picture_url(frame(i, (16, 16))) for i in range(4)]}})
    assert len(qwen2_vl_preparer._prepare(fits, fits.messages[0].media()).spec_request.images) == 2
    long = message({"type": "video_url", "video_url": {"frames": [picture_url(frame(i, (16, 16))) for i in range(5)]}})
    with pytest.raises(OpenAIError, match=r"3 temporal patches\) reaches time step 2 on a grid of 2 x 2"):
        qwen2_vl_preparer._prepare(long, long.messages[0].media())


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_a_clips_frame_rate_is_the_requests_or_the_animations_own_times_the_share_sampled(fmt):
    animation = clip_url(40, fmt)   # 40 ms a frame: 25 frames a second, 4 of 40 sampled
    assert decode_media(message({"type": "video_url", "video_url": {"url": animation}}).messages[0].media(),
                        LIMITS)[0].fps == pytest.approx(2.5)
    assert decode_media(message({"type": "video_url", "video_url": {"url": animation, "fps": 10}}).messages[0].media(),
                        LIMITS)[0].fps == pytest.approx(1.0)
    urls = [picture_url(frame(i)) for i in range(10)]
    assert decode_media(message({"type": "video_url", "video_url": {"frames": urls, "fps": 5}}).messages[0].media(),
                        LIMITS)[0].fps == pytest.approx(2.0)
    assert decode_media(message({"type": "video_url", "video_url": {"frames": urls[:3]}}).messages[0].media(),
                        LIMITS)[0].fps is None
    for fps in (0, -2, 1e6, "fast"):
        with pytest.raises(ValidationError, match="fps"):
            message({"type": "video_url", "video_url": {"frames": urls, "fps": fps}})


def test_a_grpc_clip_carries_its_frame_rate_only_where_it_is_set():
    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress.grpc_api import pb_content

    frames = [b"one", b"two"]
    (unset, _), (set_, _), (zero, _) = (pb_content(pb.ChatMessage(content="?", videos=[video]))
                                        for video in (pb.Video(frames=frames), pb.Video(frames=frames, fps=2.5),
                                                      pb.Video(frames=frames, fps=0)))
    assert "fps" not in unset["video_url"] and set_["video_url"]["fps"] == 2.5
    with pytest.raises(ValidationError, match="fps"):   # a zero rate sent is refused, not read as unset
        message(zero)


def test_qwen2_5_vl_places_a_clips_patches_in_time_by_its_frame_rate(tmp_path):
    """Qwen2.5-VL's class (4 tokens a second): 2 frames a patch at the request's 4 frames a second
    is 2 steps a patch; frames without a rate read at 2 a second (4 steps); a rate that spreads
    the patches past the grid is a 400."""
    from specserve.ingress.config import IngressConfig
    from specserve.ingress.prepare import Preparer
    from specserve.replicas.model.image_tokens import cell, clip_advance, starts_picture
    from specserve.replicas.vlm import load_target_text
    from tiny_models import tiny_vlm_folder

    preparer = Preparer(load_target_text(str(tiny_vlm_folder("qwen2.5-vl", tmp_path / "q"))),
                        IngressConfig("t", "m", ["prompt-lookup"], "prompt-lookup", 4))
    urls = [picture_url(frame(i, (48, 48))) for i in range(4)]   # a 6 x 6 grid of image tokens, 2 patches

    def advances(video_url: dict) -> list[int]:
        request = message({"type": "video_url", "video_url": video_url})
        ids = preparer._prepare(request, request.messages[0].media()).spec_request.prompt_ids
        return [int(clip_advance(cell(t)[0])) for t in ids if starts_picture(t)][1:]

    assert advances({"frames": urls, "fps": 4}) == [2]
    assert advances({"frames": urls}) == [4]
    with pytest.raises(OpenAIError, match="reaches time step 8 .*shorter clip") as err:
        advances({"frames": urls, "fps": 1})
    assert err.value.status == 400


def test_a_video_placeholder_typed_in_text_is_a_400(qwen2_vl_preparer):
    picture = {"type": "image_url", "image_url": {"url": picture_url(frame(1, (16, 16)))}}
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [picture, {"type": "text", "text": "and <|video_pad|> here?"}]}]})
    with pytest.raises(OpenAIError, match="1 video placeholder.*for 0 video"):
        qwen2_vl_preparer._prepare(request, request.messages[0].media())
