"""Black-box HTTP checks against a real `k2serve serve` on the shipped demo model.

One server per module (conftest `server`: --api-key, --max-model-len 512, --max-waiting 1)."""

from __future__ import annotations

import httpx
import pytest

from k2serve import SamplingParams

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HELLO = [{"role": "user", "content": "Hello"}]


def post(server, auth, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, headers=auth, timeout=timeout)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**64])
def test_out_of_range_seed_is_a_400_and_the_server_lives_on(server, auth, seed):
    for path, body in [
        (CMPL, {"prompt": "Hi", "max_tokens": 2, "seed": seed}),
        (CHAT, {"messages": HELLO, "max_tokens": 2, "seed": seed}),
    ]:
        assert_openai_error(post(server, auth, path, body), 400, "seed")
    ok = post(server, auth, CMPL, {"prompt": "Hi", "max_tokens": 2, "seed": -5})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_sampling_params_rejects_seeds_torch_cannot_take(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_int64_seeds_sample(server, auth):
    for seed in (2**63 - 1, -(2**63)):
        r = post(
            server,
            auth,
            CMPL,
            {"prompt": "Hi", "max_tokens": 2, "n": 2, "seed": seed, "temperature": 1.0},
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": TOOLS, "tool_choice": "bogus"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_union_typed_fields_report_the_field_as_param(server, auth, extra, param):
    """`param` is the request field (as OpenAI), not pydantic's union branch tags."""
    r = post(server, auth, CHAT, {"messages": HELLO, "max_tokens": 2, **extra})
    assert_openai_error(r, 400, param)
    assert "literal[" not in r.json()["error"]["message"]


def test_429_when_the_waiting_queue_is_full_reads_cleanly(server, auth):
    import asyncio

    async def burst():
        async with httpx.AsyncClient(timeout=60, headers=auth) as c:
            body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*[c.post(server.url + CMPL, json=body) for _ in range(12)])

    rs = asyncio.run(burst())
    codes = sorted(r.status_code for r in rs)
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    for r in rs:
        if r.status_code == 429:
            assert_openai_error(r, 429)
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error"
            msg = err["message"]
            assert msg.count("retry later") <= 1, msg
            assert "max_waiting=1" in msg, msg


def test_retrieve_a_served_model_and_404_for_another(server, auth):
    listed = httpx.get(server.url + "/v1/models", headers=auth).json()["data"]
    for card in listed:
        r = httpx.get(server.url + f"/v1/models/{card['id']}", headers=auth)
        assert r.status_code == 200, r.text
        assert r.json() == card
    assert_openai_error(httpx.get(server.url + "/v1/models/nope", headers=auth), 404, "model")
    assert httpx.get(server.url + f"/v1/models/{listed[0]['id']}").status_code == 401


def test_tokenize_matches_the_usage_the_server_reports(server, auth):
    chat = post(server, auth, CHAT, {"messages": HELLO, "max_tokens": 1}).json()
    tok = post(server, auth, "/tokenize", {"messages": HELLO}).json()
    assert tok["count"] == len(tok["tokens"]) == chat["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == 512

    cmpl = post(server, auth, CMPL, {"prompt": "Hello world", "max_tokens": 1}).json()
    tok = post(server, auth, "/tokenize", {"prompt": "Hello world"}).json()
    assert tok["count"] == cmpl["usage"]["prompt_tokens"]
    back = post(server, auth, "/detokenize", {"tokens": tok["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": HELLO}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenizer_endpoints_reject_bad_input(server, auth, path, body, param):
    r = post(server, auth, path, body)
    assert_openai_error(r, 404 if param == "model" else 400, param)
