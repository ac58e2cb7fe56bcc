"""Write a Kimi-format tokenizer (tiktoken.model + tokenizer_config.json) of any vocab size.

Owns: `write_tokenizer_files(out_dir, vocab_size, corpus=None, chat_template=None)`, used by
`k2serve make-checkpoint` and the demo training script.

Invariants:
- `tiktoken.model` has `vocab_size - 256` base ranks (a BPE trained on `corpus`, padded
  deterministically), one `base64(bytes) rank` line each, in rank order.
- `tokenizer_config.json` has the real keys and names: `added_tokens_decoder` with the real
  special-token names and flags at `num_base_tokens + k` (spec §4), bos/eos/pad/unk,
  `additional_special_tokens`, `tokenizer_class`, `auto_map`, `model_max_length`.
- The result loads with `KimiTokenizer.from_dir` through the same path as a real checkpoint.
"""

from __future__ import annotations

import base64
import json
import os

from k2serve.tokenizer.bpe import train_bpe
from k2serve.tokenizer.corpus import builtin_corpus
from k2serve.tokenizer.special import (
    ADDITIONAL_SPECIAL_TOKENS,
    BOS_TOKEN,
    EOS_TOKEN,
    NUM_RESERVED_SPECIAL_TOKENS,
    PAD_TOKEN,
    PAT_STR,
    SPECIAL_TOKENS,
    UNK_TOKEN,
)

MIN_VOCAB_SIZE = 512  # 256 single bytes + 256 special ids


def tokenizer_config(num_base_tokens: int, chat_template: str | None = None) -> dict:
    """The tokenizer_config.json dict for a vocab with `num_base_tokens` base ranks."""
    added = {
        str(num_base_tokens + k): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for k, (name, special) in sorted(SPECIAL_TOKENS.items())
    }
    cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": UNK_TOKEN,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def write_tiktoken_model(path: str, ranks: dict[bytes, int]) -> None:
    with open(path, "w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def write_tokenizer_files(
    out_dir: str | os.PathLike,
    vocab_size: int,
    corpus: str | None = None,
    chat_template: str | None = None,
) -> dict[bytes, int]:
    """Train a BPE of `vocab_size - 256` ranks on `corpus` (default: the built-in one) and
    write tiktoken.model + tokenizer_config.json into `out_dir`. Returns the ranks.

    `chat_template`, if given, is stored in tokenizer_config.json (the demo checkpoint writes a
    chat_template.jinja file instead)."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 bytes + 256 special ids), "
            f"got {vocab_size!r}"
        )
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    num_base = vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    ranks = train_bpe(builtin_corpus() if corpus is None else corpus, num_base, PAT_STR)
    write_tiktoken_model(os.path.join(out_dir, "tiktoken.model"), ranks)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(num_base, chat_template), f, indent=2, ensure_ascii=False)
        f.write("\n")
    return ranks
