"""API keys (`--api-key KEY [KEY ...]` / `K2SERVE_API_KEY`): every route needs one but the probes.

Invariants:
- Keys are compared in constant time, each of them (no early exit); a missing, malformed or
  wrong key gives 401 with OpenAI error JSON whose message says what the server expects, never
  a key.
- Only /health, /version and /metrics stay open so probes and scrapers need no secret. Every
  other path (the /v1 API, /tokenize, /detokenize, /openapi.json, unknown paths) needs a key,
  so a new route is protected by default and the key is checked before any body is read.
- With several keys, what a key creates (stored responses) belongs to it: `key_owner` names the
  key by a digest (never the key itself), and the store answers 404 to every other key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
OWNER_SCOPE_KEY = "k2serve.owner"  # ASGI scope entry: the digest of the key a request used


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS


def key_owner(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def check_authorization(
    header_value: str | None, api_keys: Sequence[str] | str
) -> tuple[str | None, str | None]:
    """(None, the matching key's owner id) when `Authorization: Bearer <key>` carries one of
    `api_keys`; else (the reason for a 401, None)."""
    keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
    if not header_value:
        return "missing API key: send 'Authorization: Bearer <key>'", None
    scheme, _, token = header_value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "malformed Authorization header: expected 'Bearer <key>'", None
    given = token.strip().encode()
    matched = None
    for key in keys:  # every key is compared: the time does not say which one matched
        if hmac.compare_digest(given, key.encode()) and matched is None:
            matched = key
    if matched is None:
        return "incorrect API key provided", None
    return None, key_owner(matched)
