"""Errors of the tensor-parallel worker group (its own module: `workers` and `nodes` both raise
them, and `workers` imports `nodes`)."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the message names its rank."""
