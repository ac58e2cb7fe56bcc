"""The grammar module on the demo tokenizer: vocabulary, compile errors, the per-sequence state
(thinking gate, rollback, rebuild), the Kimi tool-call section, and the sampler's mask."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("xgrammar")

from k2serve.engine.request import Request, RequestStatus  # noqa: E402
from k2serve.engine.sampler import Sampler  # noqa: E402
from k2serve.engine.sampling_params import SamplingParams  # noqa: E402
from k2serve.structured import StructuredOutputsParams as P  # noqa: E402
from k2serve.structured.backend import (  # noqa: E402
    GrammarBackend,
    fix_string_lengths,
    token_bytes,
)
from k2serve.structured.kimi import tool_call_constraint  # noqa: E402
from k2serve.structured.state import GrammarState  # noqa: E402

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 10}},
            "required": ["text"],
        },
    },
}


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
    return GrammarBackend(tok, tok.vocab_size + 64, eos)  # a padded lm_head


def _state(backend, p):
    return GrammarState(backend, backend.compile(p), p)


def _feed(tok, g, text, extra=()):
    out = tok.encode(text, allow_special=True) + list(extra)
    g.sync(out)
    return out


def _allowed(backend, g) -> set[int]:
    bm = backend.allocate_bitmask(1)
    backend.fill_bitmask([g.matcher], bm, [0])
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_bitmask(logits, bm, [0])
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_vocab_bytes(tok):
    nb = tok.num_base_tokens
    plain = token_bytes(tok, tok.vocab_size + 8, markers=False)
    tagged = token_bytes(tok, tok.vocab_size + 8, markers=True)
    assert len(plain) == tok.vocab_size + 8
    assert plain[:nb] == [tok.id_to_bytes(i) for i in range(nb)]
    assert all(b == b"" for b in plain[nb:])
    begin = tok.token_to_id("<|tool_call_begin|>")
    assert tagged[begin] == b"<|tool_call_begin|>" and plain[begin] == b""
    assert tagged[tok.eos_token_id] == b""  # never text, only a stop token


@pytest.mark.parametrize(
    "p,needle",
    [
        (dict(json={"type": "objectx"}), "invalid JSON schema: Unsupported type"),
        (dict(json={"$ref": "#/$defs/nope"}), "invalid JSON schema"),
        (dict(json=False), "matches no value"),
        (dict(json="{bad"), "not valid JSON"),
        (dict(regex="[a-"), "invalid regex"),
        (dict(grammar="root ::= missing"), "invalid grammar"),
        (dict(choice=[]), "non-empty list"),
        (dict(regex="a", choice=["b"]), "exactly one"),
        (dict(), "exactly one"),
        (dict(structural_tag={"no": "format"}), "format"),
    ],
)
def test_bad_constraints_raise_value_error(backend, p, needle):
    with pytest.raises(ValueError, match=needle) as ei:
        backend.compile(P(**p))
    assert "/project/" not in str(ei.value)  # no C++ source location


def test_compile_cache_ignores_key_order(backend):
    a = backend.compile(P(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = backend.compile(P(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b


def test_json_schema_state_accepts_valid_and_terminates(tok, eos, backend):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    g = _state(backend, P(json=schema))
    assert g.active
    out = _feed(tok, g, '{"n": 12}')
    assert not g.failed and g.active and not g.terminated
    assert set(eos) <= _allowed(backend, g)
    g.sync(out + [eos[0]])
    assert g.terminated and g.finished and not g.active
    bad = _state(backend, P(json=schema))
    _feed(tok, bad, '{"m": 1}')
    assert bad.failed and bad.finished


def test_mask_allows_only_grammar_tokens_and_never_padding(tok, backend):
    g = _state(backend, P(choice=["yes", "no"]))
    allowed = _allowed(backend, g)
    assert allowed and all(i < tok.num_base_tokens for i in allowed)
    assert all(tok.decode([i]) in ("y", "ye", "yes", "n", "no") for i in allowed)


def test_length_bounded_strings_reject_control_characters(tok, backend):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}
    fixed = fix_string_lengths(schema)
    assert "maxLength" not in fixed["properties"]["s"] and "pattern" in fixed["properties"]["s"]
    g = _state(backend, P(json=schema))
    _feed(tok, g, '{"s": "ab\x0b')
    assert g.failed
    g = _state(backend, P(json=schema))
    _feed(tok, g, '{"s": "abcdef')
    assert g.failed
    g = _state(backend, P(json=schema))
    _feed(tok, g, '{"s": "abcde"}')
    assert not g.failed


def test_thinking_gate_rollback_and_rebuild(tok, eos, backend):
    g = _state(backend, P(json_object=True, after_reasoning=True))
    _feed(tok, g, "I think { not json")
    assert g.start is None and not g.active and not g.failed  # reasoning is free
    out = _feed(tok, g, 'I think</think>{"a": 1')
    assert g.start is not None and g.active and not g.failed
    n = g.num_accepted
    g.sync(out[:-2])  # the output got shorter: roll back
    assert g.num_accepted == n - 2 and not g.failed
    g.sync(tok.encode("I thi"))  # shorter than the start: rebuilt from scratch
    assert g.start is None and g.num_accepted == 0
    _feed(tok, g, 'I think</think>{"b": [true]}', [eos[1]])
    assert g.terminated


def _tool_text(name, args, idx=0):
    return (
        f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{idx}"
        f"<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )


def test_tool_call_named_and_required(tok, eos, backend):
    named = tool_call_constraint([ADD, NOTE], "named", name="add", thinking=True)
    g = _state(backend, named)
    _feed(tok, g, "hmm</think>" + _tool_text("add", {"a": 1, "b": 2}), [eos[1]])
    assert g.terminated and not g.failed
    g = _state(backend, named)
    _feed(tok, g, "</think>" + _tool_text("note", {"text": "x"}))
    assert g.failed  # another tool
    g = _state(backend, named)
    _feed(tok, g, "</think>" + _tool_text("add", {"a": 1}))
    assert g.failed  # a required key missing
    g = _state(backend, named)
    _feed(tok, g, "</think>" + _tool_text("add", {"a": 1, "b": 2, "c": 3}))
    assert g.failed  # additionalProperties false
    # the section opened while reasoning starts the constraint there
    g = _state(backend, named)
    _feed(tok, g, "hmm" + _tool_text("add", {"a": 1, "b": 2}), [eos[0]])
    assert g.terminated and not g.failed
    # the markers are tokens: the same text spelled in plain tokens is refused
    g = _state(backend, tool_call_constraint([ADD], "required"))
    g.sync(tok.encode("<|tool_calls_section_begin|>", allow_special=False))
    assert g.failed
    # required: any tool, several calls in one section when parallel
    req = tool_call_constraint([ADD, NOTE], "required")
    two = _tool_text("add", {"a": 1, "b": 2}).replace(
        "<|tool_calls_section_end|>",
        _tool_text("note", {"text": "hi"}, 1).replace("<|tool_calls_section_begin|>", ""),
    )
    g = _state(backend, req)
    _feed(tok, g, two, [eos[0]])
    assert g.terminated and not g.failed
    g = _state(backend, tool_call_constraint([ADD, NOTE], "required", parallel=False))
    _feed(tok, g, two)
    assert g.failed


def test_tool_call_arguments_exclude_marker_text(tok, backend):
    g = _state(backend, tool_call_constraint([NOTE], "named", name="note"))
    _feed(tok, g, _tool_text("note", {"text": "<|tool_call_end|>"}))
    assert g.failed


def test_strict_auto_is_free_until_a_section_opens(tok, eos, backend):
    p = tool_call_constraint([ADD, NOTE], "auto", thinking=True)
    assert not p.after_reasoning  # the trigger works anywhere
    g = _state(backend, p)
    _feed(tok, g, "<think>plan</think>Just text.", [eos[0]])
    assert g.terminated and not g.failed
    g = _state(backend, p)
    _feed(tok, g, "Sure. " + _tool_text("note", {"text": "hi"}), [eos[0]])
    assert g.terminated and not g.failed
    g = _state(backend, p)
    _feed(tok, g, "Sure. " + _tool_text("note", {"text": 5}))
    assert g.failed  # strict: the schema holds
    g = _state(backend, p)
    _feed(tok, g, "Sure. " + _tool_text("add", {"anything": "goes"}))
    assert not g.failed  # not strict: any JSON object


def _req(rid, params, backend, prompt=(1, 2, 3)):
    r = Request(rid, list(prompt), params, eos_token_ids=frozenset([1793]), max_tokens=50)
    so = params.structured_outputs
    if so is not None:
        r.grammar = GrammarState(backend, backend.compile(so), so)
    return r


def test_sampler_masks_constrained_rows_only(tok, backend):
    vocab = backend.vocab_size
    sampler = Sampler("cpu", seed=0)
    cons = SamplingParams(temperature=1.0, structured_outputs=P(choice=["yes", "no"]))
    free = SamplingParams(temperature=1.0)
    reqs = [_req("a", cons, backend), _req("b", free, backend), _req("c", cons, backend)]
    allowed = _allowed(backend, reqs[0].grammar)
    logits = torch.zeros(3, vocab)
    disallowed = next(i for i in range(tok.num_base_tokens) if i not in allowed)
    logits[:, disallowed] = 100.0  # the model wants a token the grammar forbids
    out = sampler(logits, reqs)
    assert out.token_ids[0] in allowed and out.token_ids[2] in allowed
    assert out.token_ids[1] == disallowed


def test_sampler_grammar_wins_over_min_tokens_and_request_stops(tok, eos, backend):
    sampler = Sampler("cpu", seed=0)
    p = SamplingParams(
        temperature=0.0, min_tokens=10, max_tokens=50, structured_outputs=P(choice=["yes"])
    )
    r = _req("a", p, backend)
    r.eos_token_ids = frozenset(eos)
    for _ in range(6):
        tokid = sampler(torch.zeros(1, backend.vocab_size), [r]).token_ids[0]
        r.append_output_token(tokid)
        if r.check_stop_token():
            break
    assert tok.decode(r.output_token_ids, skip_special_tokens=True) == "yes"
    assert r.status == RequestStatus.FINISHED_STOPPED and r.grammar.terminated


@pytest.fixture(scope="module")
def small_engine():
    from k2serve.demo import demo_path
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    # 6 pages of 16 tokens for 6 sequences that each need 2 or more: preemption is certain
    cfg = EngineConfig(
        model=str(demo_path()),
        device="cpu",
        max_model_len=96,
        num_kv_pages=6,
        page_size=16,
        max_num_seqs=6,
        enable_prefix_caching=False,
    )
    return LLMEngine(cfg)


def _drain(engine) -> dict[str, dict]:
    got: dict[str, dict] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                d = got.setdefault(f"{out.request_id}#{c.index}", {"text": "", "reason": None})
                d["text"] += c.text
                d["reason"] = c.finish_reason or d["reason"]
    return got


def test_preemption_and_abort_keep_grammars_right(small_engine):
    jsonschema = pytest.importorskip("jsonschema")
    eng = small_engine
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    tok = eng.tokenizer
    close = tok.encode('"') + tok.encode("}")
    from k2serve.engine.logits_processors import LogitBias

    before = eng.get_stats().num_preemptions
    for i in range(3):
        p = SamplingParams(
            n=2,
            temperature=1.0,
            seed=i,
            max_tokens=80,
            logits_processors=[LogitBias({t: 4.0 for t in close})],
            structured_outputs=P(json=schema),
        )
        eng.add_request(f"r{i}", tok.encode(f"Tell me thing {i}"), p)
    got = _drain(eng)
    assert eng.get_stats().num_preemptions > before  # some sequences were recomputed
    assert len(got) == 6
    for d in got.values():
        assert d["reason"] == "stop", d
        jsonschema.validate(json.loads(d["text"]), schema)
    eng.check_integrity()
    # abort mid-way: the matcher goes with the request, nothing is left behind
    eng.add_request(
        "gone",
        tok.encode("x"),
        SamplingParams(max_tokens=60, structured_outputs=P(json_object=True)),
    )
    eng.step()
    eng.step()
    eng.abort_request("gone")
    got = _drain(eng)
    assert got["gone#0"]["reason"] == "abort"
    eng.check_integrity()
    assert not eng._requests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_mask_on_cuda_matches_cpu(tok, backend):
    # the bitmask goes to the GPU from pinned memory and xgrammar's kernel applies it
    cons = SamplingParams(temperature=1.0, structured_outputs=P(choice=["yes", "no"]))
    free = SamplingParams(temperature=1.0)
    reqs = [_req("a", cons, backend), _req("b", free, backend), _req("c", cons, backend)]
    allowed = _allowed(backend, reqs[0].grammar)
    disallowed = next(i for i in range(tok.num_base_tokens) if i not in allowed)
    sampler = Sampler("cuda", seed=0)
    for _ in range(5):
        logits = torch.zeros(3, backend.vocab_size, device="cuda")
        logits[:, disallowed] = 100.0
        out = sampler(logits, reqs)
        assert out.token_ids[0] in allowed and out.token_ids[2] in allowed
        assert out.token_ids[1] == disallowed
    assert sampler._bitmask.is_pinned()


@pytest.mark.parametrize("form", ["vllm", "xgrammar"])
def test_structural_tag_forms(tok, eos, backend, form):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    if form == "vllm":
        tag = {
            "structures": [{"begin": "<fn=add>", "schema": schema, "end": "</fn>"}],
            "triggers": ["<fn="],
        }
    else:
        tag = {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<fn="],
                "tags": [
                    {
                        "begin": "<fn=add>",
                        "content": {"type": "json_schema", "json_schema": schema},
                        "end": "</fn>",
                    }
                ],
            },
        }
    g = _state(backend, P(structural_tag=tag))
    _feed(tok, g, 'free text <fn=add>{"a": 1}</fn> more', [eos[0]])
    assert g.terminated and not g.failed
    g = _state(backend, P(structural_tag=tag))
    _feed(tok, g, 'free text <fn=add>{"b": 1}')
    assert g.failed


def test_sync_is_a_function_of_the_output(tok, eos, backend):
    # any sequence of output lengths (growing, rolled back, cut before the start) leaves the
    # matcher where a fresh one fed the same output would be
    from hypothesis import given, settings
    from hypothesis import strategies as st

    p = P(json={"type": "object", "properties": {"k": {"type": "array"}}}, after_reasoning=True)
    compiled = backend.compile(p)
    out = tok.encode('I think.</think>{"k": [1, "two", {"x": null}]}', allow_special=True)
    out = out + [eos[0]]

    def view(g):
        mask = _allowed(backend, g) if g.active else None
        return g.start, g.num_accepted, g.failed, g.terminated, mask

    @settings(max_examples=30, deadline=None)
    @given(st.lists(st.integers(0, len(out)), min_size=1, max_size=8))
    def check(lengths):
        g = GrammarState(backend, compiled, p)
        for n in lengths:
            g.sync(out[:n])
            fresh = GrammarState(backend, compiled, p)
            fresh.sync(out[:n])
            assert view(g) == view(fresh), n

    check()
