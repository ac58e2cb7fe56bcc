"""Errors the engine raises to its callers (the server maps them to HTTP status codes)."""


class EngineQueueFull(RuntimeError):
    """`max_waiting` requests are already waiting; try again later (HTTP 429)."""


class PromptTooLongError(ValueError):
    """prompt + max_tokens does not fit max_model_len (or the KV cache); the message says by how
    much, and the fields give the numbers (None where not known) for callers that word their own
    error (the server's OpenAI-style 400)."""

    def __init__(
        self,
        message: str,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no further requests can be served."""
