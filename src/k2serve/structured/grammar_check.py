"""Does a compiled grammar match any string at all? A productivity check on xgrammar's EBNF.

Owns: `check_grammar_finishes(ebnf)`, run by `GrammarBackend.compile` on every grammar it
compiles (EBNF, and the grammars xgrammar makes from JSON schemas and regexes): a ValueError
when the root rule can never finish, e.g. `root ::= "a" root` or `root ::= root` (every string
it allows can be extended forever, so no reply could ever complete and stop).

How: xgrammar prints a normalised grammar (`str(compiled.grammar)`): one `name ::= expr` per
line, with quoted strings, character classes, rule references, groups, `|`, the postfix
operators `* + ?` and `{m, n}`, lookaheads `(= ...)` and builtin elements such as
`Regex("...", json_string=true)`. A rule is productive when one of its alternatives is a
sequence of productive items (terminals are; an item that may repeat zero times is); the
least fixpoint over the rules says whether `root` is.

Invariants:
- Only a definite "never finishes" raises: text this parser does not understand makes the
  check pass (the first-token check and the generation itself still apply).
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<cls>\[(?:[^\]\\]|\\.)*\])
    | (?P<rep>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})
    | (?P<look>\(=)
    | (?P<name>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<op>[()|*+?,=])
    )""",
    re.VERBOSE,
)


class _Unknown(Exception):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, i = [], 0
    text = text.rstrip()
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None or m.end() == i:
            raise _Unknown(text[i : i + 20])
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        i = m.end()
    return out


class _Expr:
    """expr := seq ('|' seq)*; seq := item*; item := primary postfix*."""

    def __init__(self, toks: list[tuple[str, str]]):
        self.toks, self.i = toks, 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise _Unknown("end of rule")
        self.i += 1
        return tok

    def expr(self) -> tuple:
        alts = [self.seq()]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.seq())
        return ("or", alts)

    def seq(self) -> tuple:
        items = []
        while self.peek() is not None and self.peek() not in (("op", "|"), ("op", ")")):
            items.append(self.item())
        return ("and", items)

    def item(self) -> tuple:
        node = self.primary()
        while True:
            tok = self.peek()
            if tok is None or not (tok[0] == "rep" or tok[1] in ("*", "+", "?")):
                return node
            kind, text = self.take()
            lo = int(re.findall(r"-?\d+", text)[0]) if kind == "rep" else int(text == "+")
            node = ("opt", node) if lo <= 0 else node

    def primary(self) -> tuple:
        kind, text = self.take()
        if kind in ("str", "cls"):
            return ("term",)
        if kind == "look":  # a lookahead consumes nothing
            self._skip_group()
            return ("term",)
        if kind == "name":
            if self.peek() == ("op", "("):  # a builtin element: Regex("..."), TagDispatch(...)
                self.take()
                self._skip_group()
                return ("term",)
            return ("ref", text)
        if (kind, text) == ("op", "("):
            inner = self.expr()
            if self.take() != ("op", ")"):
                raise _Unknown("unbalanced group")
            return inner
        raise _Unknown(text)

    def _skip_group(self) -> None:
        depth = 1
        while depth:
            kind, text = self.take()
            if kind == "look" or (kind, text) == ("op", "("):
                depth += 1
            elif (kind, text) == ("op", ")"):
                depth -= 1


def _productive(node: tuple, ok: set[str]) -> bool:
    tag = node[0]
    if tag in ("term", "opt"):
        return True
    if tag == "ref":
        return node[1] in ok
    if tag == "and":
        return all(_productive(x, ok) for x in node[1])
    return any(_productive(x, ok) for x in node[1])  # "or"


def rules_that_finish(ebnf: str) -> tuple[set[str], set[str]] | None:
    """(productive rule names, all rule names), or None if the text is not understood."""
    rules: dict[str, tuple] = {}
    try:
        for line in ebnf.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition("::=")
            if not sep:
                raise _Unknown(line[:20])
            parser = _Expr(_tokens(body))
            node = parser.expr()
            if parser.peek() is not None:
                raise _Unknown("trailing text")
            rules[name.strip()] = node
    except (_Unknown, IndexError, ValueError):
        return None
    ok: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, node in rules.items():
            if name not in ok and _productive(node, ok):
                ok.add(name)
                changed = True
    return ok, set(rules)


def check_grammar_finishes(ebnf: str, root: str = "root") -> None:
    got = rules_that_finish(ebnf)
    if got is None:
        return
    ok, names = got
    if root in names and root not in ok:
        raise ValueError(
            "it matches nothing: no string it allows can ever end (a rule that only recurses, "
            f"with no base case); rules that cannot finish: {', '.join(sorted(names - ok)[:8])}"
        )
