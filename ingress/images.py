"""Pictures and clips in requests: OpenAI ``image_url`` and vLLM ``video_url`` content parts,
decoded safely.

A part's URL is a ``data:`` URL (``data:image/png;base64,...``); remote ``http(s)`` URLs are
refused unless the operator allows fetching (``allow_image_urls``). Whatever comes, Pillow
identifies it from its bytes (the declared type is not trusted) among the formats below only, and
a picture is refused before it is decoded (Pillow reads its size from the header) when it has more
than ``max_image_pixels``, is longer than ``max_aspect_ratio`` to one, or would take a request's
pictures past ``max_total_pixels`` together. Only a picture's first frame is ever decoded: an
animation's later frames are never read, however many there are. Every failure is a 400 that says
what to fix; nothing a client sends can take the ingress down.

A clip (``video_url``) is an animated GIF, WebP or PNG, or a list of pictures (its frames). It is
sampled to ``max_video_frames`` frames spread evenly over it (vLLM's rule, ``sample_frames``)
before any frame is decoded: an animation's frame count is read from its file (at most
``max_clip_frames``), and only the sampled frames are decoded; a list's other pictures are never
opened. Every frame is checked as a picture is, and counts against ``max_total_pixels`` with the
request's pictures. A clip's frame rate (``SampledClip.fps``) is the request's ``fps`` or an
animation's own (its first frame's duration), times the share of frames sampled; None where
neither says it.

A URL is fetched by ``image_fetch.fetch`` (public addresses only, a deadline, a byte cap); a
request's fetches share one deadline, ``fetch_timeout_s`` from when it arrived, so a request of
``max_images`` slow URLs holds its thread no longer than a request of one.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from specserve.ingress.image_fetch import IPAddress, fetch, public_address
from specserve.ingress.openai_api import ImagePart, ImageURL, OpenAIError, VideoPart

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# A camera's JPEG that carries a second picture (a depth map, a preview) is opened as MPO; its
# first picture is the JPEG itself.
_JPEG_VARIANTS = ("MPO",)


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8                 # pictures per request
    max_image_pixels: int = 4096 * 4096
    allow_image_urls: bool = False      # fetch http(s) image URLs (else only data: URLs)
    fetch_timeout_s: float = 10.0       # one deadline for all of a request's fetches, redirects included
    max_image_bytes: int = 16 << 20     # a fetched picture's bytes at most
    # All of a request's pictures together: decoded as RGB, three bytes a pixel, at most ~100 MB.
    max_total_pixels: int = 2 * 4096 * 4096
    # Longest side over shortest: a processor that resizes the shortest side to S makes ratio x S²
    # pixels of a picture (50000x10 to S = 336: 560 MP). 32 takes panoramas and long screenshots.
    max_aspect_ratio: float = 32.0
    max_redirects: int = 3
    # Which resolved addresses a fetch may connect to; tests that serve on loopback replace it.
    allow_address: Callable[[IPAddress, int], bool] = public_address
    max_videos: int = 2                 # clips per request
    max_video_frames: int = 16          # frames a clip is sampled to, before any is decoded
    max_clip_frames: int = 4096         # frames an animated picture may hold (read before decoding)


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, param=param, code="invalid_image")


def fetches(urls: list[str], limits: ImageLimits) -> bool:
    """Whether decoding ``urls`` fetches any of them (an http(s) URL, with fetching on)."""
    return limits.allow_image_urls and any(url.startswith(("http://", "https://")) for url in urls)


def image_bytes(url: str, limits: ImageLimits, param: str, deadline: float | None = None) -> bytes:
    """The bytes a part's URL carries (a data URL's payload, or a picture fetched by ``deadline``)."""
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
        return fetch(url, limits, deadline, param)
    raise _bad("an image URL must be a data URL (data:image/png;base64,...) or http(s)", param)


def _open(data: bytes, limits: ImageLimits, param: str) -> Image.Image:
    """The picture in ``data``, identified and its header checked, not yet decoded."""
    try:
        # Only the taken formats' parsers read the bytes; no other plugin sees them.
        picture = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise _bad(f"the image could not be decoded as {', '.join(FORMATS)}: send one of those formats, whole",
                   param) from None
    except Exception as err:   # a parser's failure on a damaged header is the picture's
        raise _bad(f"the image could not be decoded ({type(err).__name__}); send a valid "
                   f"{'/'.join(FORMATS)} file", param) from None
    width, height = picture.size
    problem = None
    if picture.format not in FORMATS + _JPEG_VARIANTS:
        problem = f"image format {picture.format} is not taken; send one of {', '.join(FORMATS)}"
    elif width < 1 or height < 1:
        problem = f"the image is {width}x{height}: it has no pixels"
    elif width * height > limits.max_image_pixels:
        problem = f"the image is {width}x{height}, more than {limits.max_image_pixels} pixels: scale it down"
    elif max(width, height) > limits.max_aspect_ratio * min(width, height):
        problem = (f"the image is {width}x{height}, longer than {limits.max_aspect_ratio:g}:1 (longest side to "
                   "shortest): crop it or split it into several pictures")
    if problem:
        picture.close()
        raise _bad(problem, param)
    return picture


def _decode(picture: Image.Image, param: str) -> Image.Image:
    """An opened picture's first frame, as RGB."""
    try:
        with picture:
            picture.load()   # the current frame (the first) only: later frames are never read
            return picture.convert("RGB")
    except Exception as err:   # truncated or corrupt data: Pillow raises OSError, EOFError, SyntaxError, ...
        raise _bad(f"the image could not be decoded ({type(err).__name__}: {err}); send a valid "
                   f"{'/'.join(FORMATS)} file", param) from None


def decode_image(url: str, limits: ImageLimits, param: str = "messages") -> Image.Image:
    """The picture a part's URL carries, as RGB; ``OpenAIError`` (400) for anything else."""
    return _decode(_open(image_bytes(url, limits, param), limits, param), param)


def decode_images(urls: list[str], limits: ImageLimits, param: str = "messages",
                  deadline: float | None = None) -> list[Image.Image]:
    """A request's pictures, in order, as RGB: at most ``max_images`` of them (400
    ``too_many_images``), each checked as ``decode_image`` checks it and all together holding at
    most ``max_total_pixels`` (400 ``invalid_image``, before the one that passes it is decoded).
    Every fetch ends by ``deadline`` (``time.monotonic()``; ``fetch_timeout_s`` from now if none):
    one for the request, so that its pictures cannot each take the whole timeout."""
    parts = [ImagePart(type="image_url", image_url=ImageURL(url=url)) for url in urls]
    return [picture for (picture,) in decode_media(parts, limits, param, deadline)]


class SampledClip(list):
    """A clip's sampled frames, in order, and their frame rate (None where unknown)."""

    def __init__(self, frames, fps: float | None = None):
        super().__init__(frames)
        self.fps = fps


def _sampled_fps(fps: float | None, count: int, sampled: int) -> float | None:
    return None if fps is None else fps * sampled / count


def sample_frames(count: int, wanted: int) -> list[int]:
    """The indices of ``wanted`` frames spread evenly over ``count``, the first and the last among
    them (every frame when there are no more): vLLM's ``np.linspace(0, count - 1, wanted)``."""
    if count <= wanted:
        return list(range(count))
    return sorted({int(i) for i in np.linspace(0, count - 1, wanted, dtype=int)})


class _Pixels:
    """A request's running count of decoded pixels against ``max_total_pixels``."""

    def __init__(self, limits: ImageLimits, param: str):
        self.limits, self.param, self.total = limits, param, 0

    def add(self, width: int, height: int, frames: int = 1) -> None:
        self.total += width * height * frames
        if self.total > self.limits.max_total_pixels:
            raise _bad(f"the request's pictures and frames hold more than {self.limits.max_total_pixels} pixels "
                       "together: send fewer, smaller ones or shorter clips", self.param)


def _clip(url: str, fps: float | None, limits: ImageLimits, param: str, deadline: float,
          pixels: _Pixels) -> SampledClip:
    """An animated picture's sampled frames, as RGB, at ``fps`` or its own frame rate."""
    picture = _open(image_bytes(url, limits, param, deadline), limits, param)
    with picture:
        try:
            count = getattr(picture, "n_frames", 1)
        except Exception as err:   # a damaged animation: counting its frames reads their headers
            raise _bad(f"the clip's frames could not be read ({type(err).__name__}); send a valid animated "
                       "GIF, WebP or PNG, or the frames as a list of pictures", param) from None
        if count > limits.max_clip_frames:
            raise _bad(f"the clip has {count} frames, more than {limits.max_clip_frames}: send a shorter clip "
                       "or its frames as a list of pictures", param)
        chosen = sample_frames(count, limits.max_video_frames)
        pixels.add(*picture.size, frames=len(chosen))
        frames = []
        try:
            for i in chosen:
                picture.seek(i)
                frames.append(picture.convert("RGB"))
                if fps is None and i == 0:   # its duration, read once the frame is (WebP's is not before)
                    duration = picture.info.get("duration")
                    if isinstance(duration, (int, float)) and 0 < duration < float("inf"):
                        fps = 1000.0 / duration
        except Exception as err:   # truncated or corrupt frame data
            raise _bad(f"the clip's frame {i} could not be decoded ({type(err).__name__}); send a valid animated "
                       "GIF, WebP or PNG", param) from None
    return SampledClip(frames, _sampled_fps(fps, count, len(chosen)))


def decode_media(parts: list[ImagePart | VideoPart], limits: ImageLimits, param: str = "messages",
                 deadline: float | None = None) -> list[list[Image.Image]]:
    """Per part, in order, its pictures as RGB: a picture's one, a clip's sampled frames (a
    ``SampledClip``); at most
    ``max_images`` pictures and ``max_videos`` clips (checked before any is decoded), each picture
    and frame checked as ``decode_image`` checks a picture, and all of them together holding at
    most ``max_total_pixels`` (checked before the one that passes it is decoded). Every fetch ends
    by ``deadline`` (``fetch_timeout_s`` from now if none): one for the request."""
    pictures = [p for p in parts if isinstance(p, ImagePart)]
    clips = [p for p in parts if isinstance(p, VideoPart)]
    if len(pictures) > limits.max_images:
        raise OpenAIError(f"{len(pictures)} images in one request; this server takes at most {limits.max_images}",
                          param=param, code="too_many_images")
    if len(clips) > limits.max_videos:
        raise OpenAIError(f"{len(clips)} videos in one request; this server takes at most {limits.max_videos}",
                          param=param, code="too_many_videos")
    if deadline is None:
        deadline = time.monotonic() + limits.fetch_timeout_s
    pixels, out = _Pixels(limits, param), []
    for part in parts:
        if isinstance(part, VideoPart) and part.video_url.url is not None:
            out.append(_clip(part.video_url.url, part.video_url.fps, limits, param, deadline, pixels))
            continue
        urls = [part.image_url.url] if isinstance(part, ImagePart) else part.video_url.frames
        chosen = sample_frames(len(urls), limits.max_video_frames) if isinstance(part, VideoPart) else [0]
        frames = []
        for i in chosen:
            picture = _open(image_bytes(urls[i], limits, param, deadline), limits, param)
            try:
                pixels.add(*picture.size)
            except OpenAIError:
                picture.close()
                raise
            frames.append(_decode(picture, param))
        if isinstance(part, VideoPart):
            frames = SampledClip(frames, _sampled_fps(part.video_url.fps, len(urls), len(chosen)))
        out.append(frames)
    return out


def media_urls(parts: list[ImagePart | VideoPart]) -> list[str]:
    """Every URL the parts carry (a clip's frames all, though only the sampled ones are read)."""
    return [url for p in parts for url in (p.video_url.urls() if isinstance(p, VideoPart) else [p.image_url.url])]
