"""What the server logs per request: one access line, the reason of a rejection, a disconnect.

Owns: `printable` (the escape every client string goes through before it is logged) and the
three per-request lines the `GuardMiddleware` writes when a request finishes:
- `k2serve.server.access` (INFO, off with `--disable-access-log`): one line per finished
  request that was not rejected: client, method, path, status, prompt+completion tokens and
  latency, as vLLM / uvicorn's access log;
- `k2serve.server.app` "rejected ..." (INFO): a 4xx with its error message;
- `k2serve.server.access` "... client disconnected ...": the client went away before the end
  (a 499 in the metrics, never logged as a rejection).

Invariants:
- A logged client string (path, query, error messages that quote the request) cannot forge a
  log line or drive a terminal: control characters (C0, DEL, C1, the Unicode line and paragraph
  separators) are written as escapes, and the string is cut at `MAX_LOGGED_CHARS`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import MutableMapping
from typing import Any

access_logger = logging.getLogger("k2serve.server.access")
app_logger = logging.getLogger("k2serve.server.app")

MAX_LOGGED_CHARS = 1000
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
USAGE_SCOPE_KEY = "k2serve.usage"  # ASGI scope entry: [prompt tokens, completion tokens]
DISCONNECT_SCOPE_KEY = "k2serve.disconnected"  # set when the client left mid-stream


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` safe to log: control characters escaped, at most `limit` characters (+ "...")."""
    cut = text[:limit]
    out = _CONTROL.sub(_escape, cut)
    return out + "..." if len(text) > limit else out


def request_usage(scope: MutableMapping[str, Any]) -> list[int]:
    """The request's token counts, shared by its engine streams (see EngineStream)."""
    return scope.setdefault(USAGE_SCOPE_KEY, [0, 0])


def log_rejected(method: str, path: str, status: int, body: bytes) -> None:
    """One INFO line per rejected (4xx) request: method, path, status and the error message."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip() or "-"
    app_logger.info(
        "rejected %s %s: %d %s", printable(method), printable(path), status, printable(message)
    )


def log_finished(
    scope: MutableMapping[str, Any],
    status: int,
    seconds: float,
    error_body: bytes,
    access: bool = True,
) -> None:
    """The request's one line (see the module docstring); `access` False: rejections and
    disconnects only."""
    method, path = printable(scope.get("method", "")), printable(scope.get("path", ""))
    usage = scope.get(USAGE_SCOPE_KEY)
    tokens = f"{usage[0]}+{usage[1]} tokens" if usage else "-"
    ms = seconds * 1000
    if status == 499 or scope.get(DISCONNECT_SCOPE_KEY):
        access_logger.info(
            "%s %s: client disconnected after %.0f ms (%s)", method, path, ms, tokens
        )
        return
    if 400 <= status < 500:
        log_rejected(method, path, status, error_body)
        return
    if access:
        client = scope.get("client") or ("-", 0)
        access_logger.info(
            '%s "%s %s" %d %s %.0f ms', printable(str(client[0])), method, path, status, tokens, ms
        )
