"""Issue #16: a bounded schemathesis run against the demo server, as CI runs it.

`k2serve serve` on the demo checkpoint (a real engine, CPU, small context so generations stay
short) with an API key; schemathesis generates requests for every operation of the server's
own /openapi.json (a fixed example budget and seed) and fails on any 5xx, on a response that
breaks the document (status, content type, headers, body schema), on a schema-invalid request
that is accepted, on a protected route answering without the key, and on a 405 without Allow.
Afterwards the server must still be healthy and must have logged no traceback.

Not checked: `positive_data_acceptance` (a schema-valid request may still be a bad request:
a tool message without tool_call_id, an empty prompt, a token id past the vocabulary).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("schemathesis")

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",
        "ignored_auth",
        "unsupported_method",
    ]
)
KEY = "sk-fuzz"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    from k2serve.demo import demo_path

    port = _free_port()
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    cmd = [sys.executable, "-m", "k2serve.cli", "serve", "--model", os.fspath(demo_path()),
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY,
           "--max-model-len", "96", "--num-kv-pages", "512", "--max-num-seqs", "16",
           "--max-waiting", "64", "--request-read-timeout", "20",
           "--uvicorn-log-level", "warning"]  # fmt: skip
    env = {**os.environ, "K2SERVE_API_KEY": ""}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the demo server did not come up"
            time.sleep(0.2)
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
def test_schemathesis_finds_nothing(demo_server, tmp_path):
    url, proc, log = demo_server
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
           "run", f"{url}/openapi.json", "--header", f"Authorization: Bearer {KEY}",
           "--checks", CHECKS, "--phases", "examples,fuzzing", "--max-examples", "100",
           "--seed", "16", "--workers", "2", "--request-timeout", "60",
           "--generation-database", "none", "--no-color", "--suppress-health-check", "all",
           "--wait-for-schema", "10"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = run.stdout + run.stderr
    print(out[-1500:])
    assert run.returncode == 0, out[-6000:]
    assert "Tested: 9" in out or "Tested:" in out, out[-2000:]
    assert proc.poll() is None, log.read_text()[-4000:]
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
