"""xgrammar vs llguidance on a Kimi vocabulary: setup, compile, and mask time per token.

Run from the repo root (both packages installed):
    python benchmarks/grammar_engines.py                 # a 163,840-token Kimi-format tokenizer
    python benchmarks/grammar_engines.py --vocab-size 2048

The tokenizer is written with `write_tokenizer_files` (real special-token layout, BPE ranks of
the requested size). For a JSON schema and for "any JSON object", each engine walks the tokens of
one valid document: the mask of every position is computed (one row, host), then the token is
accepted. Prints setup (tokenizer info), compile, and mean / p50 / max mask time in us.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
DOC = {
    "name": "Alice Smith",
    "age": 31,
    "tags": ["a", "bb", "hello world"],
    "address": {"city": "Paris", "zip": "75001"},
}


def _stats(ts: list[float]) -> str:
    ts = sorted(ts)
    mean = sum(ts) / len(ts)
    return (
        f"mean {mean * 1e6:.1f} us, p50 {ts[len(ts) // 2] * 1e6:.1f} us, max {ts[-1] * 1e6:.1f} us"
    )


def bench_xgrammar(tok, ids, eos):
    import xgrammar as xgr

    from k2serve.structured.backend import token_bytes

    t = time.perf_counter()
    info = xgr.TokenizerInfo(
        token_bytes(tok, tok.vocab_size, markers=False),
        xgr.VocabType.RAW,
        vocab_size=tok.vocab_size,
        stop_token_ids=eos,
    )
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar: tokenizer info {(time.perf_counter() - t) * 1e3:.0f} ms")
    bm = xgr.allocate_token_bitmask(1, tok.vocab_size)
    for name, schema in (("schema", SCHEMA), ("json object", {"type": "object"})):
        t = time.perf_counter()
        cg = comp.compile_json_schema(schema)
        ct = time.perf_counter() - t
        m = xgr.GrammarMatcher(cg)
        ts = []
        for i in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            ts.append(time.perf_counter() - t)
            assert m.accept_token(i), i
        print(f"xgrammar {name}: compile {ct * 1e3:.1f} ms; mask {_stats(ts)}")


def bench_llguidance(tok, ids, eos):
    import llguidance
    import llguidance.torch as llt
    from llguidance.tiktoken import lltokenizer_from_encoding

    t = time.perf_counter()
    lltok = lltokenizer_from_encoding(tok.model, n_vocab=tok.vocab_size, eos_token=eos[-1])
    print(f"llguidance: tokenizer {(time.perf_counter() - t) * 1e3:.0f} ms")
    bm = llt.allocate_token_bitmask(1, tok.vocab_size)
    for name, schema in (("schema", SCHEMA), ("json object", {"type": "object"})):
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
        ct = time.perf_counter() - t
        ts = []
        for i in ids:
            t = time.perf_counter()
            llt.fill_next_token_bitmask(m, bm, 0)
            ts.append(time.perf_counter() - t)
            assert m.consume_token(i), m.get_error()
        print(f"llguidance {name}: compile {ct * 1e3:.1f} ms; mask {_stats(ts)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=163840)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from k2serve.tokenizer import KimiTokenizer, write_tokenizer_files

    d = tempfile.mkdtemp(prefix="kimi-tok-")
    write_tokenizer_files(d, args.vocab_size)
    tok = KimiTokenizer.from_dir(d)
    eos = [tok.eos_token_id, tok.token_to_id("<|im_end|>")]
    ids = tok.encode(json.dumps(DOC))
    print(f"vocab {tok.vocab_size}; document of {len(ids)} tokens")
    for fn in (bench_xgrammar, bench_llguidance):
        try:
            fn(tok, ids, eos)
        except ImportError as e:
            print(f"{fn.__name__}: not installed ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
