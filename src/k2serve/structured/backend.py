"""The grammar engine behind structured outputs: xgrammar, fed the Kimi vocabulary as bytes.

Owns: the vocabulary handed to xgrammar (`token_bytes`), compiling a `StructuredOutputsParams`
into an xgrammar `CompiledGrammar` (with a bounded cache), making one matcher per sequence, and
filling / applying the token bitmask of a batch.

Why xgrammar (measured with benchmarks/grammar_engines.py, see docs/structured_outputs.md): on a
163,840-token Kimi vocabulary its mask time per token is of the same order as llguidance's (tens
of us on average, lower median), a schema compiles in tens of ms once (cached); it is the
default of vLLM and SGLang, ships CPU, CUDA and Triton kernels that apply the bitmask in place
(no host sync), rolls back without limit, and its structural tags address single special tokens
by id, which the Kimi tool-call section needs.

Invariants:
- Token ids below `num_base_tokens` carry their BPE bytes. Special ids carry nothing (xgrammar
  never allows them inside text). Two vocabularies: the one of JSON / regex / choice / EBNF
  grammars has no special token at all, so such output never holds a marker; the one of
  structural tags (the tool-call section) gives the Kimi dialect markers (`<think>`,
  `</think>`, tool-call markers) their text so that `TokenFormat` can name them, and the JSON
  arguments inside exclude the marker text.
  Ids past the tokenizer (a padded lm_head) are empty: never allowed.
- The stop tokens of every grammar are the engine's EOS ids: a grammar that is complete allows
  only them (or more text where the grammar allows more).
- `compile` raises `ValueError` with xgrammar's message (source location stripped) for any
  schema, regex or grammar it cannot use; the server turns it into a 400.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from k2serve.parsers.markers import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    THINK_START,
)
from k2serve.structured.grammar_check import check_grammar_finishes
from k2serve.structured.params import StructuredOutputsParams
from k2serve.structured.schema import prepare_json_schema

DIALECT_MARKERS = (
    THINK_START,
    THINK_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARG_BEGIN,
    CALL_END,
)
# NOTE: any whitespace between JSON tokens (as vLLM), but at most this many in a row, so a model
# that keeps writing blanks cannot run a constrained reply to max_tokens without closing it.
MAX_JSON_WHITESPACE = 16
_CACHE_SIZE = 256
_XGR_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency
        raise RuntimeError(
            "structured outputs need the xgrammar package: pip install xgrammar"
        ) from e
    return xgrammar


def token_bytes(tokenizer, vocab_size: int, markers: bool) -> list[bytes]:
    """The bytes of every token id in [0, vocab_size) as the grammar engine sees them; the
    dialect markers carry their text only with `markers` (else they are never allowed)."""
    keep = {tokenizer.token_to_id(m) for m in DIALECT_MARKERS} - {None} if markers else set()
    nb = tokenizer.num_base_tokens
    out = []
    for i in range(vocab_size):
        if i < nb or i in keep:
            out.append(tokenizer.id_to_bytes(i))
        else:
            out.append(b"")
    return out


def clean_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _XGR_LOCATION.sub("", msg)


class GrammarBackend:
    """Compiles constraints for one tokenizer; thread-safe (the server validates on its event
    loop while the engine thread makes matchers)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgr()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < vocab_size)
        infos = [
            xgr.TokenizerInfo(
                token_bytes(tokenizer, vocab_size, markers),
                xgr.VocabType.RAW,
                vocab_size=vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            for markers in (False, True)
        ]
        # plain text grammars (JSON, regex, choice, EBNF) never see the markers; structural
        # tags (the tool-call section) name them
        self.compiler = xgr.GrammarCompiler(infos[0], cache_enabled=False)
        self.tag_compiler = xgr.GrammarCompiler(infos[1], cache_enabled=False)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._batch: Any = None  # xgr.BatchGrammarMatcher, made on first use

    def marker_id(self, marker: str) -> int:
        tid = self.tokenizer.token_to_id(marker)
        if tid is None:
            raise ValueError(f"the tokenizer has no {marker} token")
        return tid

    # ---- compile ------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams):
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(params)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / pydantic errors
            raise ValueError(f"invalid {_what(params.kind)}: {clean_error(e)}") from None
        self._check_not_empty(compiled, params.kind)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _check_not_empty(self, compiled, kind: str) -> None:
        """ValueError when the grammar allows no first token at all (`root ::= root`, a schema
        whose every branch loops: generation would have nothing to sample), or when no string
        it allows can ever end (`root ::= "a" root`; see grammar_check.py)."""
        matcher = self.matcher(compiled)
        bitmask = self.allocate_bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError(
                f"invalid {_what(kind)}: it matches nothing (no output can satisfy it)"
            )
        grammar = getattr(compiled, "grammar", None)
        if grammar is not None:
            try:
                check_grammar_finishes(str(grammar))
            except ValueError as e:
                raise ValueError(f"invalid {_what(kind)}: {e}") from None

    def _compile(self, p: StructuredOutputsParams):
        c = self.compiler
        kind = p.kind
        if kind == "json":
            return c.compile_json_schema(
                prepare_json_schema(p.json)
                if isinstance(p.json, dict)
                else _bool_schema(bool(p.json)),
                any_whitespace=True,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
            )
        if kind == "json_object":
            return c.compile_json_schema(
                {"type": "object"}, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
            )
        if kind == "regex":
            return c.compile_regex(p.regex)
        if kind == "grammar":
            return c.compile_grammar(p.grammar)
        xgr = _xgr()
        from xgrammar.structural_tag import ConstStringFormat, OrFormat, StructuralTag

        if kind == "choice":
            options: list[Any] = [ConstStringFormat(value=s) for s in p.choice or []]
            return c.compile_structural_tag(StructuralTag(format=OrFormat(elements=options)))
        c = self.tag_compiler
        assert kind == "structural_tag"
        tag = p.structural_tag
        assert isinstance(tag, dict)  # the params' validation made it a dict
        if "structures" in tag:  # vLLM's first form: {"structures": [...], "triggers": [...]}
            from xgrammar.structural_tag import TriggeredTagsFormat

            tags: Any = [  # dicts: xgrammar's pydantic models validate them
                {
                    "begin": s["begin"],
                    "content": {"type": "json_schema", "json_schema": s["schema"]},
                    "end": s["end"],
                }
                for s in tag["structures"]
            ]
            fmt = TriggeredTagsFormat(triggers=tag.get("triggers") or [], tags=tags)
            return c.compile_structural_tag(StructuralTag(format=fmt))
        if "format" not in tag:
            raise ValueError(
                "structural_tag needs a 'format' (or vLLM's 'structures' and 'triggers')"
            )
        return c.compile_structural_tag(xgr.StructuralTag.from_json(tag))

    # ---- matchers and masks -------------------------------------------------------------------
    def matcher(self, compiled):
        return _xgr().GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill row rows[k] of `bitmask` (int32 CPU [B, words]) from matchers[k]."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
            return
        if self._batch is None:
            self._batch = _xgr().BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def allocate_bitmask(self, rows: int, pin: bool = False) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pin)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """logits[r] = -inf where bit r of the row is 0, for r in rows. On CUDA this is
        xgrammar's Triton kernel, launched without waiting for the host."""
        # logits: [B, vocab] float32; bitmask: [B, ceil(vocab / 32)] int32 on logits.device
        vocab = min(logits.shape[1], bitmask.shape[1] * 32)
        _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)


# exact JSON schemas for xgrammar (refusing what it would ignore): see structured/schema.py
fix_string_lengths = prepare_json_schema


def _bool_schema(b: bool) -> dict:
    if not b:
        raise ValueError("invalid JSON schema: the schema `false` matches no value")
    return {}


def _what(kind: str) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regex",
        "grammar": "grammar",
        "choice": "choice",
        "structural_tag": "structural_tag",
    }[kind]
