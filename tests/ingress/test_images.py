"""Pictures in requests: data URLs decode to RGB pictures; anything else is a 400 that says what
to fix, never an exception that escapes."""

import base64
import http.server
import io
import ipaddress
import threading
import time

import pytest
from PIL import Image, ImageFile
from specserve.data.synthetic_images import example
from specserve.ingress.images import FETCH_FAILED, ImageLimits, decode_image, decode_images, public_address
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


# ---- fetching a picture URL -------------------------------------------------------------------
# The servers below listen on 127.0.0.1, which the default policy refuses; a test that must reach
# one allows exactly that server's port, so that every other hop (another loopback port, the
# cloud metadata address) still meets the policy a deployment runs with.

PNG = base64.b64decode(data_url(Image.new("RGB", (8, 8), "red")).split(",", 1)[1])


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
        decode_image(url, limits)
    assert time.monotonic() - start < within_s, f"refused only after {time.monotonic() - start:.1f} s"
    assert err.value.status == 400 and err.value.code == "invalid_image"
    assert err.value.message.startswith(FETCH_FAILED), err.value.message
    return err.value


def test_a_fetch_follows_redirects_between_allowed_servers(sites):
    # The control for the refusals below: with both servers allowed the same redirect is followed.
    second = sites(picture)
    first = sites(redirect(f"{second.url}/cat.png"))
    got = decode_image(f"{first.url}/start", fetching(only(first, second)))
    assert got.getpixel((0, 0)) == (255, 0, 0) and second.hits == ["/cat.png"]


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
    assert decode_image(f"{undeclared.url}/x.png", fetching(only(undeclared))).size == (8, 8)


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
