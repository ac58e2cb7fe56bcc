"""The contract between the engine and its callers (the server, the offline API).

Owns: `resolve_max_tokens`, the one rule for a request's output budget (the engine applies it
when a request is added; the server calls it first only to word the 400 the OpenAI way, from the
error's fields), and `EngineClient`, the engine as the server sees it (what `AsyncLLMEngine`
provides and the tests' fake engine imitates).

Torch-free on purpose: the server imports it at start-up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from k2serve.engine.errors import PromptTooLongError

if TYPE_CHECKING:
    from k2serve.engine.outputs import RequestOutput


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget of a prompt of `prompt_len` tokens: `max_tokens`, or what is left of
    the context when it is None (as vLLM). Raises PromptTooLongError (with the numbers as
    fields) when the prompt leaves no room or prompt + max_tokens exceeds max_model_len."""
    if prompt_len >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens; max_model_len={max_model_len} leaves no room "
            "for output",
            prompt_tokens=prompt_len,
            max_tokens=max_tokens,
            max_model_len=max_model_len,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_len + max_tokens} tokens exceeds max_model_len={max_model_len}; lower "
            f"max_tokens to at most {max_model_len - prompt_len}",
            prompt_tokens=prompt_len,
            max_tokens=max_tokens,
            max_model_len=max_model_len,
        )
    return max_tokens


class EngineClient(Protocol):
    """What the server calls on the engine (`AsyncLLMEngine`), and all it calls: the server
    reaches nothing behind it."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int:
        """The resolved context length (the engine's `RuntimeSpec`)."""
        ...

    @property
    def errored(self) -> bool:
        """True once the engine's step loop has died (every request then fails)."""
        ...

    def check_health(self) -> None:
        """Raise if a part of the engine is lost (a tensor-parallel rank, a node)."""
        ...

    def check_structured_outputs(self, structured_outputs: Any) -> None:
        """Compile (and cache) a request's constraint; ValueError saying why it is bad."""
        ...

    def generate(
        self, prompt_token_ids: list[int], params: Any, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Validate (raising ValueError / PromptTooLongError / EngineQueueFull before the first
        output), queue, and yield DELTA outputs; closing the iterator aborts the request."""
        ...

    def abort(self, request_id: str) -> None: ...

    def get_stats(self) -> Any: ...
