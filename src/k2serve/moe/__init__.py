"""Routed-expert computation behind a small interface (`ExpertBackend`)."""

from k2serve.moe.base import ExpertBackend
from k2serve.moe.torch_ref import TorchExpertBackend

__all__ = ["ExpertBackend", "TorchExpertBackend"]
