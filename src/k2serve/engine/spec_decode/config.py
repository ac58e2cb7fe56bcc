"""SpeculativeConfig: `--speculative-config` / `LLM(speculative_config=...)`, parsed as vLLM does.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24}
    {"method": "eagle3", "model": "/path/to/kimi-k2.5-eagle3", "num_speculative_tokens": 3}

Keys follow vLLM's SpeculativeConfig (`method`, `model`, `num_speculative_tokens`,
`prompt_lookup_min/max`, `disable_by_batch_size`, `suffix_decoding_*`); Arctic Inference's
short suffix names (`max_tree_depth`, `max_cached_requests`, `max_spec_factor`,
`min_token_prob`) are accepted too. `method` may be left out when `model` is given (eagle3) or
when `prompt_lookup_*` are given (ngram). An unknown key or method, or a value out of range, is a
`ValueError` naming it. What needs the target model (the draft's hidden size, vocabulary,
auxiliary layers) is checked when the drafter is built (`drafter.build_drafter`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "eagle3")
MAX_SPECULATIVE_TOKENS = 16  # verify rows per request per step (vLLM's rejection sampler: 128)

_ALIASES = {  # vLLM / Arctic names -> field names
    "eagle-3": "eagle3",
    "max_tree_depth": "suffix_decoding_max_tree_depth",
    "max_cached_requests": "suffix_decoding_max_cached_requests",
    "max_spec_factor": "suffix_decoding_max_spec_factor",
    "min_token_prob": "suffix_decoding_min_token_prob",
    "max_spec_offset": "suffix_decoding_max_spec_offset",
}
# accepted for compatibility; they do not change what k2serve does (logged at start-up)
_IGNORED = ("draft_tensor_parallel_size", "quantization", "revision", "code_revision",
            "max_model_len", "speculative_token_tree", "enforce_eager")  # fmt: skip


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the EAGLE-3 draft checkpoint directory
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None  # no drafts while more requests run than this
    # suffix decoding (Arctic Inference SuffixDecoding)
    suffix_decoding_max_tree_depth: int = 24
    # NOTE: vLLM's default is 10000; the global trie here is Python objects (~100 bytes a
    # node, up to max_tree_depth nodes per cached output token), so the default is 1000
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_max_spec_offset: float = 0.0
    suffix_decoding_min_token_prob: float = 0.1
    ignored: tuple[str, ...] = ()  # keys given that change nothing here

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config: method={self.method!r} is not one of {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens={k!r} must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        if self.method == "eagle3":
            if not self.model:
                raise ValueError('speculative_config: method "eagle3" needs "model": DRAFT_DIR')
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(
                    f"speculative_config: draft model {self.model!r} is not a checkpoint "
                    "directory (no config.json)"
                )
        elif self.model is not None:
            raise ValueError(f'speculative_config: method {self.method!r} takes no "model"')
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's defaults when neither is given
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not _is_int(v) or v < 1:  # type: ignore[operator]  # v is an int here
                    raise ValueError(f"speculative_config: {name}={v!r} must be an integer >= 1")
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi}"
                )
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max are for method ngram")
        d = self.disable_by_batch_size
        if d is not None and (not _is_int(d) or d < 1):
            raise ValueError(
                f"speculative_config: disable_by_batch_size={d!r} must be an integer >= 1"
            )
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if not _is_int(v) or v < (1 if "depth" in name else 0):
                raise ValueError(f"speculative_config: {name}={v!r} is out of range")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_max_spec_offset"):
            if not isinstance(getattr(self, name), (int, float)):
                raise ValueError(f"speculative_config: {name} must be a number")
        p = self.suffix_decoding_min_token_prob
        if not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(
                f"speculative_config: suffix_decoding_min_token_prob={p!r} not in [0, 1]"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A dict, a JSON string (the CLI flag) or a SpeculativeConfig -> SpeculativeConfig."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object / dict")
        d: dict[str, Any] = {}
        ignored = []
        known = {f.name for f in dataclasses.fields(cls)} - {"ignored"}
        for key, v in value.items():
            name = _ALIASES.get(key, key)
            if name in _IGNORED:
                ignored.append(key)
            elif name not in known:
                raise ValueError(
                    f"speculative_config: unknown key {key!r} (known: {', '.join(sorted(known))})"
                )
            else:
                d[name] = v
        method = d.get("method")
        if isinstance(method, str):
            method = _ALIASES.get(method.lower(), method.lower())
        if method is None:
            if d.get("model"):
                method = "eagle3"
            elif "prompt_lookup_min" in d or "prompt_lookup_max" in d:
                method = "ngram"
            else:
                raise ValueError('speculative_config needs "method" (ngram, suffix or eagle3)')
        d["method"] = method
        if "num_speculative_tokens" not in d:
            raise ValueError('speculative_config needs "num_speculative_tokens"')
        return cls(**d, ignored=tuple(ignored))

    def describe(self) -> str:
        """One line for the start-up log."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            what = f"n-gram prompt lookup (n={self.prompt_lookup_min}..{self.prompt_lookup_max})"
        elif self.method == "suffix":
            what = (
                f"suffix decoding (tree depth {self.suffix_decoding_max_tree_depth}, "
                f"{self.suffix_decoding_max_cached_requests} cached requests)"
            )
        else:
            what = f"EAGLE-3 draft {self.model}"
        off = self.disable_by_batch_size
        s = f"speculative decoding: {what}, up to {k} draft tokens per step"
        if off is not None:
            s += f", off while more than {off} requests run"
        if self.ignored:
            s += f" (ignored here: {', '.join(self.ignored)})"
        return s


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
