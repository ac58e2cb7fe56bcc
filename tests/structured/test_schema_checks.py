"""Issue #31 (C, D, H, I): a constraint the engine cannot honour is refused before generation,
never answered with output that violates it; with thinking on a pending constraint holds.

On the demo tokenizer; each case compiles a small grammar (ms), the sampler runs on tiny logits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from k2serve.engine.request import Request, RequestStatus  # noqa: E402
from k2serve.engine.sampler import Sampler  # noqa: E402
from k2serve.engine.sampling_params import SamplingParams  # noqa: E402
from k2serve.structured import StructuredOutputsParams as P  # noqa: E402
from k2serve.structured.backend import GrammarBackend  # noqa: E402
from k2serve.structured.kimi import tool_call_constraint  # noqa: E402
from k2serve.structured.state import GrammarState  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from k2serve.demo import demo_path
    from k2serve.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(demo_path())


@pytest.fixture(scope="module")
def eos(tok):
    return [tok.eos_token_id, tok.token_to_id("<|im_end|>")]


@pytest.fixture(scope="module")
def backend(tok, eos):
    return GrammarBackend(tok, tok.vocab_size, eos)


def _feed(tok, backend, p, text) -> GrammarState:
    g = GrammarState(backend, backend.compile(p), p)
    g.sync(tok.encode(text, allow_special=True))
    return g


# ---- C: constraints that match nothing ----------------------------------------------------------
@pytest.mark.parametrize(
    "p",
    [
        P(json={"$ref": "#"}),
        P(
            json={
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": "#/$defs/a",
            }
        ),  # fmt: skip
        P(
            json={
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/x"}},
                "required": ["a"],
                "$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}},
            }
        ),  # fmt: skip
        P(grammar="root ::= root"),
        P(grammar='root ::= "a" root'),
        P(grammar='root ::= x\nx ::= "(" x ")" | "[" x'),
        P(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        P(json={"type": "string", "enum": [1, 2]}),
        P(json={"type": "integer", "const": "a"}),
    ],
    ids=[
        "ref-root",
        "defs-loop",
        "no-base-case",
        "ebnf-loop",
        "ebnf-endless",
        "ebnf-endless-2",
        "required-self",
        "enum-vs-type",
        "const-vs-type",
    ],  # fmt: skip
)
def test_unsatisfiable_constraints_are_refused(backend, p):
    with pytest.raises(ValueError, match="matches nothing|no value|unsatisfiable"):
        backend.compile(p)


@pytest.mark.parametrize(
    "p",
    [P(grammar='root ::= "a" | "b" root'), P(grammar='root ::= ("a" root)*'),
     P(grammar='root ::= x\nx ::= "(" x ")" | [a-z]+ y?\ny ::= "q"{2,3}'),
     P(regex="[a-z]+@x"), P(choice=["a", "b"]), P(json_object=True),
     P(json={"anyOf": [{"type": "integer"}, {"type": "array", "items": {"$ref": "#"}}]})],
)  # fmt: skip
def test_grammars_that_can_finish_compile(backend, p):
    backend.compile(p)


def test_recursive_schema_with_a_base_case_is_fine(tok, backend):
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"]}  # fmt: skip
    g = _feed(tok, backend, P(json=tree), '{"kids": [{"kids": []}]}')
    assert g.terminated or not g.failed


# ---- D: keywords the grammar would ignore -------------------------------------------------------
@pytest.mark.parametrize(
    "schema, word",
    [
        ({"not": {}}, "not"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength"),
        ({"type": "string", "pattern": "^a\\\\b$"}, "backslash"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        (
            {"allOf": [{"type": "string"}, {"type": "object", "additionalProperties": False}]},
            "allOf",
        ),  # fmt: skip
    ],
)
def test_unsupported_keywords_are_refused_by_name(backend, schema, word):
    with pytest.raises(ValueError, match=word):
        backend.compile(P(json=schema))


def test_conflicting_all_of_is_unsatisfiable(backend):
    with pytest.raises(ValueError, match="matches nothing|no value|unsatisfiable"):
        backend.compile(P(json={"allOf": [{"type": "string"}, {"type": "integer"}]}))


def test_all_of_is_honoured_by_merging(tok, backend):
    both = {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
    ]}  # fmt: skip
    assert _feed(tok, backend, P(json=both), '{"a": 1}').failed  # b is required too
    assert not _feed(tok, backend, P(json=both), '{"a": 1, "b": 2}').failed
    rng = {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}
    assert _feed(tok, backend, P(json=rng), "7").failed
    assert not _feed(tok, backend, P(json=rng), "4").failed


def test_siblings_of_any_of_and_ref_are_honoured(tok, backend):
    # xgrammar takes anyOf / $ref alone; their siblings still apply (fuzzing found '"x"' here)
    p = P(json={"type": "object", "properties": {"a": {"type": "integer"}},
                "anyOf": [{"type": "string"}, {"required": ["a"]}]})  # fmt: skip
    assert _feed(tok, backend, p, '"x"').failed
    assert not _feed(tok, backend, p, '{"a": 1}').failed
    p = P(json={"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2})
    assert _feed(tok, backend, p, '"abc').failed
    with pytest.raises(ValueError, match="not"):  # $defs under an anyOf are checked too
        backend.compile(P(json={"$defs": {"x": {"not": {}}}, "anyOf": [{"$ref": "#/$defs/x"}]}))


def test_disjoint_one_of_is_accepted(tok, backend):
    p = P(json={"oneOf": [{"type": "integer"}, {"type": "string"}]})
    assert not _feed(tok, backend, p, '"x"').failed


def test_enum_is_filtered_by_the_other_keywords(tok, backend):
    p = P(json={"type": "string", "enum": [1, "a", "abc"], "maxLength": 2})
    assert _feed(tok, backend, p, "1").failed
    assert _feed(tok, backend, p, '"abc"').failed
    assert not _feed(tok, backend, p, '"a"').failed


# ---- H: control characters in nullable / union strings ------------------------------------------
@pytest.mark.parametrize("types", [["string", "null"], ["null", "string", "integer"]])
def test_union_typed_strings_keep_control_characters_out(tok, backend, types):
    schema = {"type": types, "maxLength": 5}
    assert _feed(tok, backend, P(json=schema), '"a\x01').failed
    assert _feed(tok, backend, P(json=schema), '"abcdef').failed
    assert not _feed(tok, backend, P(json=schema), '"abc"').failed
    assert not _feed(tok, backend, P(json=schema), "null").failed


# ---- I: with thinking on, the turn cannot end before the constraint is produced -----------------
def _req(tok, eos, backend, p: P) -> Request:
    params = SamplingParams(temperature=1.0, max_tokens=40, structured_outputs=p)
    r = Request("r", [1, 2, 3], params, eos_token_ids=frozenset(eos), max_tokens=40)
    r.grammar = GrammarState(backend, backend.compile(p), p)
    return r


@pytest.mark.parametrize("kind", ["json", "tool"])
def test_pending_constraint_bans_the_end_of_turn_while_reasoning(tok, eos, backend, kind):
    if kind == "json":
        p = P(json={"type": "object"}, after_reasoning=True)
    else:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        p = tool_call_constraint([tool], "required", thinking=True)
    r = _req(tok, eos, backend, p)
    for t in tok.encode("The tool answered."):
        r.append_output_token(t)
    logits = torch.zeros(1, backend.vocab_size)
    logits[0, eos] = 1000.0  # the model wants to end the turn inside its reasoning
    got = Sampler("cpu", seed=0)(logits, [r]).token_ids[0]
    assert got not in eos
    r.append_output_token(eos[1])  # even if it were sampled, it does not end the request
    assert not r.check_stop_token() or r.status != RequestStatus.FINISHED_STOPPED


def test_after_reasoning_closes_the_end_of_turn_follows_the_grammar(tok, eos, backend):
    r = _req(tok, eos, backend, P(json={"type": "integer"}, after_reasoning=True))
    for t in tok.encode("hm</think>1", allow_special=True):
        r.append_output_token(t)
    r.grammar.sync(r.output_token_ids)
    logits = torch.zeros(1, backend.vocab_size)
    logits[0, eos] = 1000.0
    got = Sampler("cpu", seed=0)(logits, [r]).token_ids[0]
    assert got in eos  # the integer is complete: the turn may end


def test_a_rejected_token_ends_the_request_as_abort_not_stop(tok, eos, backend):
    r = _req(tok, eos, backend, P(json={"type": "integer"}))
    r.append_output_token(tok.encode("x")[0])  # a token the grammar rejects
    assert r.check_stop_token() and r.grammar.failed
    assert r.status == RequestStatus.FINISHED_ABORTED
