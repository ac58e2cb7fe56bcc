"""IncrementalDetokenizer: token ids in, text deltas out, for streaming.

Owns: turning a growing sequence of token ids into text deltas.

Invariants:
- A delta never holds part of a UTF-8 character: bytes of an unfinished character wait for the
  next token (a UTF-8 incremental decoder does the bookkeeping).
- The deltas of `add()` calls followed by `flush()` concatenate to exactly
  `tokenizer.decode(all_ids, skip_special_tokens)`.
- With `skip_special_tokens=True` only ids flagged special are dropped; the tool-call markers and
  `<think>`/`</think>` always come through.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol


class BytesDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (KimiTokenizer has it)."""

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: BytesDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far

    def add(self, ids: int | Iterable[int]) -> str:
        """Feed new token ids; return the newly completed text (may be "")."""
        if isinstance(ids, int):
            ids = [ids]
        data = self.tokenizer.decode_bytes(list(ids), self.skip_special_tokens)
        delta = self._decoder.decode(data, final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: bytes of an unfinished character come out as U+FFFD."""
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta
