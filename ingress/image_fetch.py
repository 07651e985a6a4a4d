"""Fetching a picture from an http(s) URL, safely: ``fetch``.

A fetch goes to public addresses only: each hop's host is resolved, every address it resolves to
must pass ``ImageLimits.allow_address`` (by default ``public_address``), and the connection goes to
the address that was checked, so a second lookup cannot steer it elsewhere. Redirects are followed
by hand, at most ``max_redirects``, each hop checked the same way. A deadline covers the whole
fetch, resolving and redirects included (a request's fetches share one: ``fetch_timeout_s`` from
the request's arrival), and the body is capped at ``max_image_bytes`` as it streams. A failed fetch
says only that it failed: which step failed (no such host, a private address, a refused
connection, a status) would tell a client what lies behind the server.

Requests that fetch are prepared on ``fetch_pool``, a few threads of their own: a slow picture
server holds a thread until the deadline, and on the shared pool it would hold the threads that
every other request's tokenising waits for.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from specserve.ingress.openai_api import OpenAIError

if TYPE_CHECKING:   # images.py imports this module: the limits are only read here, never built
    from specserve.ingress.images import ImageLimits

logger = logging.getLogger(__name__)

FETCH_FAILED = "could not fetch the picture at this URL"
# Requests fetching at once; more wait for a thread, their deadline running.
FETCH_THREADS = 8
fetch_pool = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="image-fetch")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# 64:ff9b::/96 (NAT64) carries an IPv4 address in its last 32 bits, which a NAT64 gateway reaches.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)


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


class _Refused(Exception):
    """Why a fetch failed: for the server's log, never for the client."""


def fetch(url: str, limits: ImageLimits, deadline: float | None = None, param: str = "messages") -> bytes:
    """The body of a public http(s) URL, within ``limits`` and by ``deadline`` (``time.monotonic()``;
    ``fetch_timeout_s`` from now if none); else a 400 ``invalid_image`` that says only
    ``FETCH_FAILED`` and what a fetchable picture is."""
    if deadline is None:
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
        raise OpenAIError(f"{FETCH_FAILED}: give public http(s) URLs that answer within {limits.fetch_timeout_s:g} s "
                          f"(a request's pictures together), each picture at most {limits.max_image_bytes} bytes, "
                          "or send them as data URLs", param=param, code="invalid_image") from None


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

    left = _left(deadline)   # a fetch that starts past its deadline fails before it resolves
    # The resolver takes no timeout: it runs on a thread the fetch stops waiting for.
    thread = threading.Thread(target=lookup, daemon=True, name="picture-url-lookup")
    thread.start()
    thread.join(left)
    if "infos" not in found:
        raise _Refused(f"{host} did not resolve: {found.get('error', 'deadline passed')}")
    addresses = [ipaddress.ip_address(info[4][0]) for info in found["infos"]]
    refused = [str(a) for a in addresses if not limits.allow_address(a, port)]
    if not addresses or refused:
        raise _Refused(f"{host} resolves to addresses a fetch may not reach: {refused}")
    return addresses[0]


def _shut(sock: socket.socket) -> None:
    try:   # the plain socket's shutdown: a TLS socket's own would drop its state mid-read
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Watchdog:
    """Shuts a connection's socket at the deadline, so that no run of slow reads (a byte every few
    seconds, each within a per-read timeout) outlasts it. A socket given after the deadline is shut
    at once: the timer has fired and will not come back for it."""

    def __init__(self, deadline: float):
        self._sock: socket.socket | None = None
        self.expired = False
        # Whichever of ``watch`` and the timer comes second sees the other's write, and shuts.
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock, expired = sock, self.expired
        if expired:
            _shut(sock)

    def _expire(self):
        with self._lock:
            self.expired, sock = True, self._sock
        if sock is not None:
            _shut(sock)

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
        watchdog.watch(sock)
        if parts.scheme == "https":
            # The certificate is checked against the URL's host, the connection is to its address.
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname,
                                                            do_handshake_on_connect=False)
            watchdog.watch(sock)
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
        # A socket shut by the watchdog reads as the end of the body: the deadline decides, at
        # every read, so that no read runs on past it.
        while not watchdog.expired and (chunk := response.read1(64 << 10)):
            size += len(chunk)
            if size > limits.max_image_bytes:
                raise _Refused(f"body over {limits.max_image_bytes} bytes")
            chunks.append(chunk)
        if watchdog.expired or time.monotonic() > deadline:
            raise _Refused("deadline passed")
        return b"".join(chunks), None
    finally:
        watchdog.cancel()
        if response is not None:
            response.close()   # the socket's file descriptor closes with the last reader of it
        if sock is not None:
            sock.close()
