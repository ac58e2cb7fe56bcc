"""Image URL fetching under the media policy: a local HTTP server serves good, slow, huge,
non-image and redirecting answers (it is on loopback, so the policy lists `localhost`)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest
from tests.multimodal.test_server import png

from k2serve.multimodal.media import MediaError, MediaPolicy, fetch_image_bytes

PNG = png(28, 28)


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/ok.png":
            self._send(200, "image/png", PNG)
        elif self.path == "/text":
            self._send(200, "text/html", b"<html></html>")
        elif self.path == "/huge.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no length: streamed until the client stops
            try:
                for _ in range(1000):
                    self.wfile.write(b"\0" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/slow.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(50):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
        elif self.path == "/redirect-private":
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/x.png")
            self.end_headers()
        elif self.path == "/redirect-ok":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
        else:
            self._send(404, "text/plain", b"nope")

    def _send(self, code, ctype, body):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def base():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://localhost:{srv.server_address[1]}"
    srv.shutdown()


POLICY = MediaPolicy(allowed_media_domains=("localhost",), max_bytes=256 * 1024, timeout_s=1.0)


def fetch(url, policy=POLICY) -> bytes:
    return asyncio.run(fetch_image_bytes(url, policy))


def test_ok_and_redirect(base):
    assert fetch(base + "/ok.png") == PNG
    assert fetch(base + "/redirect-ok") == PNG


@pytest.mark.parametrize(
    "path, match",
    [
        ("/text", "not image"),
        ("/huge.png", "larger than"),
        ("/slow.png", "more than 1s"),
        ("/missing.png", "HTTP 404"),
        ("/redirect-private", "not in --allowed-media-domains"),
    ],
)
def test_refused(base, path, match):
    t0 = time.monotonic()
    with pytest.raises(MediaError, match=match):
        fetch(base + path)
    assert time.monotonic() - t0 < 5


def test_private_refused_without_listing(base):
    with pytest.raises(MediaError, match="private or loopback"):
        fetch(base + "/ok.png", MediaPolicy())
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        fetch(base.replace("localhost", "127.0.0.1") + "/ok.png")


def test_unreachable_and_unresolvable():
    with pytest.raises(MediaError, match="cannot fetch"):
        fetch("http://localhost:1/x.png")
    with pytest.raises(MediaError, match="cannot resolve"):
        fetch("http://no-such-host.invalid/x.png", MediaPolicy())


def test_file_urls(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    assert fetch(f"file://{tmp_path}/a.png", policy) == PNG
    with pytest.raises(MediaError, match="outside"):
        fetch(f"file://{tmp_path}/../x.png", policy)
    with pytest.raises(MediaError, match="refused"):
        fetch(f"file://{tmp_path}/a.png", MediaPolicy())
