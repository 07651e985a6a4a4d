"""Fetching a picture URL: public addresses only, every redirect checked, one deadline for a
request's fetches, a byte cap, and the same 400 whatever failed."""

import base64
import http.server
import io
import ipaddress
import socket
import threading
import time

import pytest
from PIL import Image
from specserve.ingress.image_fetch import FETCH_FAILED, _Watchdog, fetch, public_address
from specserve.ingress.images import ImageLimits, decode_images
from specserve.ingress.openai_api import OpenAIError

# The servers below listen on 127.0.0.1, which the default policy refuses; a test that must reach
# one allows exactly that server's port, so that every other hop (another loopback port, the
# cloud metadata address) still meets the policy a deployment runs with.

def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png(Image.new("RGB", (8, 8), "red"))


class Site:
    """An HTTP server on a loopback port, on its own threads; ``respond(handler)`` answers a GET."""

    def __init__(self, respond):
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                site.hits.append(self.path)
                try:
                    respond(self)
                except OSError:   # the client hung up: what a refused fetch does
                    pass

            def log_message(self, *_):
                pass

        self.hits: list[str] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sites():
    opened = []

    def site(respond) -> Site:
        opened.append(Site(respond))
        return opened[-1]
    yield site
    for s in opened:
        s.close()


def picture(handler):
    handler.send_response(200)
    handler.send_header("Content-Type", "image/png")
    handler.send_header("Content-Length", str(len(PNG)))
    handler.end_headers()
    handler.wfile.write(PNG)


def redirect(to: str):
    def respond(handler):
        handler.send_response(302)
        handler.send_header("Location", to)
        handler.end_headers()
    return respond


def only(*sites_allowed: Site, asked: list | None = None):
    """A policy that allows exactly these servers' loopback ports, and public addresses."""
    ports = {s.port for s in sites_allowed}

    def allow(address, port):
        if asked is not None:
            asked.append((str(address), port))
        return (address == ipaddress.ip_address("127.0.0.1") and port in ports) or public_address(address, port)
    return allow


def fetching(allow=public_address, **limits) -> ImageLimits:
    return ImageLimits(allow_image_urls=True, allow_address=allow, **{"fetch_timeout_s": 2.0, **limits})


def refused(url: str, limits: ImageLimits, within_s: float = 3.0) -> OpenAIError:
    start = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        fetch(url, limits)
    assert time.monotonic() - start < within_s, f"refused only after {time.monotonic() - start:.1f} s"
    assert err.value.status == 400 and err.value.code == "invalid_image"
    assert err.value.message.startswith(FETCH_FAILED), err.value.message
    return err.value


def test_a_fetch_follows_redirects_between_allowed_servers(sites):
    # The control for the refusals below: with both servers allowed the same redirect is followed.
    second = sites(picture)
    first = sites(redirect(f"{second.url}/cat.png"))
    assert fetch(f"{first.url}/start", fetching(only(first, second))) == PNG and second.hits == ["/cat.png"]


def test_a_redirect_to_another_loopback_port_is_refused_and_never_followed(sites):
    inside = sites(picture)
    first = sites(redirect(f"{inside.url}/secret"))
    refused(f"{first.url}/start", fetching(only(first)))
    assert first.hits == ["/start"] and inside.hits == []


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/", "http://[::ffff:169.254.169.254]/",
                                    "http://10.0.0.1/", "http://[fd00::1]/", "http://0.0.0.0/"])
def test_a_redirect_to_a_private_address_is_refused_before_connecting(sites, target):
    # Nothing listens at these addresses here: a fetch that tried would wait out its deadline (or
    # fail on its own), so the policy must have been asked about the address, and said no.
    asked = []
    first = sites(redirect(target))
    refused(f"{first.url}/start", fetching(only(first, asked=asked), fetch_timeout_s=5.0), within_s=2.0)
    host = target.split("//")[1].split("/")[0].strip("[]")
    assert (str(ipaddress.ip_address(host)), 80) in asked


def test_loopback_itself_is_refused_by_the_default_policy(sites):
    inside = sites(picture)
    for url in (f"{inside.url}/x.png", f"http://localhost:{inside.port}/x.png", f"http://[::1]:{inside.port}/x.png"):
        refused(url, fetching())
    assert inside.hits == []


def dripping(where: str, every_s: float, count: int):
    def respond(handler):
        out = handler.wfile
        if where == "headers":   # the status line, then the headers a byte at a time
            out.write(b"HTTP/1.0 200 OK\r\n")
            drip = b"Content-Type: image/png\r\n" * count
        else:
            out.write(f"HTTP/1.0 200 OK\r\nContent-Length: {count}\r\n\r\n".encode())
            drip = PNG[:count]
        out.flush()
        for byte in drip[:count]:
            time.sleep(every_s)
            out.write(bytes([byte]))
            out.flush()
    return respond


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_drip_fed_response_is_cut_at_the_one_deadline_of_the_fetch(sites, where):
    # A byte every 0.25 s keeps any per-read timeout happy for ever; one deadline for the whole
    # fetch (1 s here) ends it. Left alone, the server would take 30 x 0.25 s.
    slow = sites(dripping(where, 0.25, 30))
    refused(f"{slow.url}/x.png", fetching(only(slow), fetch_timeout_s=1.0), within_s=2.5)


def test_a_byte_every_nine_seconds_is_refused_within_the_deadline(sites):
    slow = sites(dripping("body", 9.0, 30))
    refused(f"{slow.url}/x.png", fetching(only(slow), fetch_timeout_s=1.0), within_s=2.5)


def late(after_s: float):
    """A server that sends the picture whole, after ``after_s``."""
    def respond(handler):
        time.sleep(after_s)
        picture(handler)
    return respond


def test_a_requests_fetches_end_at_one_deadline_not_one_each(sites):
    # Each picture comes in 0.4 s, well within 1.5 s; five take 2 s together. A deadline for
    # each fetch would take all five (and eight URLs dripping would hold the thread 8 x 1.5 s).
    slow = sites(late(0.4))
    limits = fetching(only(slow), fetch_timeout_s=1.5)
    assert len(decode_images([f"{slow.url}/{i}.png" for i in range(2)], limits)) == 2
    start = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        decode_images([f"{slow.url}/{i}.png" for i in range(5)], limits)
    assert err.value.message.startswith(FETCH_FAILED) and time.monotonic() - start < 3.0
    assert len(slow.hits) < 2 + 5   # the request stopped at its deadline, before its last picture


def test_a_request_of_several_dripping_urls_is_refused_at_its_one_deadline(sites):
    slow = sites(dripping("body", 9.0, 30))
    start = time.monotonic()
    with pytest.raises(OpenAIError) as err:
        decode_images([f"{slow.url}/{i}.png" for i in range(4)], fetching(only(slow), fetch_timeout_s=1.5))
    assert err.value.message.startswith(FETCH_FAILED) and time.monotonic() - start < 3.0


def test_a_request_past_its_deadline_fails_before_contacting_anyone(sites):
    # What a request meets when it waited for a fetch thread until its deadline had passed.
    site = sites(picture)
    with pytest.raises(OpenAIError) as err:
        decode_images([f"{site.url}/x.png"], fetching(only(site)), deadline=time.monotonic() - 0.1)
    assert err.value.status == 400 and err.value.message.startswith(FETCH_FAILED) and site.hits == []


def test_a_socket_watched_after_the_deadline_is_shut_at_once():
    # The timer fired before the connection existed: the socket must be shut when it is handed
    # over, or its reads would run on under the per-read timeout.
    watchdog = _Watchdog(time.monotonic() - 1.0)
    watchdog._timer.join(5.0)
    assert watchdog.expired
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(5.0)
        start = time.monotonic()
        watchdog.watch(ours)
        assert ours.recv(1) == b"" and time.monotonic() - start < 1.0   # shut: the end of the stream


def test_a_socket_watched_before_the_deadline_is_shut_at_it():
    watchdog = _Watchdog(time.monotonic() + 0.2)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(5.0)
        watchdog.watch(ours)
        start = time.monotonic()
        assert ours.recv(1) == b"" and time.monotonic() - start < 2.0
    assert watchdog.expired


def test_a_body_over_the_byte_cap_is_refused(sites):
    def big(handler, declared: bool):
        handler.send_response(200)
        if declared:
            handler.send_header("Content-Length", str(len(PNG) + 10_000))
        handler.end_headers()
        handler.wfile.write(PNG + b"\0" * 10_000)
    undeclared = sites(lambda h: big(h, False))
    declared = sites(lambda h: big(h, True))
    for site in (undeclared, declared):
        refused(f"{site.url}/x.png", fetching(only(site), max_image_bytes=len(PNG) + 100))
    # The same body under the default cap comes whole.
    assert fetch(f"{undeclared.url}/x.png", fetching(only(undeclared))) == PNG + b"\0" * 10_000


def test_a_redirect_loop_and_a_redirect_off_http_are_refused(sites):
    loop = sites(lambda h: redirect(f"http://127.0.0.1:{loop.port}/again")(h))
    refused(f"{loop.url}/start", fetching(only(loop), max_redirects=3))
    assert len(loop.hits) == 4   # the first request and three redirects
    for target in ("file:///etc/passwd", "ftp://example.com/x.png", "http://user:pw@example.com/x.png"):
        off = sites(redirect(target))
        refused(f"{off.url}/start", fetching(only(off)))


def test_every_failed_fetch_reads_the_same(sites):
    # No status, errno or resolver message comes back: the answers cannot map what is behind the server.
    def status(code):
        def respond(handler):
            handler.send_response(code)
            handler.end_headers()
        return respond
    closed = sites(picture)
    closed.close()
    not_found, teapot, plain = sites(status(404)), sites(status(418)), sites(picture)
    allow = only(not_found, teapot, closed, plain)
    messages = {refused(url, fetching(allow)).message for url in (
        f"{not_found.url}/x.png", f"{teapot.url}/x.png", f"{closed.url}/x.png",   # refused connection
        f"https://127.0.0.1:{plain.port}/x.png",                                 # no TLS there
        f"{plain.url.replace('127.0.0.1', '10.1.2.3')}/x.png",                    # a private address
        "http://no-such-host.invalid/x.png")}
    assert len(messages) == 1, messages
    assert not any(str(code) in next(iter(messages)) for code in (404, 418, not_found.port, teapot.port))


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("255.255.255.255", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fd00::1", False), ("fec0::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
    ("2002:7f00:1::", False),        # 6to4 of 127.0.0.1
    ("64:ff9b::a00:1", False),       # NAT64 of 10.0.0.1
])
def test_public_address(address, public):
    assert public_address(ipaddress.ip_address(address), 80) is public
