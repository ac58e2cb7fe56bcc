"""Incremental detokenization for the engine's streaming text and stop strings.

Uses `k2serve.tokenizer.IncrementalDetokenizer` when the tokenizer package provides one; otherwise
(and for test tokenizers) `SimpleIncrementalDetokenizer`, which works with any tokenizer that has
`decode(ids, skip_special_tokens=...)`. Invariant of both: `add(ids)` returns only new text and
never ends inside a UTF-8 character (text ending in U+FFFD is held back until completed).
"""

from __future__ import annotations


class SimpleIncrementalDetokenizer:
    # Re-decodes a short window of recent tokens; O(window) per token.
    WINDOW = 6

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text has been returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) < len(prefix) or not full.startswith(prefix):
            return ""  # incomplete character: wait for more tokens
        new = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.WINDOW)
        return new

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""


def make_detokenizer(tokenizer, skip_special_tokens: bool):
    try:
        from k2serve.tokenizer import IncrementalDetokenizer, KimiTokenizer
    except ImportError:
        return SimpleIncrementalDetokenizer(tokenizer, skip_special_tokens)
    if isinstance(tokenizer, KimiTokenizer):
        return IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return SimpleIncrementalDetokenizer(tokenizer, skip_special_tokens)
