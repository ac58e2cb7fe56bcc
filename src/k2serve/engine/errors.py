"""Errors the engine raises to its callers (the server maps them to HTTP status codes)."""


class EngineQueueFull(RuntimeError):
    """`max_waiting` requests are already waiting; try again later (HTTP 429)."""


class PromptTooLongError(ValueError):
    """prompt + max_tokens does not fit max_model_len (or the KV cache); the message says by how
    much."""


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; no further requests can be served."""
