"""Chat template rendering for Kimi checkpoints.

Owns: `render_chat_template(template, messages, tools, add_generation_prompt,
chat_template_kwargs)`, the sandboxed jinja2 environment, the built-in K2-Thinking-equivalent
template (`kimi_k2_thinking.jinja`, used when a checkpoint has none) and the renaming of history
tool-call ids to `functions.NAME:IDX`.

Invariants:
- Templates run in an `ImmutableSandboxedEnvironment` (trim_blocks, lstrip_blocks, loop
  controls) with HF-compatible `tojson(ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)`, `raise_exception` and `strftime_now`, as transformers renders them.
- The caller's messages are never mutated.
- Tool-call ids that are not `functions.NAME:IDX` are renamed (Moonshot's K2-Vendor-Verifier
  advice) in the assistant call and in the tool results that answer it; well-formed ids are kept,
  and new ids never collide with ids already present.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import re
from importlib import resources
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOOL_CALL_ID_RE = re.compile(r"^functions\.[^:\s<]+:\d+$")
BUILTIN_TEMPLATE_NAME = "kimi_k2_thinking.jinja"


class ChatTemplateError(ValueError):
    """Messages or a template that cannot be rendered; the message says why."""


def builtin_chat_template() -> str:
    """The built-in K2-Thinking-equivalent template (K2.5 `thinking` switch)."""
    return resources.files("k2serve.tokenizer").joinpath(BUILTIN_TEMPLATE_NAME).read_text("utf-8")


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Same signature and behaviour as transformers' chat-template tojson (no HTML escaping).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error line {e.lineno}: {e.message}") from e


def _call_name(tc: dict[str, Any]) -> str:
    fn = tc.get("function") or {}
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else "unknown"


def normalize_tool_call_ids(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of `messages` whose history tool-call ids all read `functions.NAME:IDX`.

    IDX is the call's position among all tool calls of the conversation (bumped past any id
    already present). Tool results follow the id of the latest assistant call they answer."""
    messages = copy.deepcopy(messages)
    taken = {
        tc.get("id")
        for m in messages
        if m.get("role") == "assistant"
        for tc in (m.get("tool_calls") or [])
        if isinstance(tc, dict)
    }
    mapping: dict[str, str] = {}
    counter = 0
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            for tc in m["tool_calls"]:
                if not isinstance(tc, dict):
                    raise ChatTemplateError("each tool_calls entry must be an object")
                old = tc.get("id")
                if not (isinstance(old, str) and TOOL_CALL_ID_RE.match(old)):
                    name = _call_name(tc)
                    idx = counter
                    while f"functions.{name}:{idx}" in taken:
                        idx += 1
                    new = f"functions.{name}:{idx}"
                    taken.add(new)
                    tc["id"] = new
                    if isinstance(old, str):
                        mapping[old] = new
                else:
                    mapping.pop(old, None)
                counter += 1
        elif m.get("role") == "tool":
            old = m.get("tool_call_id")
            if isinstance(old, str) and old in mapping:
                m["tool_call_id"] = mapping[old]
    return messages


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] has no 'role'")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of parts")


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    special_tokens: dict[str, str] | None = None,
) -> str:
    """Render `messages` with `template` (None: the built-in one)."""
    _check_messages(messages)
    if tools is not None and not isinstance(tools, list):
        raise ChatTemplateError(f"tools must be a list, got {type(tools).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"messages", "tools", "add_generation_prompt"} & kwargs.keys()
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
    tpl = compile_template(template if template is not None else builtin_chat_template())
    context = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        **(special_tokens or {}),
        **kwargs,
        "messages": normalize_tool_call_ids(messages),
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return tpl.render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (KeyError, TypeError, AttributeError) as e:
        raise ChatTemplateError(f"chat template could not render these messages: {e!r}") from e
