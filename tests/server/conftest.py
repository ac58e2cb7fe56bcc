"""Run an app on 127.0.0.1 (random free port) with uvicorn in a thread, for real HTTP clients."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from k2serve.server.app import build_app

from .fakes import FakeAsyncEngine


class ServerThread:
    def __init__(self, app, **config):
        # proto=IPPROTO_TCP so that asyncio sets TCP_NODELAY on accepted connections
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, **config)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture(scope="module")
def fake_engine():
    return FakeAsyncEngine()


@pytest.fixture(scope="module")
def fake_server(fake_engine):
    app = build_app(
        fake_engine,
        served_model_names=["fake-k2", "alias"],
        api_key="sk-test",
        max_body_bytes=64 * 1024,
    )
    with ServerThread(app) as srv:
        srv.engine = fake_engine
        srv.app = app
        yield srv
