from __future__ import annotations

import contextlib

import pytest

from .fake_server import Behavior, FakeOpenAIServer


@pytest.fixture
def fake_server():
    """fake_server(**behavior) -> a started FakeOpenAIServer, stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(**kw) -> FakeOpenAIServer:
            return stack.enter_context(FakeOpenAIServer(Behavior(**kw)))

        yield start
