"""Pictures in requests: OpenAI ``image_url`` content parts, decoded safely.

A part's URL is a ``data:`` URL (``data:image/png;base64,...``); remote ``http(s)`` URLs are
refused unless the operator allows fetching (``allow_image_urls``). Whatever comes, Pillow
identifies it from its bytes (the declared type is not trusted) among the formats below only, and
a picture is refused before it is decoded (Pillow reads its size from the header) when it has more
than ``max_image_pixels``, is longer than ``max_aspect_ratio`` to one, or would take a request's
pictures past ``max_total_pixels`` together. Only a picture's first frame is ever decoded: an
animation's later frames are never read, however many there are. Every failure is a 400 that says
what to fix; nothing a client sends can take the ingress down.

A fetch (``fetch``) goes to public addresses only: each hop's host is resolved, every address it
resolves to must pass ``ImageLimits.allow_address`` (by default ``public_address``), and the
connection goes to the address that was checked, so a second lookup cannot steer it elsewhere.
Redirects are followed by hand, at most ``max_redirects``, each hop checked the same way. One
deadline (``fetch_timeout_s``) covers the whole fetch, resolving and redirects included, and the
body is capped at ``max_image_bytes`` as it streams. A failed fetch says only that it failed: which
step failed (no such host, a private address, a refused connection, a status) would tell a client
what lies behind the server.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from specserve.ingress.openai_api import OpenAIError

logger = logging.getLogger(__name__)

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
# A camera's JPEG that carries a second picture (a depth map, a preview) is opened as MPO; its
# first picture is the JPEG itself.
_JPEG_VARIANTS = ("MPO",)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# 64:ff9b::/96 (NAT64) carries an IPv4 address in its last 32 bits, which a NAT64 gateway reaches.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)
FETCH_FAILED = "could not fetch the picture at this URL"


def _embedded_ipv4(address: IPAddress) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address leads to (mapped, 6to4, Teredo, NAT64)."""
    if address.version == 4:
        return []
    found = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
    if address in _NAT64:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return [a for a in found if a is not None]


def public_address(address: IPAddress, port: int) -> bool:
    """Whether a fetch may connect to ``address``: a globally routable unicast address, and so is
    any IPv4 address it embeds. Any port: the address is what keeps a fetch off the server's own
    network."""
    def routable(a: IPAddress) -> bool:
        return a.is_global and not (a.is_private or a.is_loopback or a.is_link_local or a.is_multicast
                                    or a.is_reserved or a.is_unspecified or getattr(a, "is_site_local", False))
    return routable(address) and all(routable(a) for a in _embedded_ipv4(address))


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8                 # pictures per request
    max_image_pixels: int = 4096 * 4096
    allow_image_urls: bool = False      # fetch http(s) image URLs (else only data: URLs)
    fetch_timeout_s: float = 10.0       # one deadline for a whole fetch, redirects included
    max_image_bytes: int = 16 << 20     # a fetched picture's bytes at most
    # All of a request's pictures together: decoded as RGB, three bytes a pixel, at most ~100 MB.
    max_total_pixels: int = 2 * 4096 * 4096
    # Longest side over shortest: a processor that resizes the shortest side to S makes ratio x S²
    # pixels of a picture (50000x10 to S = 336: 560 MP). 32 takes panoramas and long screenshots.
    max_aspect_ratio: float = 32.0
    max_redirects: int = 3
    # Which resolved addresses a fetch may connect to; tests that serve on loopback replace it.
    allow_address: Callable[[IPAddress, int], bool] = public_address


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
        return fetch(url, limits, param)
    raise _bad("an image URL must be a data URL (data:image/png;base64,...) or http(s)", param)


# ---- fetching ---------------------------------------------------------------------------------


class _Refused(Exception):
    """Why a fetch failed: for the server's log, never for the client."""


def fetch(url: str, limits: ImageLimits, param: str = "messages") -> bytes:
    """The body of a public http(s) URL, within ``limits``; else a 400 ``invalid_image`` that
    says only ``FETCH_FAILED`` and what a fetchable picture is."""
    deadline = time.monotonic() + limits.fetch_timeout_s
    try:
        for _ in range(limits.max_redirects + 1):
            body, location = _get(url, limits, deadline)
            if location is None:
                return body
            url = urljoin(url, location)
        raise _Refused(f"more than {limits.max_redirects} redirects")
    except Exception as err:   # any failure of a fetch is the URL's, and reads the same to the client
        logger.info("picture fetch failed: %s: %s", type(err).__name__, err)
        raise _bad(f"{FETCH_FAILED}: give a public http(s) URL that answers within {limits.fetch_timeout_s:g} s "
                   f"with a picture of at most {limits.max_image_bytes} bytes, or send it as a data URL", param) from None


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Refused("deadline passed")
    return left


def _resolve(host: str, port: int, limits: ImageLimits, deadline: float) -> IPAddress:
    """The address to connect to: every address ``host`` resolves to must be allowed."""
    found: dict = {}

    def lookup():
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            found["error"] = err

    # The resolver takes no timeout: it runs on a thread the fetch stops waiting for.
    thread = threading.Thread(target=lookup, daemon=True, name="picture-url-lookup")
    thread.start()
    thread.join(_left(deadline))
    if "infos" not in found:
        raise _Refused(f"{host} did not resolve: {found.get('error', 'deadline passed')}")
    addresses = [ipaddress.ip_address(info[4][0]) for info in found["infos"]]
    refused = [str(a) for a in addresses if not limits.allow_address(a, port)]
    if not addresses or refused:
        raise _Refused(f"{host} resolves to addresses a fetch may not reach: {refused}")
    return addresses[0]


class _Watchdog:
    """Shuts a connection's socket at the deadline, so that no run of slow reads (a byte every few
    seconds, each within a per-read timeout) outlasts it."""

    def __init__(self, deadline: float):
        self.sock: socket.socket | None = None
        self.expired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self):
        self.expired = True
        if self.sock is not None:
            try:   # the plain socket's shutdown: a TLS socket's own would drop its state mid-read
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self):
        self._timer.cancel()


def _get(url: str, limits: ImageLimits, deadline: float) -> tuple[bytes, str | None]:
    """One hop: ``(body, None)`` for a 200, ``(b"", location)`` for a redirect."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise _Refused("not an http(s) URL with a host and no credentials")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = _resolve(parts.hostname, port, limits, deadline)
    watchdog = _Watchdog(deadline)
    sock = response = None
    try:
        sock = socket.create_connection((str(address), port), timeout=_left(deadline))
        watchdog.sock = sock
        if parts.scheme == "https":
            # The certificate is checked against the URL's host, the connection is to its address.
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname,
                                                            do_handshake_on_connect=False)
            watchdog.sock = sock
            sock.do_handshake()
        connection = http.client.HTTPConnection(parts.hostname, port)
        connection.sock = sock   # already connected: http.client only speaks HTTP over it
        connection.putrequest("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                              skip_host=True, skip_accept_encoding=True)
        for name, value in (("Host", parts.netloc), ("Accept", "image/*"), ("Accept-Encoding", "identity"),
                            ("User-Agent", "specserve"), ("Connection", "close")):
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return b"", response.getheader("Location")
        if response.status != 200:
            raise _Refused(f"status {response.status}")
        declared = response.getheader("Content-Length", "")
        if declared.isdigit() and int(declared) > limits.max_image_bytes:
            raise _Refused(f"Content-Length {declared} over {limits.max_image_bytes}")
        chunks, size = [], 0
        while chunk := response.read1(64 << 10):
            size += len(chunk)
            if size > limits.max_image_bytes:
                raise _Refused(f"body over {limits.max_image_bytes} bytes")
            chunks.append(chunk)
        # A socket shut by the watchdog reads as the end of the body: the deadline decides.
        if watchdog.expired or time.monotonic() > deadline:
            raise _Refused("deadline passed")
        return b"".join(chunks), None
    finally:
        watchdog.cancel()
        if response is not None:
            response.close()   # the socket's file descriptor closes with the last reader of it
        if sock is not None:
            sock.close()


# ---- decoding ---------------------------------------------------------------------------------


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


def decode_images(urls: list[str], limits: ImageLimits, param: str = "messages") -> list[Image.Image]:
    """A request's pictures, in order, as RGB: at most ``max_images`` of them (400
    ``too_many_images``), each checked as ``decode_image`` checks it and all together holding at
    most ``max_total_pixels`` (400 ``invalid_image``, before the one that passes it is decoded)."""
    if len(urls) > limits.max_images:
        raise OpenAIError(f"{len(urls)} images in one request; this server takes at most {limits.max_images}",
                          param=param, code="too_many_images")
    pictures, total = [], 0
    for url in urls:
        picture = _open(image_bytes(url, limits, param), limits, param)
        total += picture.size[0] * picture.size[1]
        if total > limits.max_total_pixels:
            picture.close()
            raise _bad(f"the request's pictures hold more than {limits.max_total_pixels} pixels together: "
                       "send fewer or smaller ones", param)
        pictures.append(_decode(picture, param))
    return pictures
