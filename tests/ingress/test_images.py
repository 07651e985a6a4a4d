"""Pictures in requests: data URLs decode to RGB pictures; anything else is a 400 that says what
to fix, never an exception that escapes."""

import base64
import io

import pytest
from PIL import Image, ImageFile
from specserve.data.synthetic_images import example
from specserve.ingress.images import ImageLimits, decode_image, decode_images, fetches
from specserve.ingress.openai_api import ChatCompletionRequest, OpenAIError
from pydantic import ValidationError

LIMITS = ImageLimits()


def data_url(picture: Image.Image, fmt: str = "PNG", mime: str = "image/png") -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt)
    return f"data:{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_png_or_jpeg_data_url_is_a_picture():
    picture = example(3, "bars").image
    assert decode_image(data_url(picture), LIMITS).tobytes() == picture.tobytes()
    jpeg = decode_image(data_url(picture.convert("L"), "JPEG", "image/jpeg"), LIMITS)
    assert jpeg.mode == "RGB" and jpeg.size == picture.size


@pytest.mark.parametrize("url, says", [
    ("data:image/png;base64,@@@not-base64@@@", "not valid base64"),
    ("data:image/png,rawbytes", "data:image/<type>;base64"),
    ("data:image/png;base64," + base64.b64encode(b"not a picture at all").decode(), "could not be decoded"),
    ("https://example.com/cat.png", "fetching image URLs is off"),
    ("ftp://example.com/cat.png", "must be a data URL"),
])
def test_bad_pictures_are_400s_that_say_what_to_fix(url, says):
    with pytest.raises(OpenAIError, match=says) as err:
        decode_image(url, LIMITS)
    assert err.value.status == 400 and err.value.body()["error"]["code"] == "invalid_image"


def test_a_truncated_file_is_a_400():
    whole = base64.b64decode(data_url(example(4, "dots").image).split(",", 1)[1])
    with pytest.raises(OpenAIError, match="could not be decoded"):
        decode_image("data:image/png;base64," + base64.b64encode(whole[:len(whole) // 2]).decode(), LIMITS)


def test_a_format_not_taken_and_too_many_pixels_are_400s():
    # Only the taken formats' parsers read the bytes: a TIFF is not identified at all.
    with pytest.raises(OpenAIError, match="could not be decoded as PNG, JPEG"):
        decode_image(data_url(example(5).image, "TIFF", "image/tiff"), LIMITS)
    with pytest.raises(OpenAIError, match="more than 5000 pixels"):
        decode_image(data_url(example(5).image), ImageLimits(max_image_pixels=5000))


def test_chat_messages_take_image_parts_in_order():
    url = data_url(example(6).image)
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}]})
    message = request.messages[0]
    assert message.text() == "What is it?" and message.image_urls() == [url]
    assert message.template_content() == [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "colour": "blue"}}]}]})


# ---- the picture's shape, checked from its header -----------------------------------------------


def test_a_picture_longer_than_the_aspect_ratio_cap_is_refused_before_it_is_decoded(monkeypatch):
    # 50000x10 is 500k pixels, far under the pixel cap, but a processor that resizes its shortest
    # side to 336 would make 560 MP of it.
    url, loads = data_url(Image.new("L", (50000, 10))), []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or None)
    with pytest.raises(OpenAIError, match="50000x10, longer than 32:1") as err:
        decode_image(url, LIMITS)
    assert err.value.code == "invalid_image" and loads == []
    with pytest.raises(OpenAIError, match="longer than 32:1"):
        decode_image(data_url(Image.new("L", (10, 330))), LIMITS)


def test_a_long_but_reasonable_picture_is_taken():
    # A panorama or a long screenshot: 32:1 exactly is still taken.
    assert decode_image(data_url(Image.new("RGB", (320, 10))), LIMITS).size == (320, 10)


def test_any_error_while_decoding_is_the_pictures_400(monkeypatch):
    # Pillow's decoders raise more than OSError on damaged data (EOFError, struct.error,
    # IndexError...): whichever it is, the client gets invalid_image, not a 500.
    def fail(self):
        raise EOFError("no more frames")
    url = data_url(example(7).image)
    monkeypatch.setattr(ImageFile.ImageFile, "load", fail)
    with pytest.raises(OpenAIError, match="could not be decoded") as err:
        decode_image(url, LIMITS)
    assert err.value.code == "invalid_image"


@pytest.mark.parametrize("cut", [6, 13, 20, 35])
def test_an_empty_or_truncated_gif_is_a_400(cut):
    buffer = io.BytesIO()
    Image.new("P", (4, 4)).save(buffer, "GIF")   # 6-byte signature, 7-byte screen, then the picture
    payload = base64.b64encode(buffer.getvalue()[:cut]).decode()
    with pytest.raises(OpenAIError, match="could not be decoded") as err:
        decode_image("data:image/gif;base64," + payload, LIMITS)
    assert err.value.code == "invalid_image"


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_only_an_animations_first_frame_is_read(fmt):
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "green", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:])
    picture = decode_image(f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode(), LIMITS)
    assert picture.getpixel((4, 4))[0] > 200 and picture.getpixel((4, 4))[1] < 50   # red: frame 0


def test_a_camera_jpeg_with_a_second_picture_is_a_jpeg():
    # Pillow opens a JPEG with a Multi-Picture segment as MPO; its first picture is the photo.
    buffer = io.BytesIO()
    Image.new("RGB", (16, 8), "red").save(buffer, "MPO", save_all=True, append_images=[Image.new("RGB", (4, 4))])
    picture = decode_image("data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode(), LIMITS)
    assert picture.size == (16, 8)


# ---- a request's pictures together ------------------------------------------------------------


def test_decode_images_takes_a_requests_pictures_in_order():
    urls = [data_url(Image.new("RGB", (8, 8), colour)) for colour in ("red", "green", "blue")]
    pictures = decode_images(urls, LIMITS)
    assert [p.getpixel((0, 0)) for p in pictures] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    assert decode_images([], LIMITS) == []


def test_too_many_pictures_are_refused_before_any_is_decoded():
    urls = ["data:image/png;base64,@@@"] * 3   # none of them would decode: the count is checked first
    with pytest.raises(OpenAIError, match="3 images in one request; this server takes at most 2") as err:
        decode_images(urls, ImageLimits(max_images=2))
    assert err.value.code == "too_many_images" and err.value.status == 400


def test_the_requests_pictures_together_are_capped_before_the_one_past_the_cap_is_decoded(monkeypatch):
    # 3 pictures of 100x100 = 30000 pixels; the cap 25000 is passed by the third.
    limits = ImageLimits(max_total_pixels=25_000)
    urls = [data_url(Image.new("RGB", (100, 100)))] * 3
    assert len(decode_images(urls[:2], limits)) == 2
    loads = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or real_load(self))
    with pytest.raises(OpenAIError, match="more than 25000 pixels together") as err:
        decode_images(urls, limits)
    decoded = {id(picture) for picture in loads}   # load() runs again in convert(): count pictures
    assert err.value.code == "invalid_image" and len(decoded) == 2   # the third was never decoded
    # Each picture alone is still under its own cap: decode_image alone does not add them up.
    assert decode_image(urls[0], limits).size == (100, 100)


def test_only_http_urls_with_fetching_on_are_fetched():
    # The request that fetches is the one prepared on the fetch pool; data URLs never are.
    inline, remote = "data:image/png;base64,AAAA", "https://example.com/x.png"
    assert not fetches([inline], ImageLimits(allow_image_urls=True))
    assert not fetches([inline, remote], ImageLimits())   # off: refused, never fetched
    assert fetches([inline, remote], ImageLimits(allow_image_urls=True))
    assert not fetches([], ImageLimits(allow_image_urls=True))
