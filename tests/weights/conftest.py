"""Fixtures for the weights tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread is faster on a busy 2-core machine (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
