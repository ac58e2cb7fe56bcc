"""Images through the HTTP server (a tiny random K2.5 checkpoint, the real AsyncLLMEngine, the
openai client): chat image_url with data URLs, Responses input_image, usage counting image
tokens, and a clear 400 for every bad input (never a 500, a hang or a leaked page)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import openai
import pytest
from PIL import Image
from tests.server.conftest import ServerThread

from k2serve.multimodal.media import MediaPolicy
from k2serve.weights.make_checkpoint import make_checkpoint
from k2serve.weights.presets import preset_config


def png(w: int, h: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def zero_pixel_png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        c = struct.pack(">I", len(body)) + kind + body
        return c + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", 0, 0, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def bomb_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (30000, 30000)).save(buf, format="PNG")
    return buf.getvalue()


def line_png() -> bytes:
    buf = io.BytesIO()
    Image.new("L", (100000, 1)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app

    d = tmp_path_factory.mktemp("tiny_k25_srv")
    make_checkpoint(d, preset_config("tiny-k2.5"), progress=False)
    cfg = EngineConfig(
        model=str(d), max_model_len=1024, num_kv_pages=256, device="cpu",
        limit_mm_per_prompt={"image": 2},
    )  # fmt: skip
    engine = AsyncLLMEngine(cfg)
    local = tmp_path_factory.mktemp("media")
    (local / "ok.png").write_bytes(png(56, 56))
    policy = MediaPolicy(allowed_local_media_path=str(local))
    app = build_app(engine, served_model_names=["k25"], media_policy=policy)
    try:
        with ServerThread(app) as srv:
            srv.engine = engine
            srv.local = local
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client, *parts, max_tokens=4):
    return client.chat.completions.create(
        model="k25",
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}],
        max_tokens=max_tokens,
        temperature=0,
    )


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_data_url_and_usage_counts_image_tokens(client):
    small = _chat(client, _image_part(data_url(png(56, 56))))  # 2x2 merged = 4 tokens
    large = _chat(client, _image_part(data_url(png(112, 112, 1))))  # 16 tokens
    assert small.choices[0].finish_reason in ("length", "stop")
    assert large.usage.prompt_tokens - small.usage.prompt_tokens == 12
    two = _chat(client, _image_part(data_url(png(56, 56))), _image_part(data_url(png(112, 112))))
    text = _chat(client).usage.prompt_tokens
    # each image adds its framing markers and its tokens
    assert two.usage.prompt_tokens - text == (
        small.usage.prompt_tokens - text + large.usage.prompt_tokens - text
    )


def test_file_url_under_allowed_path(client, server):
    r = _chat(client, _image_part(f"file://{server.local}/ok.png"))
    assert r.usage.prompt_tokens > 4


def test_responses_input_image(client):
    r = client.responses.create(
        model="k25",
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Describe"},
            {"type": "input_image", "image_url": data_url(png(84, 56))},
        ]}],
        max_output_tokens=4,
    )  # fmt: skip
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 6


def _bad_chat(client, part) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, part)
    return e.value


TRUNC = png(64, 64)[:300]


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png;base64,%%%notbase64", "base64"),
        (data_url(b"hello, not an image", "text/plain"), "not an image"),
        (data_url(b"hello, not an image"), "not an image"),
        (data_url(TRUNC), "corrupt|truncated|not an image"),
        (data_url(zero_pixel_png()), "no pixels|corrupt|not an image"),
        (data_url(line_png()), "too large"),
        ("http://127.0.0.1:1/x.png", "private or loopback"),
        ("http://localhost:1/x.png", "private or loopback"),
        ("http://[::1]:1/x.png", "private or loopback"),
        ("file:///etc/passwd", "outside"),
        ("ftp://example.com/x.png", "unsupported"),
    ],
)
def test_bad_image_is_400(client, server, url, match):
    e = _bad_chat(client, _image_part(url))
    assert e.status_code == 400
    import re

    assert re.search(match, e.message), e.message
    server.engine.engine.kv.check_integrity()


def test_bomb_is_400(client):
    e = _bad_chat(client, _image_part(data_url(bomb_png())))
    assert "too large" in e.message


def test_too_many_images_and_video(client):
    part = _image_part(data_url(png(28, 28)))
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        _chat(client, part, part, part)
    e = _bad_chat(client, {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}})
    assert "video" in e.message


def test_server_still_serves(client, server):
    r = _chat(client, _image_part(data_url(png(28, 56))))
    assert r.choices[0].message is not None
    server.engine.engine.kv.check_integrity()


def test_bench_sends_synthetic_images(server, tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "k2serve.cli", "bench", "--base-url", server.url, "--api", "chat",
         "--model", "k25", "--num-prompts", "3", "--random-input-len", "5",
         "--random-output-len", "2", "--random-images-per-prompt", "2",
         "--random-image-size", "56x56", "112x84", "--no-plot", "--result-dir", str(tmp_path),
         "--result-filename", "r.json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 3, res
    # 2 images of 4 and 12 tokens (+ markers) each: far more than 5 words of text
    assert res["total_input_tokens"] > 3 * (4 + 12)


def test_vision_dataset_file(tmp_path):
    import json

    from k2serve.bench.images import vision_dataset

    (tmp_path / "a.png").write_bytes(png(28, 28))
    recs = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat?"},
                                             {"from": "gpt", "value": "A cat " * 10}]},
        {"images": [{"bytes": base64.b64encode(png(28, 56)).decode()}],
         "conversation": [[{"role": "user", "content": "Describe"}]]},
    ]  # fmt: skip
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    got = vision_dataset(tmp_path / "d.jsonl", 4)
    assert len(got) == 4
    for s in got:
        parts = s.prompt[0]["content"]
        assert parts[0]["type"] == "image_url" and parts[0]["image_url"]["url"].startswith("data:")
        assert "<image>" not in parts[-1]["text"]
