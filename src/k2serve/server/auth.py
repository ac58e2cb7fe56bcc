"""API-key check (`--api-key` / `K2SERVE_API_KEY`): every route needs the key but the probes.

Invariants:
- The key is compared in constant time; a missing, malformed or wrong key gives 401 with OpenAI
  error JSON whose message says what the server expects, never the key.
- Only /health, /version and /metrics stay open so probes and scrapers need no secret. Every
  other path (the /v1 API, /tokenize, /detokenize, /openapi.json, unknown paths) needs the key,
  so a new route is protected by default and the key is checked before any body is read.
"""

from __future__ import annotations

import hmac

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS


def check_authorization(header_value: str | None, api_key: str) -> str | None:
    """None when `Authorization: Bearer <api_key>` matches; else the reason for a 401."""
    if not header_value:
        return "missing API key: send 'Authorization: Bearer <key>'"
    scheme, _, token = header_value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "malformed Authorization header: expected 'Bearer <key>'"
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "incorrect API key provided"
    return None
