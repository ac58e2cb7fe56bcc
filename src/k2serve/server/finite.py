"""No NaN or infinity in a response: JSON has no such numbers, and a client parser chokes on them.

Owns: `finite_logprob` (the rule for logprobs), `json_safe` (the last-resort scrub of any
payload) and `SafeJSONResponse`.

The logprob rule (as the OpenAI API, which reports "impossible" tokens as -9999.0):
- -inf (a token masked out, or a probability that underflowed) -> -9999.0;
- NaN (NaN logits: NaN weights, or sampling parameters that overflow) -> -9999.0;
- +inf (cannot be a log-probability; only from broken logits) -> 0.0.
Every replaced value is a symptom worth knowing about, so the caller is told (`on_bad`) and
logs one warning per request naming the cause.

Invariants:
- `json_safe` returns the payload unchanged when it is already finite (the common case costs
  one `json.dumps` with allow_nan=False); otherwise non-finite floats become null and a
  warning is logged, so a response is never a 500 and never invalid JSON.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0


def finite_logprob(value: float, on_bad: Callable[[float], None] | None = None) -> float:
    if math.isfinite(value):
        return max(value, MIN_LOGPROB)
    if on_bad is not None and not (value == -math.inf):
        on_bad(value)  # -inf is an ordinary masked token, NaN / +inf are not
    return 0.0 if value == math.inf else MIN_LOGPROB


def _scrub(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """json.dumps that never writes NaN / Infinity (they become null, with a warning)."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        logger.warning("non-finite number in a response (sent as null): %.200r", obj)
        return json.dumps(_scrub(obj), allow_nan=False, **kw)


def dumps_utf8(obj: Any) -> str:
    """Compact JSON text that encodes as UTF-8: non-ASCII as is, but a lone surrogate (which
    UTF-8 cannot carry) makes the whole text ASCII-escaped instead of failing to encode."""
    text = dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = dumps(obj, ensure_ascii=True, separators=(",", ":"))
    return text


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps_utf8(content).encode()
