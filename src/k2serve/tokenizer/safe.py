"""Encode a rendered chat prompt so that only the template's own markers become control tokens.

Owns: `render_and_encode(tokenizer, render, *user_values)`, the guard against role injection.
A client who writes `<|im_end|><|im_system|>system<|im_middle|>...` in a message (or in a name,
a tool name or schema, tool-call arguments, reasoning) must not be able to open a system turn:
every string that came from the request is encoded as ordinary text, while the markers the
chat template itself writes stay special tokens.

How: before rendering, every special-token name inside a user string is "defanged" by putting
a sentinel character (a private-use code point that occurs in no input) between its
characters, so the rendered text contains special-token names only where the template wrote
them. The rendered text is split at those names (each becomes its id); the text between them,
sentinels removed, is encoded with specials disallowed.

Invariants:
- The ids of a user string's special-token names are exactly those of the same characters
  in ordinary text (`encode(s, allow_special=False)`), and the visible text is unchanged: the
  returned text is the plain rendering.
- A user string that ends with the start of a name (`<|im_`) or starts with the end of one
  (`end|>`) is fenced with the sentinel too, so user text and template text cannot join into a
  name across the boundary.
- Strings without special-token names (and not fenced) are passed to the template unchanged,
  so template logic over them (comparisons, tool-call id checks) sees the same values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import regex

# Private-use code points: what a sentinel is chosen from (the first that occurs in no input).
_CANDIDATES = range(0xE000, 0xF900)


class SpecialTokenGuard:
    """The special-token names of one tokenizer, and how to defang and encode around them."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted({n for n in names if n}, key=len, reverse=True)
        if not self.names:
            raise ValueError("the tokenizer has no special-token names")
        self.pattern = regex.compile("|".join(regex.escape(n) for n in self.names))
        self.prefixes = {n[:k] for n in self.names for k in range(1, len(n))}
        self.suffixes = {n[k:] for n in self.names for k in range(1, len(n))}
        self.max_len = max(len(n) for n in self.names)

    # ------------------------------------------------------------------ defang
    def defang_str(self, s: str, sentinel: str) -> str:
        if self.pattern.search(s) is not None:
            s = self.pattern.sub(lambda m: sentinel.join(m.group()), s)
        head = any(s[:k] in self.suffixes for k in range(1, min(len(s), self.max_len) + 1))
        tail = any(s[-k:] in self.prefixes for k in range(1, min(len(s), self.max_len) + 1))
        return (sentinel if head else "") + s + (sentinel if tail else "")

    def defang(self, value: Any, sentinel: str) -> Any:
        """A copy of `value` (str / dict / list / tuple, nested) with every string defanged."""
        if isinstance(value, str):
            return self.defang_str(value, sentinel)
        if isinstance(value, dict):
            return {
                (self.defang_str(k, sentinel) if isinstance(k, str) else k): self.defang(
                    v, sentinel
                )
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return type(value)(self.defang(v, sentinel) for v in value)
        return value

    # ------------------------------------------------------------------ encode
    def encode(self, tokenizer, rendered: str, sentinel: str) -> tuple[str, list[int]]:
        """(plain text, ids) of a rendering whose user strings were defanged with `sentinel`."""
        ids: list[int] = []
        text: list[str] = []
        pos = 0
        for m in self.pattern.finditer(rendered):
            if m.start() > pos:
                self._encode_text(tokenizer, rendered[pos : m.start()], sentinel, ids, text)
            name = m.group()
            tid = tokenizer.token_to_id(name)
            if tid is None:  # cannot happen for a name the tokenizer listed
                raise ValueError(f"the tokenizer has no id for its special token {name!r}")
            ids.append(tid)
            text.append(name)
            pos = m.end()
        if pos < len(rendered):
            self._encode_text(tokenizer, rendered[pos:], sentinel, ids, text)
        return "".join(text), ids

    @staticmethod
    def _encode_text(tokenizer, part: str, sentinel: str, ids: list, text: list) -> None:
        for form in _forms(sentinel):
            part = part.replace(form, "")
        if part:
            ids.extend(tokenizer.encode(part, allow_special=False))
            text.append(part)


@functools.lru_cache(maxsize=8)
def _guard(names: tuple[str, ...]) -> SpecialTokenGuard:
    return SpecialTokenGuard(names)


def guard_for(tokenizer) -> SpecialTokenGuard:
    names = getattr(tokenizer, "special_tokens", None)
    if names is None:
        raise TypeError(f"{type(tokenizer).__name__} does not list its special_tokens")
    return _guard(tuple(names))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _forms(sentinel: str) -> tuple[str, ...]:
    """The sentinel as it may appear in the rendering: itself, or JSON-escaped by a template's
    `tojson` with ensure_ascii (which HF's default is not, but a template may ask for)."""
    cp = ord(sentinel)
    return (sentinel, f"\\u{cp:04x}", f"\\u{cp:04X}")


_PRIVATE_USE = regex.compile("[\ue000-\uf8ff]")
_ESCAPED = regex.compile(r"\\u([eEfF][0-9a-fA-F]{3})")


def pick_sentinel(*values: Any) -> str:
    """A private-use character that occurs in none of the strings in `values` (in no form).

    One scan per string for the private-use characters and `\\uXXXX` escapes it holds, so the
    cost is linear in the request (it was candidates x strings: minutes for a 3 MB body)."""
    used: set[int] = set()
    for s in _strings(values):
        used.update(ord(c) for c in _PRIVATE_USE.findall(s))
        if "\\u" in s:
            used.update(int(h, 16) for h in _ESCAPED.findall(s))
    for cp in _CANDIDATES:
        if cp not in used:
            return chr(cp)
    raise ValueError("the request uses every private-use character; cannot encode it safely")


def render_and_encode(
    tokenizer,
    render: Callable[..., str],
    *user_values: Any,
    trusted: Iterable[str] = (),
) -> tuple[str, list[int]]:
    """(text, ids) of `render(*user_values)` with every string in `user_values` encoded as text.

    `render` may place the values anywhere in its output (a chat template does); its own
    special-token names stay control tokens. `trusted`: more text `render` may emit verbatim
    (the template source), so the sentinel is chosen to occur in none of it.
    """
    guard = guard_for(tokenizer)
    sentinel = pick_sentinel(*user_values, *trusted, guard.names)
    rendered = render(*(guard.defang(v, sentinel) for v in user_values))
    return guard.encode(tokenizer, rendered, sentinel)
