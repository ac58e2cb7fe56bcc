"""The Kimi special-token table and split pattern, as the real checkpoints ship them (spec §4).

Owns: `PAT_STR` (Kimi's pre-tokenization regex, with `&&` character-class intersections),
`SPECIAL_TOKENS` (offset from `num_base_tokens` -> (name, special flag)), and the counts.

Invariants:
- Special ids are `num_base_tokens + k` for k in [0, NUM_RESERVED_SPECIAL_TOKENS); ids without
  a name in `added_tokens_decoder` are called `<|reserved_token_{id}|>`.
- The tool-call markers and `<think>`/`</think>` are NOT flagged special: they survive
  `skip_special_tokens=True` so the parsers see them as text.
"""

from __future__ import annotations

NUM_RESERVED_SPECIAL_TOKENS = 256

# Joined with "|" exactly as tokenization_kimi.py does. tiktoken's Rust regex (fancy-regex)
# understands `&&`; Python's `regex` module only with the V1 flag (V0 silently never matches).
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# offset from num_base_tokens -> (content, special flag). Real ids: 163584 + offset.
SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|im_end|>", True),
    3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True),
    6: ("<|start_header_id|>", True),
    7: ("<|end_header_id|>", True),
    9: ("[EOT]", True),
    10: ("<|im_system|>", True),
    11: ("<|tool_calls_section_begin|>", False),
    12: ("<|tool_calls_section_end|>", False),
    13: ("<|tool_call_begin|>", False),
    14: ("<|tool_call_argument_begin|>", False),
    15: ("<|tool_call_end|>", False),
    17: ("<|im_middle|>", True),
    18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True),
    20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True),
    22: ("<think>", False),
    23: ("</think>", False),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
ADDITIONAL_SPECIAL_TOKENS = [
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
]


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"
