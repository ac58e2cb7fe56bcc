"""JSON schemas made safe for the grammar engine: what it cannot honour is refused, by name.

Owns: `prepare_json_schema(schema)`, run on every schema before xgrammar compiles it (response
formats, guided_json, tool parameters). xgrammar 0.2.8 silently ignores some keywords, so its
output could violate the schema with finish_reason "stop"; a schema is therefore either
rewritten into an equivalent one xgrammar honours, or refused with a `ValueError` that names
the keyword and where it is (the server answers 400).

Rewrites (equivalent schemas):
- `allOf`: the branches are merged into their parent (types intersected, `required` united,
  bounds tightened, same-named properties combined); branches that conflict in a way no merge
  can express are refused, branches whose types do not meet match no value.
- `oneOf` whose branches are disjoint (different types, or a required property with different
  constants) becomes `anyOf`; overlapping branches are refused (xgrammar would allow a value
  matching two of them).
- `enum` / `const` next to other keywords: the values the other keywords reject are dropped
  (xgrammar takes the values alone), so `{"type": "string", "enum": [1, "a"]}` allows "a" only.
- A schema of several types (`"type": ["string", "null"]`) with type-specific keywords becomes
  an `anyOf` of one branch per type, so each branch keeps its own keywords (a length-bounded
  nullable string then gets the control-character-free string pattern below).
- Length-bounded plain strings become patterns: xgrammar's own length rule lets raw control
  characters (invalid JSON) through, its pattern path does not.

Refused (ValueError "... is not supported"): `not`, `if`/`then`/`else`, `uniqueItems: true`,
`contains`,
`multipleOf` other than an integer on integers, `minLength`/`maxLength` together with `pattern`
or `format`, a `pattern` matching a backslash (xgrammar writes it unescaped).

Refused as unsatisfiable (ValueError "... matches no value"): `false`, an empty enum after
filtering, conflicting `allOf` types, and `$ref` cycles with no base case (`{"$ref": "#"}`, a
loop a -> b -> a, a required property that recurses forever) - found before generation.
"""

from __future__ import annotations

import copy
import json
from typing import Any

STRING_BODY = r'[^\x00-\x1f"\\]'  # one JSON string character that needs no escape
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
     "writeOnly", "$schema", "$id", "$anchor", "discriminator"}
)  # fmt: skip
_FAMILIES = {
    "string": {"minLength", "maxLength", "pattern", "format", "contentEncoding",
               "contentMediaType"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
              "contains", "minContains", "maxContains", "unevaluatedItems"},
    "object": {"properties", "required", "additionalProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties", "dependentRequired",
               "dependentSchemas", "unevaluatedProperties"},
}  # fmt: skip
_FAMILY_OF = {"string": "string", "number": "number", "integer": "number", "array": "array",
              "object": "object", "boolean": None, "null": None}  # fmt: skip
_ALL_TYPES = ["string", "number", "boolean", "null", "array", "object"]
_SUB_ONE = ("items", "additionalProperties", "contains", "propertyNames", "additionalItems",
            "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_SUB_LIST = ("anyOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_PRODUCTIVE_BUDGET = 20_000
_WALK_BUDGET = 20_000  # schema nodes visited (allOf x anyOf expansion can multiply them)
_DEFS = frozenset({"$defs", "definitions"})


def unsupported(where: str, what: str) -> ValueError:
    at = f" at {where!r}" if where else ""
    return ValueError(
        f"invalid JSON schema: {what}{at} is not supported: the grammar engine cannot enforce "
        "it exactly (see docs/structured_outputs.md)"
    )


class Unsatisfiable(ValueError):
    pass


def unsatisfiable(where: str, why: str) -> Unsatisfiable:
    at = f" at {where!r}" if where else ""
    return Unsatisfiable(f"invalid JSON schema: the schema{at} matches no value ({why})")


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _types(node: dict) -> list[str] | None:
    t = node.get("type")
    if t is None:
        return None
    return [t] if isinstance(t, str) else list(t)


def _resolve(root: Any, ref: Any) -> Any:
    """The local target of `ref` ("#", "#/$defs/x", ...), or None if it is not local."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Prepare:
    def __init__(self, root: dict):
        self.root = root
        self.steps = 0

    # ---- the walk -------------------------------------------------------------------------
    def walk(self, node: Any, where: str) -> Any:
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if "not" in node:
            raise unsupported(where, "'not'")
        for k in ("if", "then", "else"):
            if k in node:
                raise unsupported(where, f"{k!r} (conditional schemas)")
        if node.get("uniqueItems") is True:
            raise unsupported(where, "'uniqueItems'")
        if "contains" in node:  # xgrammar would allow only `[]`, which contains nothing
            raise unsupported(where, "'contains'")
        self.steps += 1
        if self.steps > _WALK_BUDGET:
            raise unsupported(where, "a schema this large once its allOf / anyOf are expanded")
        if "allOf" in node:  # merged, then walked as a whole (a branch may bring `not`...)
            return self.walk(self.merge_all_of(node, where), where)
        if "oneOf" in node:
            if "anyOf" in node:
                raise unsupported(where, "anyOf and oneOf in one schema")
            branches = [self.walk(b, _join(where, f"oneOf.{i}"))
                        for i, b in enumerate(node.pop("oneOf"))]  # fmt: skip
            self.check_disjoint(branches, where)
            node["anyOf"] = branches
        # xgrammar takes `$ref` and `anyOf` alone, ignoring their siblings: fold the siblings in
        rest = {k: v for k, v in node.items() if k not in _ANNOTATIONS | _DEFS}
        kept = {k: v for k, v in node.items() if k in _ANNOTATIONS | _DEFS}
        if "$ref" in rest and len(rest) > 1:
            ref = rest.pop("$ref")
            return self.walk({**kept, "allOf": [{"$ref": ref}, rest]}, where)
        if "anyOf" in rest and len(rest) > 1:
            branches = rest.pop("anyOf")
            return self.any_of(kept, [{"allOf": [rest, b]} for b in branches], where)
        if "anyOf" in rest:
            return self.any_of(kept, rest["anyOf"], where)
        if "enum" in node or "const" in node:
            return self.filter_values(node, where)
        split = self.split_types(node)
        if split is not None:
            return self.walk(split, where)
        for k in _SUB_ONE:
            if isinstance(node.get(k), dict):
                node[k] = self.walk(node[k], _join(where, k))
        if isinstance(node.get("items"), list):  # draft 4-7 tuple form
            node["items"] = [self.walk(x, _join(where, f"items.{i}"))
                             for i, x in enumerate(node["items"])]  # fmt: skip
        for k in _SUB_LIST:
            if isinstance(node.get(k), list):
                node[k] = [self.walk(x, _join(where, f"{k}.{i}")) for i, x in enumerate(node[k])]
        for k in _SUB_MAP:
            if isinstance(node.get(k), dict):
                node[k] = {n: self.walk(v, _join(where, f"{k}.{n}")) for n, v in node[k].items()}
        self.check_numbers(node, where)
        if _types(node) == ["string"]:
            self.fix_string(node, where)
        return node

    def any_of(self, kept: dict, branches: list, where: str) -> dict:
        """anyOf of the walked branches; a branch that matches no value is dropped."""
        out, why = [], None
        for i, b in enumerate(branches):
            try:
                out.append(self.walk(b, _join(where, f"anyOf.{i}")))
            except Unsatisfiable as e:
                why = e
        if not out:
            raise why or unsatisfiable(where, "anyOf has no branch")
        for k in _DEFS & set(kept):
            if isinstance(kept[k], dict):
                kept[k] = {n: self.walk(v, _join(where, f"{k}.{n}")) for n, v in kept[k].items()}
        return {**kept, "anyOf": out}

    # ---- allOf ----------------------------------------------------------------------------
    def _deref(self, branch: Any, where: str) -> Any:
        seen: set[str] = set()
        while isinstance(branch, dict) and "$ref" in branch:
            ref = branch["$ref"]
            target = _resolve(self.root, ref)
            if target is None or ref in seen or not isinstance(target, (dict, bool)):
                raise unsupported(where, f"allOf with the $ref {ref!r}")
            seen.add(ref)
            rest = {k: v for k, v in branch.items() if k != "$ref"}
            branch = target if not rest else {"allOf": [target, rest]}
            if isinstance(branch, dict) and "allOf" in branch:
                branch = self.merge_all_of(branch, where)
        return branch

    def merge_all_of(self, node: dict, where: str) -> dict:
        parent = {k: v for k, v in node.items() if k != "allOf"}
        branches = [parent]
        for i, b in enumerate(node["allOf"]):
            b = self._deref(b, _join(where, f"allOf.{i}"))
            if b is False:
                raise unsatisfiable(where, f"allOf.{i} is false")
            if b is True or not isinstance(b, dict):
                continue
            if "allOf" in b:
                b = self.merge_all_of(b, _join(where, f"allOf.{i}"))
            branches.append(b)
        real = [b for b in branches if set(b) - _ANNOTATIONS]
        self._check_context(real, where)
        out: dict = {}
        for b in branches:
            for k, v in b.items():
                self._merge_key(out, k, v, where)
        return out

    @staticmethod
    def _check_context(branches: list[dict], where: str) -> None:
        """Keywords whose meaning depends on their siblings cannot be merged across branches."""
        if len(branches) < 2:
            return
        for b in branches:
            if any(k in b for k in ("additionalProperties", "unevaluatedProperties")):
                own = set(b.get("properties", {})) | set(b.get("patternProperties", {}))
                for o in branches:
                    more = set(o.get("properties", {})) | set(o.get("patternProperties", {}))
                    if o is not b and more - own:
                        raise unsupported(
                            where, "allOf mixing additionalProperties with other properties"
                        )
        if any("prefixItems" in b for b in branches) and sum("items" in b for b in branches):
            raise unsupported(where, "allOf mixing prefixItems and items")

    @staticmethod
    def _merge_key(out: dict, k: str, v: Any, where: str) -> None:
        if k not in out or out[k] == v:
            out[k] = v
        elif k in _ANNOTATIONS:
            pass
        elif k == "type":
            a, b = out[k], v
            a, b = ([a] if isinstance(a, str) else a), ([b] if isinstance(b, str) else b)
            both = [t for t in a if t in b]
            both += ["integer" for x, y in ((a, b), (b, a)) if "integer" in x and "number" in y]
            if not both:
                raise unsatisfiable(where, f"allOf types {a} and {b} have no value in common")
            out[k] = sorted(set(both)) if len(set(both)) > 1 else both[0]
        elif k == "required":
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k in ("properties", "patternProperties", "$defs", "definitions"):
            merged = dict(out[k])
            for name, s in v.items():
                merged[name] = s if name not in merged else {"allOf": [merged[name], s]}
            out[k] = merged
        elif k in _LOWER and all(isinstance(x, (int, float)) for x in (out[k], v)):
            out[k] = max(out[k], v)
        elif k in _UPPER and all(isinstance(x, (int, float)) for x in (out[k], v)):
            out[k] = min(out[k], v)
        elif k == "const":
            raise unsatisfiable(where, f"allOf consts {out[k]!r} and {v!r} differ")
        elif k == "enum" and isinstance(v, list):
            out[k] = [x for x in out[k] if x in v]
        else:
            raise unsupported(where, f"allOf with conflicting {k!r}")

    # ---- oneOf ----------------------------------------------------------------------------
    def _kinds(self, b: Any) -> set[str] | None:
        """The JSON types a branch's values can have (None: any)."""
        if isinstance(b, dict) and "$ref" in b:
            b = _resolve(self.root, b["$ref"])
        if not isinstance(b, dict):
            return None if b is not False else set()
        if "const" in b or "enum" in b:
            vals = [b["const"]] if "const" in b else b["enum"]
            return {_value_type(x) for x in vals}
        t = _types(b)
        if t is None:
            return None
        return {"number" if x == "integer" else x for x in t}

    def _tags(self, b: Any) -> dict[str, set[str]]:
        """required property -> its JSON-encoded constant values (a discriminator)."""
        if isinstance(b, dict) and "$ref" in b:
            b = _resolve(self.root, b["$ref"])
        if not isinstance(b, dict):
            return {}
        out = {}
        for name in b.get("required", []):
            p = b.get("properties", {}).get(name)
            if isinstance(p, dict) and "$ref" in p:
                p = _resolve(self.root, p["$ref"])
            if isinstance(p, dict) and ("const" in p or "enum" in p):
                vals = [p["const"]] if "const" in p else p["enum"]
                out[name] = {json.dumps(x, sort_keys=True) for x in vals}
        return out

    def check_disjoint(self, branches: list, where: str) -> None:
        for i in range(len(branches)):
            for j in range(i + 1, len(branches)):
                a, b = self._kinds(branches[i]), self._kinds(branches[j])
                if a is not None and b is not None and not (a & b):
                    continue
                ta, tb = self._tags(branches[i]), self._tags(branches[j])
                if any(ta[k].isdisjoint(tb[k]) for k in ta.keys() & tb.keys()):
                    continue
                raise unsupported(
                    where, f"oneOf whose branches {i} and {j} may overlap (use anyOf)"
                )

    # ---- values, types, numbers, strings --------------------------------------------------
    def filter_values(self, node: dict, where: str) -> dict:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import _WrappedReferencingError

        values = [node["const"]] if "const" in node else list(node["enum"])
        rest = {k: v for k, v in node.items() if k not in ("const", "enum")}
        if "const" in node and "enum" in node:
            rest["enum"] = node["enum"]
        for k in ("$defs", "definitions"):
            if k in self.root and k not in rest:
                rest[k] = self.root[k]
        try:
            check = Draft202012Validator(rest)
            kept = [v for v in values if check.is_valid(v)]
        except (_WrappedReferencingError, RecursionError):
            kept = values  # refs it cannot follow: leave the values to the grammar
        if not kept:
            raise unsatisfiable(where, "none of its enum / const values fits its other keywords")
        out = {k: v for k, v in node.items() if k in _ANNOTATIONS}
        out["enum"] = kept
        return out

    @staticmethod
    def split_types(node: dict) -> dict | None:
        """A schema of several types with type-specific keywords -> anyOf one per type."""
        types = _types(node)
        families = {f for f, keys in _FAMILIES.items() if keys & set(node)}
        if not families or (types is not None and len(types) < 2):
            return None
        types = types or _ALL_TYPES
        specific = set().union(*_FAMILIES.values())
        general = {k: v for k, v in node.items() if k != "type" and k not in specific}
        branches = []
        for t in types:
            fam = _FAMILIES.get(_FAMILY_OF.get(t) or "", set())
            branch = {"type": t, **{k: v for k, v in node.items() if k in fam}}
            branches.append(branch)
        if "anyOf" in general:  # keep the client's anyOf beside the type split
            return {"allOf": [{"anyOf": branches}, general]}
        return {**general, "anyOf": branches}

    @staticmethod
    def check_numbers(node: dict, where: str) -> None:
        m = node.get("multipleOf")
        if m is None:
            return
        if _types(node) != ["integer"] or isinstance(m, bool) or not isinstance(m, int):
            raise unsupported(where, "'multipleOf' (only an integer on integers)")

    @staticmethod
    def fix_string(node: dict, where: str) -> None:
        bounded = "minLength" in node or "maxLength" in node
        pattern = node.get("pattern")
        if bounded and ("pattern" in node or "format" in node):
            raise unsupported(where, "'minLength' / 'maxLength' together with pattern or format")
        if isinstance(pattern, str) and "\\\\" in pattern:
            raise unsupported(where, "a pattern that matches a backslash")
        if not bounded or any(k in node for k in ("enum", "const")):
            return
        lo, hi = node.pop("minLength", 0), node.pop("maxLength", None)
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            node["pattern"] = f"^{STRING_BODY}{{{lo},{'' if hi is None else hi}}}$"
        else:  # not integers: leave it to the compiler to reject
            node["minLength"], node["maxLength"] = lo, hi


def _value_type(x: Any) -> str:
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, (int, float)):
        return "number"
    if isinstance(x, str):
        return "string"
    if x is None:
        return "null"
    return "array" if isinstance(x, list) else "object"


# ---- productivity ------------------------------------------------------------------------------
class _Budget(Exception):
    pass


def _productive(node: Any, root: Any, stack: frozenset, steps: list[int]) -> bool:
    """Whether some finite JSON value matches `node` (refs on `stack` count as none)."""
    steps[0] += 1
    if steps[0] > _PRODUCTIVE_BUDGET:
        raise _Budget()
    if node is False:
        return False
    if not isinstance(node, dict):
        return True

    def prod(sub: Any, extra: frozenset = frozenset()) -> bool:
        return _productive(sub, root, stack | extra, steps)

    ref = node.get("$ref")
    if ref is not None:
        if ref in stack:
            return False
        target = _resolve(root, ref)
        if target is not None and not prod(target, frozenset([ref])):
            return False
    if "enum" in node and not node["enum"]:
        return False
    if "anyOf" in node and not any(prod(b) for b in node["anyOf"]):
        return False
    if "allOf" in node and not all(prod(b) for b in node["allOf"]):
        return False
    types = _types(node)
    if types == ["object"]:
        props = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        for name in node.get("required", []):
            if not prod(props.get(name, extra)):
                return False
    if types == ["array"]:
        need = node.get("minItems", 0)
        prefix = node.get("prefixItems", [])
        if isinstance(need, int) and isinstance(prefix, list):
            if not all(prod(p) for p in prefix[:need]):
                return False
            if need > len(prefix) and not prod(node.get("items", True)):
                return False
    return True


def check_productive(schema: Any) -> None:
    try:
        ok = _productive(schema, schema, frozenset(), [0])
    except (_Budget, RecursionError):
        return  # too big to decide here: the first-token check still applies
    if not ok:
        raise unsatisfiable(
            "", "a $ref cycle with no base case, or a required part that matches nothing"
        )


def prepare_json_schema(schema: Any) -> Any:
    """`schema` made exact for xgrammar (see the module docstring); ValueError if it cannot be."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        return schema
    root = copy.deepcopy(schema)
    try:
        out = _Prepare(root).walk(root, "")
    except RecursionError:
        raise ValueError("invalid JSON schema: nested too deeply") from None
    check_productive(out)
    return out
