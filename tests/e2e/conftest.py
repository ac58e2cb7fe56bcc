"""Shared fixtures for the black-box end-to-end tests: one real `k2serve serve` process per module.

Owns: starting `k2serve serve` (the console script, the shipped demo model) on a free 127.0.0.1
port as a subprocess, waiting for /health with a bounded deadline, and stopping it with SIGTERM.
Invariant: everything here goes through public surfaces only (CLI, HTTP, `k2serve` imports).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

K2SERVE = str(Path(sys.executable).parent / "k2serve")
API_KEY = "sk-e2e"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, *extra: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [K2SERVE, "serve", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"k2serve serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("k2serve serve did not become healthy in 60 s")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    srv = ServeProcess("--api-key", API_KEY, "--max-model-len", "512", "--max-waiting", "1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}
