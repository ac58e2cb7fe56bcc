"""POST /v1/responses, the request side: the request model, input items -> chat messages, the
flat tool format -> chat tools, and the bounded store behind `previous_response_id`.

Owns: how an OpenAI Responses request becomes the `ChatCompletionRequest` that the chat path
renders, constrains and samples (so both endpoints share one prompt, one tool_choice and one
sampling implementation).

Mapping:
- `instructions` -> a system message first (not carried over by `previous_response_id`, as
  OpenAI documents); `input` a string -> one user message.
- items: `message` (roles user/system/developer/assistant; content a string or `input_text` /
  `output_text` / `text` parts), `function_call` (-> an assistant tool call whose id is the
  `call_id`; consecutive calls join one assistant turn), `function_call_output` (-> a tool
  message for `call_id`), `reasoning` (its `reasoning_text` content, else its summary, becomes
  the next assistant turn's `reasoning_content`). `input_image` parts (by URL) become chat
  `image_url` parts (K2.5 models); files and `item_reference` get a 400.
- tools: `{"type": "function", "name", "description", "parameters", "strict"}` (the chat form
  `{"type": "function", "function": {...}}` is accepted too); built-in tools (web search, file
  search, computer use, MCP...) get a 400. `tool_choice` `{"type": "function", "name"}` ->
  the chat named choice.
- `text.format` json_object / json_schema -> the chat `response_format` (the chat path decides
  whether it is supported).

Store: `store` (default true) keeps each response and the conversation that led to it in an
in-memory LRU of `ResponseStore.capacity` (1000) responses; `previous_response_id` continues
from one (404 when unknown or evicted), `GET/DELETE /v1/responses/{id}` read and drop them.
Nothing survives a restart.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from k2serve.server.errors import APIError, _validation_message, bad_request
from k2serve.server.protocol import Bool, ChatCompletionRequest, Float, Int

METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512

# vLLM / sampling extras a Responses request may carry and the chat path understands
_PASSTHROUGH = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "chat_template_kwargs",
    "thinking_token_budget",
    "logit_bias",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "speculative_decoding",
)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    stream: Bool = False
    store: Bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: Bool = False
    truncation: str | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's limits: at most 16 pairs, string keys of at most 64 characters, string
        values of at most 512 (the metadata is kept in the response store)."""
        if v is None:
            return v
        if len(v) > METADATA_MAX_PAIRS:
            raise ValueError(f"metadata has {len(v)} pairs; at most {METADATA_MAX_PAIRS}")
        for key, value in v.items():
            if len(key) > METADATA_MAX_KEY:
                raise ValueError(
                    f"metadata key {key[:16]!r}... is {len(key)} characters long; "
                    f"at most {METADATA_MAX_KEY}"
                )
            if not isinstance(value, str):
                raise ValueError(f"metadata[{key!r}] must be a string")
            if len(value) > METADATA_MAX_VALUE:
                raise ValueError(
                    f"metadata[{key!r}] is {len(value)} characters long; "
                    f"at most {METADATA_MAX_VALUE}"
                )
        return v


class ResponseStore:
    """An LRU of finished responses: id -> (response dict, conversation messages after it)."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict], str | None]] = OrderedDict()

    def put(self, response: dict, messages: list[dict], owner: str | None = None) -> None:
        """`owner`: the API key (its digest) that made the response; only it can read it."""
        item = (copy.deepcopy(response), copy.deepcopy(messages), owner)
        self._items[response["id"]] = item
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, owner: str | None = None) -> tuple[dict, list[dict]] | None:
        item = self._items.get(response_id)
        if item is None or item[2] != owner:  # another key's response: as if it did not exist
            return None
        self._items.move_to_end(response_id)
        return copy.deepcopy(item[0]), copy.deepcopy(item[1])

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        item = self._items.get(response_id)
        if item is None or item[2] != owner:
            return False
        del self._items[response_id]
        return True

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found (responses are kept in memory, at most "
        "1000, and only when created with store=true)",
        param=param,
        code="not_found",
    )


def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
            out.append(str(part.get("text") or ""))
        elif kind == "refusal":
            out.append(str(part.get("refusal") or ""))
        else:
            raise bad_request(
                f"{where}[{j}].type={kind!r} is not supported (text parts only)",
                param=f"{where}.{j}.type",
            )
    return "".join(out)


def _user_content(content: Any, where: str) -> Any:
    """A user / system message's content: text, or chat parts when it holds `input_image`s
    (`{"type": "input_image", "image_url": URL}` -> `{"type": "image_url", ...}`)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_of(content, where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise bad_request(
                    f"{where}[{j}]: input_image needs image_url (file_id is not supported)",
                    param=f"{where}.{j}.image_url",
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}")})
    return parts


def input_messages(items: str | list[dict]) -> list[dict]:
    """The Responses `input` as chat messages (plain dicts, see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    msgs: list[dict] = []
    reasoning: str | None = None

    def assistant() -> dict:
        """The assistant turn that a function_call joins (a new one unless the last is one)."""
        nonlocal reasoning
        last = msgs[-1] if msgs else None
        if last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        m: dict = {"role": "assistant", "content": ""}
        if reasoning is not None:
            m["reasoning_content"] = reasoning
            reasoning = None
        msgs.append(m)
        return m

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role={role!r} must be user, system, developer or assistant",
                    param=f"{where}.role",
                )
            if role != "assistant":
                content = _user_content(item.get("content"), f"{where}.content")
                msgs.append({"role": "system" if role == "developer" else role, "content": content})
                continue
            text = _text_of(item.get("content"), f"{where}.content")
            m = {"role": "assistant", "content": text}
            if reasoning is not None:
                m["reasoning_content"], reasoning = reasoning, None
            msgs.append(m)
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise bad_request(f"{where}: a function_call needs name and call_id", param=where)
            args = item.get("arguments", "")
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}: function_call_output needs call_id", param=where)
            out = item.get("output", "")
            out = out if isinstance(out, str) else _text_of(out, f"{where}.output")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": out})
        elif kind == "reasoning":
            content = item.get("content") or item.get("summary") or []
            reasoning = _text_of(content, f"{where}.content")
        else:
            raise bad_request(
                f"{where}.type={kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                param=f"{where}.type",
            )
    if reasoning is not None:  # a trailing reasoning item: keep it for the next turn
        msgs.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return msgs


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools[{i}].type={kind!r} is not supported (function tools only; built-in "
                "tools such as web or file search are not available on this server)",
                param=f"tools.{i}.type",
            )
        inner = t.get("function")
        fn = inner if isinstance(inner, dict) else t
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: fn[k] for k in keys if k in fn}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        return choice  # the chat form
    raise bad_request(
        f"tool_choice {choice!r} is not supported ('none', 'auto', 'required' or "
        '{"type": "function", "name": ...})',
        param="tool_choice",
    )


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise bad_request("text.format must be an object with a type", param="text.format")
    if fmt["type"] == "json_schema":
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": inner}
    return {k: v for k, v in fmt.items()}


def to_chat_request(
    req: ResponsesRequest, history: list[dict]
) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat request to run, the conversation without instructions, for the store)."""
    if req.background:
        raise bad_request("background responses are not supported", param="background")
    for name in ("conversation", "prompt"):
        if (req.model_extra or {}).get(name) is not None:
            raise bad_request(f"{name} is not supported (use input / previous_response_id)", name)
    conversation = history + input_messages(req.input)
    if not conversation:
        raise bad_request("input must not be empty", param="input")
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": response_format(req.text),
    }
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in _PASSTHROUGH if k in extra})
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as e:
        msg, param = _validation_message(RequestValidationError(e.errors()))
        param = {"max_completion_tokens": "max_output_tokens", "messages": "input"}.get(
            param or "", param
        )
        raise bad_request(
            msg.replace("max_completion_tokens", "max_output_tokens"), param
        ) from None
    return chat, conversation
