"""`k2serve serve` start-up with flags a user can get wrong: a one-line error naming the flag."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import K2SERVE


@pytest.mark.parametrize(
    "flags,name",
    [
        (["--port", "99999"], "port"),
        (["--port", "http"], "port"),
        (["--allowed-origins", "*"], "allowed-origins"),
        (["--default-chat-template-kwargs", "[1]"], "default-chat-template-kwargs"),
    ],
)
def test_bad_server_flag_is_a_clear_error(flags, name):
    r = subprocess.run(
        [K2SERVE, "serve", "--host", "127.0.0.1", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"--{name}" in r.stderr.splitlines()[-1]
