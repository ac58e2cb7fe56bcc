"""`k2serve generate --chat` shows the thought apart from the answer, as `k2serve chat` does."""

from __future__ import annotations

import json
import os

import pytest

from k2serve.cli import main as cli_main
from k2serve.engine.generate_cli import format_reply
from k2serve.parsers import parse_output


def test_format_reply_has_no_markers():
    p = parse_output(
        "Plan it.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
    )
    assert format_reply(p) == '(thinking) Plan it.\nSure.\n[tool call f {"a": 1}]'
    assert format_reply(parse_output("just text", thinking=False)) == "just text"


def _demo() -> str:
    try:
        from k2serve.demo import demo_path

        return os.fspath(demo_path())
    except (ImportError, FileNotFoundError):
        pytest.skip("no demo checkpoint")


@pytest.mark.slow
def test_generate_chat_on_the_demo(capsys):
    base = ["generate", "--chat", "--model", _demo(), "--temperature", "0", "--max-tokens", "64"]
    assert cli_main([*base, "--prompt", "Hi, who are you?", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "</think>" in rec["text"]  # the raw text keeps the markers...
    assert rec["reasoning_content"] and rec["content"]  # ...the parsed fields split them
    assert "<think>" not in rec["content"] and "</think>" not in rec["content"]
    assert cli_main([*base, "--prompt", "Hi, who are you?"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"(thinking) {rec['reasoning_content']}\n{rec['content']}")
    assert "</think>" not in out
