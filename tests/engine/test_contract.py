"""The request contract: one max_tokens rule for the engine and the server."""

from __future__ import annotations

import pytest

from k2serve.engine.async_engine import AsyncLLMEngine
from k2serve.engine.contract import EngineClient, resolve_max_tokens
from k2serve.engine.errors import PromptTooLongError


def test_max_tokens_rule():
    assert resolve_max_tokens(10, None, 64) == 54  # absent: what is left of the context
    assert resolve_max_tokens(10, 54, 64) == 54
    with pytest.raises(PromptTooLongError, match="at most 54") as e:
        resolve_max_tokens(10, 55, 64)
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.max_model_len) == (10, 55, 64)
    with pytest.raises(PromptTooLongError, match="leaves no room") as e:
        resolve_max_tokens(64, None, 64)
    assert e.value.prompt_tokens == 64 and e.value.max_tokens is None


def test_async_engine_provides_what_the_server_calls():
    for name in ("generate", "abort", "get_stats", "tokenizer"):
        assert hasattr(AsyncLLMEngine, name), name
        assert hasattr(EngineClient, name), name
