"""Chat template rendering: expected strings are written by hand from spec §5.2/§5.3."""

import pytest

from k2serve.tokenizer.chat_template import (
    ChatTemplateError,
    normalize_tool_call_ids,
    render_chat_template,
)

SYS = (
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>"
)
GEN = "<|im_assistant|>assistant<|im_middle|>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def render(messages, **kw):
    return render_chat_template(None, messages, **kw)


def test_single_user_thinking_on_and_off():
    # Unsloth's K2.5 example, byte for byte.
    assert render([{"role": "user", "content": "What is 1+1?"}]) == (
        SYS + "<|im_user|>user<|im_middle|>What is 1+1?<|im_end|>" + GEN + "<think>"
    )
    off = render(
        [{"role": "user", "content": "What is 1+1?"}], chat_template_kwargs={"thinking": False}
    )
    assert off.endswith("What is 1+1?<|im_end|>" + GEN + "<think></think>")
    no_gen = render([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_gen == SYS + "<|im_user|>user<|im_middle|>x<|im_end|>"


def test_own_system_prompt_and_names():
    out = render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "bob"},
        ],
        add_generation_prompt=False,
    )
    assert out == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>bob<|im_middle|>Hi<|im_end|>"
    )


def test_tools_history_and_current_loop():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "old thought"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "need the tool",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.get_weather:0",
            "name": "get_weather",
            "content": "Sunny, 21C",
        },
    ]
    out = render(messages, tools=[WEATHER_TOOL])
    assert out == (
        "<|im_system|>tool_declare<|im_middle|>"
        '[{"type":"function","function":{"name":"get_weather","description":"Weather of a city",'
        '"parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]<|im_end|>'
        + SYS
        + "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        # history (up to the last assistant without tool calls): reasoning dropped
        + "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        + "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        # current agentic loop: reasoning kept
        + "<|im_assistant|>assistant<|im_middle|><think>need the tool</think>Let me check."
        + "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        + '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        + "<|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
        + "Sunny, 21C<|im_end|>"
        + GEN
        + "<think>"
    )
    # thinking off: the current loop's assistant gets an empty thought too
    off = render(messages, tools=[WEATHER_TOOL], chat_template_kwargs={"thinking": False})
    assert "need the tool" not in off
    assert off.count("<think></think>") == 3  # two assistants + generation prompt


def test_dict_arguments_and_list_content():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "functions.f:0", "function": {"name": "f", "arguments": {"x": "é"}}}
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "functions.f:0",
            "content": [{"type": "text", "text": "r"}],
        },
    ]
    out = render(messages, add_generation_prompt=False)
    assert out == (
        SYS
        + "<|im_user|>user<|im_middle|>ab<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>"
        + "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        + '<|tool_call_argument_begin|>{"x": "é"}'
        + "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>tool<|im_middle|>## Return of functions.f:0\nr<|im_end|>"
    )


def test_bad_ids_renamed_consistently():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call00003", "function": {"name": "search", "arguments": "{}"}},
                {"id": "search:0", "function": {"name": "search", "arguments": "{}"}},
                {"id": "functions.fetch:1", "function": {"name": "fetch", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "search:0", "content": "B"},
        {"role": "tool", "tool_call_id": "call00003", "content": "A"},
        {"role": "tool", "tool_call_id": "functions.fetch:1", "content": "C"},
    ]
    before = [dict(m) for m in messages]
    fixed = normalize_tool_call_ids(messages)
    assert messages == before  # caller's list untouched
    ids = [tc["id"] for tc in fixed[1]["tool_calls"]]
    # index = position among all calls; functions.fetch:1 is already well formed
    assert ids == ["functions.search:0", "functions.search:1", "functions.fetch:1"]
    assert [m["tool_call_id"] for m in fixed[2:]] == [
        "functions.search:1",
        "functions.search:0",
        "functions.fetch:1",
    ]
    out = render(messages)
    assert "call00003" not in out and "search:0<" not in out.replace("functions.search:0<", "")
    assert "## Return of functions.search:1\nB" in out


def test_renamed_id_avoids_collision():
    messages = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": ""}}],
        },
        {"role": "assistant", "tool_calls": [{"id": "functions.f:0", "function": {"name": "f"}}]},
    ]
    fixed = normalize_tool_call_ids(messages)
    assert [m["tool_calls"][0]["id"] for m in fixed] == ["functions.f:1", "functions.f:0"]


def test_checkpoint_template_features():
    # what real templates use: tojson kwargs, loop controls, raise_exception, trim_blocks
    tpl = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if loop.index > 2 %}{% break %}{% endif %}\n{% endfor %}"
        "{{ tools | tojson(separators=(',', ':'), ensure_ascii=True) }}"
        "{% if thinking is defined and not thinking %}"
        "{{ raise_exception('no thinking') }}{% endif %}"
    )
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert render_chat_template(tpl, msgs, tools=[{"n": "é"}]) == 'ab[{"n":"\\u00e9"}]'
    with pytest.raises(ChatTemplateError, match="no thinking"):
        render_chat_template(tpl, msgs, chat_template_kwargs={"thinking": False})


def test_sandbox_and_errors():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ ''.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.append(1) }}", [])
    with pytest.raises(ChatTemplateError, match="syntax"):
        render_chat_template("{% if %}", [])
    with pytest.raises(ChatTemplateError, match="role"):
        render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="list"):
        render("hello")
    with pytest.raises(ChatTemplateError, match="may not set"):
        render([], chat_template_kwargs={"messages": []})


def test_tokenizer_uses_builtin_and_encodes_markers(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_system|>")
    assert ids[-1] == tok.token_to_id("<think>")
    assert tok.decode(ids) == text
