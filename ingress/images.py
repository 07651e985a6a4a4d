"""Pictures in requests: OpenAI ``image_url`` content parts, decoded safely.

A part's URL is a ``data:`` URL (``data:image/png;base64,...``); remote ``http(s)`` URLs are
refused unless the operator allows fetching (``allow_image_urls``), and then fetched with a
deadline and a size cap. Whatever comes, Pillow identifies it from its bytes (the declared type
is not trusted), only the formats below are taken, and a picture larger than ``max_image_pixels``
is refused before it is decoded (Pillow reads the size from the header). Every failure is a 400
that says what to fix; nothing a client sends can take the ingress down.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from specserve.ingress.openai_api import OpenAIError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8                 # pictures per request
    max_image_pixels: int = 4096 * 4096
    allow_image_urls: bool = False      # fetch http(s) image URLs (else only data: URLs)
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 16 << 20     # a fetched picture's bytes at most


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param=param, code="invalid_image")


def image_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes a part's URL carries (a data URL's payload, or a fetched picture)."""
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise _bad("an image data URL must read data:image/<type>;base64,<data>", param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise _bad("the image data URL's payload is not valid base64", param) from None
    if url.startswith(("http://", "https://")):
        if not limits.allow_image_urls:
            raise _bad("this server takes pictures inline only: send the image as a data URL "
                       "(data:image/png;base64,...); fetching image URLs is off", param)
        try:
            with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:   # noqa: S310
                data = response.read(limits.max_image_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise _bad(f"could not fetch the image URL: {err}", param) from None
        if len(data) > limits.max_image_bytes:
            raise _bad(f"the image at the URL is larger than {limits.max_image_bytes} bytes", param)
        return data
    raise _bad("an image URL must be a data URL (data:image/png;base64,...) or http(s)", param)


def decode_image(url: str, limits: ImageLimits, param: str = "messages") -> Image.Image:
    """The picture a part's URL carries, as RGB; ``OpenAIError`` (400) for anything else."""
    data = image_bytes(url, limits, param)
    try:
        with Image.open(io.BytesIO(data)) as picture:
            if picture.format not in FORMATS:
                raise _bad(f"image format {picture.format} is not taken; send one of {', '.join(FORMATS)}", param)
            width, height = picture.size
            if width * height > limits.max_image_pixels:
                raise _bad(f"the image is {width}x{height}, more than {limits.max_image_pixels} pixels: scale it down",
                           param)
            picture.load()
            return picture.convert("RGB")
    except OpenAIError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as err:
        raise _bad(f"the image could not be decoded ({type(err).__name__}: {err}); send a valid "
                   f"{'/'.join(FORMATS)} file", param) from None
