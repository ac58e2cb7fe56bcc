"""KimiTokenizer: the tiktoken-based Kimi tokenizer, loaded from a checkpoint directory.

Owns: reading `tiktoken.model` (one `base64(bytes) rank` per line) and `tokenizer_config.json`
exactly as the real checkpoints ship them (spec §4), encode/decode, and the entry point to chat
template rendering.

Invariants:
- `num_base_tokens = len(ranks)`; ids `num_base_tokens + k`, k < 256, are special tokens named
  by `added_tokens_decoder` or `<|reserved_token_{id}|>`; `vocab_size = num_base_tokens + 256`.
- `encode` never adds BOS/EOS. With `allow_special=True` special-token strings in the text
  become their ids. Long inputs are cut like tokenization_kimi.py (400k-char pieces, runs of
  more than 25k whitespace / non-whitespace characters), but only between special tokens, so
  a cut can never break one apart.
- `special_ids` are the ids flagged `special: true`; only those are removed by
  `skip_special_tokens=True`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import regex
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from k2serve.tokenizer.special import NUM_RESERVED_SPECIAL_TOKENS, PAT_STR, reserved_name

TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


class TokenizerError(ValueError):
    """A tokenizer directory or input that cannot be used; the message names the problem."""


def split_whitespaces_or_nonwhitespaces(s: str, max_len: int) -> Iterator[str]:
    """Cut `s` so that no run of only-whitespace or only-non-whitespace exceeds `max_len`."""
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


class KimiTokenizer:
    """tiktoken BPE + Kimi special tokens + chat template (see module docstring)."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        added_tokens_decoder: dict[int, dict[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        name: str = "kimi",
    ) -> None:
        if not mergeable_ranks:
            raise TokenizerError("tiktoken.model holds no tokens")
        self.num_base_tokens = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(self.num_base_tokens)):
            raise TokenizerError("tiktoken.model ranks must be exactly 0..N-1, each once")
        self.config = dict(config or {})
        self.chat_template = chat_template
        added = {int(k): v for k, v in (added_tokens_decoder or {}).items()}
        n = self.num_base_tokens
        special_range = range(n, n + NUM_RESERVED_SPECIAL_TOKENS)
        for i in added:
            if i not in special_range:
                raise TokenizerError(
                    f"added_tokens_decoder id {i} is outside the special range "
                    f"[{n}, {n + NUM_RESERVED_SPECIAL_TOKENS}) of this tiktoken.model"
                )
        self._id_to_special: dict[int, str] = {}
        self.special_ids: set[int] = set()
        for i in special_range:
            entry = added.get(i)
            content = entry["content"] if entry else reserved_name(i)
            self._id_to_special[i] = content
            if entry and entry.get("special", False):
                self.special_ids.add(i)
        self._special_to_id = {v: k for k, v in self._id_to_special.items()}
        if len(self._special_to_id) != len(self._id_to_special):
            raise TokenizerError("added_tokens_decoder names the same token twice")
        self._ranks = mergeable_ranks
        self._id_to_bytes = {r: b for b, r in mergeable_ranks.items()}
        self.model = tiktoken.Encoding(
            name=name,
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self._special_to_id,
        )
        # Longest names first so that a name that is a prefix of another cannot win.
        names = sorted(self._special_to_id, key=len, reverse=True)
        self._special_re = regex.compile("(" + "|".join(regex.escape(s) for s in names) + ")")

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> KimiTokenizer:
        path = os.fspath(path)
        model_file = os.path.join(path, "tiktoken.model")
        if not os.path.isfile(model_file):
            raise TokenizerError(f"no tiktoken.model in {path!r}")
        try:
            ranks = load_tiktoken_bpe(model_file)
        except Exception as e:  # malformed base64 or rank
            raise TokenizerError(f"cannot read {model_file!r}: {e}") from e
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_file!r} is not valid JSON: {e}") from e
        template = None
        tpl_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(tpl_file):
            with open(tpl_file, encoding="utf-8") as f:
                template = f.read()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        return cls(ranks, cfg.get("added_tokens_decoder"), cfg, template)

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        return self.num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS

    def __len__(self) -> int:
        return self.vocab_size

    def _named_id(self, key: str, default: str) -> int | None:
        value = self.config.get(key, default)
        if isinstance(value, dict):  # HF AddedToken serialisation
            value = value.get("content")
        return self._special_to_id.get(value) if isinstance(value, str) else None

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token", "[BOS]")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token", "[EOS]")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token", "[PAD]")

    def token_to_id(self, token: str) -> int | None:
        """Id of a special-token name or of a string that is exactly one base token, else None."""
        if token in self._special_to_id:
            return self._special_to_id[token]
        return self._ranks.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str:
        """Special-token name, or the base token's bytes decoded (invalid UTF-8 replaced)."""
        return self.id_to_bytes(token_id).decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id].encode("utf-8")
        b = self._id_to_bytes.get(token_id)
        if b is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {len(self)})")
        return b

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Every name in the special range (flagged or not, reserved included): the strings
        that `encode(..., allow_special=True)` turns into control ids."""
        return tuple(self._special_to_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; no BOS/EOS. `allow_special`: special names become their ids."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        parts = self._special_re.split(text) if allow_special else [text]
        ids: list[int] = []
        for j, part in enumerate(parts):
            if not part:
                continue
            if allow_special and j % 2 == 1:  # a captured special-token name
                ids.append(self._special_to_id[part])
                continue
            for i in range(0, len(part), TIKTOKEN_MAX_ENCODE_CHARS):
                piece = part[i : i + TIKTOKEN_MAX_ENCODE_CHARS]
                for sub in split_whitespaces_or_nonwhitespaces(piece, MAX_NO_WHITESPACES_CHARS):
                    # disallowed_special=() : with allow_special=False names are plain text.
                    ids.extend(self.model.encode(sub, allowed_special=set(), disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a split character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens and i in self.special_ids:
                continue
            out.append(self.id_to_bytes(i))
        return b"".join(out)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the checkpoint's template (or the built-in K2-Thinking one)."""
        from k2serve.tokenizer.chat_template import render_chat_template

        return render_chat_template(
            self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            special_tokens={
                k: self._id_to_special[i]
                for k, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))
                if i is not None
            },
        )
