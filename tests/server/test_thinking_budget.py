"""`thinking_token_budget` (vLLM's extra parameter): the reasoning holds at most N tokens, then
`</think>` is forced; 0 means no reasoning. Checked on the processor and over HTTP."""

from __future__ import annotations

import json

import pytest
import torch

from k2serve.engine.reasoning_budget import ThinkingBudget

from .fakes import FakeTokenizer
from .helpers import WEATHER_TOOL, _err, _msgs, _post

TOK = FakeTokenizer()
END = TOK.token_to_id("</think>")
A = TOK.encode("a")[0]


def _forced(proc, out) -> int | None:
    logits = torch.zeros(TOK.vocab_size)
    res = proc(list(out), logits.clone())
    allowed = torch.isfinite(res).nonzero().flatten().tolist()
    return allowed[0] if len(allowed) == 1 else None


def test_processor_forces_end_exactly_at_the_budget():
    p = ThinkingBudget(TOK, 3)
    assert _forced(p, []) is None
    assert _forced(p, [A, A]) is None
    assert _forced(p, [A, A, A]) == END
    assert _forced(p, [A, A, A, END]) is None  # after the close: free
    assert _forced(p, [A, END, A]) is None  # the model closed it itself
    sec = TOK.token_to_id("<|tool_calls_section_begin|>")
    assert _forced(p, [A, sec, A]) is None  # a tool section inside reasoning ends it
    assert _forced(ThinkingBudget(TOK, 0), []) == END
    with pytest.raises(ValueError):
        ThinkingBudget(TOK, -1)


class _MultiTokenEnd(FakeTokenizer):
    """`</think>` spelled with three tokens."""

    def encode(self, text, allow_special=True):
        if text == "</think>":
            return [100, 101, 102]
        return super().encode(text, allow_special)


def test_multi_token_end_marker():
    p = ThinkingBudget(_MultiTokenEnd(), 2)
    assert _forced(p, [A, A]) == 100
    assert _forced(p, [A, A, 100]) == 101
    assert _forced(p, [A, A, 100, 101]) == 102
    assert _forced(p, [A, A, 100, 101, 102]) is None
    assert _forced(p, [A, A, A]) is None  # not our forced prefix: leave it alone


def _chat(srv, **extra):
    body = {"model": "fake-k2", "messages": _msgs(), **extra}
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_budget_over_http(fake_server):
    # the fake model reasons "Let me think." (13 tokens) before its answer
    full = _chat(fake_server)
    assert full["reasoning_content"] == "Let me think."
    cut = _chat(fake_server, thinking_token_budget=5)
    assert cut["reasoning_content"] == "Let m"
    assert cut["content"]
    none = _chat(fake_server, thinking_token_budget=0)
    assert none["reasoning_content"] is None and none["content"]
    big = _chat(fake_server, thinking_token_budget=1000)
    assert big["reasoning_content"] == "Let me think."
    # thinking off: the budget has nothing to cut
    off = _chat(fake_server, thinking_token_budget=2, chat_template_kwargs={"thinking": False})
    assert off["reasoning_content"] is None and off["content"].startswith("Hello!")


def test_budget_with_tools_and_streaming(fake_server):
    body = {
        "model": "fake-k2",
        "messages": _msgs("weather in Paris?"),
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "thinking_token_budget": 4,
        "stream": True,
    }
    r = _post(fake_server, "/v1/chat/completions", body)
    assert r.status_code == 200

    reasoning, calls = "", []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                reasoning += ch["delta"].get("reasoning_content") or ""
                calls += ch["delta"].get("tool_calls") or []
    assert reasoning == "Let"  # 4 tokens, stripped
    assert calls and calls[0]["function"]["name"] == "get_weather"


def test_bad_budget_is_400(fake_server):
    e = _err(
        _post(
            fake_server, "/v1/chat/completions", {"messages": _msgs(), "thinking_token_budget": -1}
        ),
        400,
    )
    assert e["param"] == "thinking_token_budget"
