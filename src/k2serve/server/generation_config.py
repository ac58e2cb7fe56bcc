"""Default sampling parameters from a checkpoint's `generation_config.json` (vLLM's
`--generation-config auto|vllm|DIR`).

Owns: which file is read for a `--generation-config` value and how its Hugging Face keys map to
request defaults. The server applies a default only where the request leaves the field unset.

- `auto` (the default, as vLLM): the model directory's `generation_config.json`, if any.
- `vllm`: no checkpoint defaults (the engine's own: temperature 1.0, top_p 1.0, ...).
- any other value: a directory holding a `generation_config.json`.

Mapping (vLLM's `get_diff_sampling_param` keys): `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` -> the default `max_tokens`. One addition: a file that
says `"do_sample": false` and gives no `temperature` means greedy decoding in Hugging Face's
`generate()`, so it becomes `temperature: 0` (Kimi checkpoints ship exactly that file; sampling
at 1.0 there is not what the checkpoint's authors configured).
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def defaults_from_dict(gen: dict) -> dict:
    """Request defaults from a generation_config mapping (unknown / null keys ignored)."""
    out: dict = {}
    for key in _KEYS:
        val = gen.get(key)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            out[key] = val
    if gen.get("do_sample") is False and "temperature" not in out:
        out["temperature"] = 0.0
    max_new = gen.get("max_new_tokens")
    if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0:
        out["max_tokens"] = max_new
    if out.get("top_k") == -1:
        out["top_k"] = 0
    return out


def load_generation_defaults(source: str | None, model_dir: str | None) -> dict:
    """The request defaults for `--generation-config SOURCE` (see the module docstring).

    Raises ValueError for a DIR without a readable generation_config.json, or an unreadable file.
    """
    source = source or "auto"
    if source == "vllm":
        return {}
    if source == "auto":
        if model_dir is None:
            return {}
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(source, "generation_config.json")
        if not os.path.isdir(source) or not os.path.isfile(path):
            raise ValueError(
                f"--generation-config {source!r}: expected 'auto', 'vllm' or a directory "
                "holding generation_config.json"
            )
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path} is not a JSON object")
    out = defaults_from_dict(gen)
    if out:
        logger.info(
            "default sampling parameters from %s (a request's own values win): %s", path, out
        )
    return out
