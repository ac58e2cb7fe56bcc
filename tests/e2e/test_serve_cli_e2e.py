"""`k2serve serve` start-up with flags a user can get wrong: a one-line error naming the flag."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from .conftest import K2SERVE, ServeProcess


@pytest.mark.parametrize(
    "flags,name",
    [
        (["--port", "99999"], "port"),
        (["--port", "http"], "port"),
        (["--allowed-origins", "*"], "allowed-origins"),
        (["--default-chat-template-kwargs", "[1]"], "default-chat-template-kwargs"),
    ],
)
def test_bad_server_flag_is_a_clear_error(flags, name):
    r = subprocess.run(
        [K2SERVE, "serve", "--host", "127.0.0.1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"--{name}" in r.stderr.splitlines()[-1]


def test_vllm_style_command_line_serves_with_a_given_chat_template(tmp_path):
    """`vllm serve MODEL --trust-remote-code ... --chat-template FILE` carries over as is."""
    from k2serve.demo import demo_path

    tpl = tmp_path / "t.jinja"
    tpl.write_text(
        "{% for m in messages %}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
        "{% endfor %}<|im_assistant|>assistant<|im_middle|>"
    )
    srv = ServeProcess(
        str(demo_path()),
        "--trust-remote-code",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "kimi_k2",
        "--reasoning-parser",
        "kimi_k2",
        "--chat-template",
        str(tpl),
    )
    try:
        msgs = [{"role": "user", "content": "Hi"}]
        ids = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
        text = httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert (
            text == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
        )
        served = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
        assert str(demo_path()) in served
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--chat-template", "hello"], "--chat-template"),
        (["--chat-template", "{% if %}"], "--chat-template"),
        (["a", "--model", "b"], "--model"),
    ],
)
def test_bad_model_or_template_is_a_one_line_error(flags, needle):
    r = subprocess.run(
        [K2SERVE, "serve", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and needle in r.stderr.splitlines()[-1], r.stderr
