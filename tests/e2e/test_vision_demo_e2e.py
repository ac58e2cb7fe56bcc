"""`k2serve serve kimi-k2.5-demo` (the bundled K2.5 demo) answers the README's example: the
OpenAI client, an image as a data URL, "What is in this image?"."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from PIL import Image, ImageDraw

from .conftest import ServeProcess

try:
    from k2serve.demo import vision_demo_path

    vision_demo_path()
    HAVE_DEMO = True
except FileNotFoundError:  # pragma: no cover
    HAVE_DEMO = False


@pytest.mark.skipif(not HAVE_DEMO, reason="the K2.5 demo is not built")
def test_readme_example_against_the_vision_demo():
    img = Image.new("RGB", (168, 140), (30, 60, 220))  # blue
    ImageDraw.Draw(img).ellipse((30, 20, 130, 120), fill=(240, 220, 30))  # yellow
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    srv = ServeProcess("kimi-k2.5-demo", "--max-model-len", "1024")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(
            model="kimi-k2.5-demo",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is in this image?"},
                    ],
                }
            ],  # fmt: skip
            temperature=0,
            max_tokens=96,
        )
        text = r.choices[0].message.content
        assert "yellow" in text and "blue" in text, text
        assert r.usage.prompt_tokens > (168 // 28) * (140 // 28)  # the image's tokens counted
    finally:
        assert srv.stop() == 0
