"""Pictures in requests: data URLs decode to RGB pictures; anything else is a 400 that says what
to fix, never an exception that escapes."""

import base64
import io

import pytest
from PIL import Image
from specserve.data.synthetic_images import example
from specserve.ingress.images import ImageLimits, decode_image
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
    with pytest.raises(OpenAIError, match="TIFF is not taken"):
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
