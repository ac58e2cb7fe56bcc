"""OpenAI wire format: pydantic request and response models for the k2serve server.

Owns: what a request may contain (with the limits checked before anything reaches the engine)
and the shape of every response body. Field names and defaults follow the OpenAI API, with the
vLLM extras (top_k, min_p, repetition_penalty, chat_template_kwargs, ...) where they mean the same.

Invariants:
- Requests ignore unknown fields (OpenAI clients send new ones all the time) but keep them in
  `model_extra` so handlers can log them.
- A value outside its documented range fails validation; the app turns that into a 400 whose
  `param` names the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictInt,
    model_validator,
)

# Request scalars are strict, as OpenAI's API: `max_tokens: "10"`, `n: "2"`, `stream: "yes"` or
# `stream: 1` are a 400, not silently coerced; a float field takes an integer (1 == 1.0).
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]


def check_json_schema(schema: Any) -> None:
    """ValueError unless `schema` is a valid JSON Schema (draft 2020-12 meta-schema)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(
            f"not a valid JSON Schema{f' at {where!r}' if where else ''}: {e.message}"
        ) from None
    except RecursionError:
        raise ValueError("not a valid JSON Schema: nested too deeply") from None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Out):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------
# Shared request fields


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class _SamplingFields(_Request):
    """The sampling fields shared by chat and completions (OpenAI + vLLM extras)."""

    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    n: Int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    # > 0 as vLLM, and bounded: 1e-300 divides logits into inf / NaN (1 = off, >2 is extreme)
    repetition_penalty: Float | None = Field(default=None, ge=0.01, le=100.0)
    min_tokens: Int = Field(default=0, ge=0)
    ignore_eos: Bool = False
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    # k2serve extra: false opts this request out of --speculative-config drafting (same output)
    speculative_decoding: Bool = True
    # vLLM structured outputs (read by server/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------------------------
# Chat completions


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None

    # NOTE: `parameters` is checked against the JSON Schema meta-schema by the handler, off the
    # event loop and once per distinct schema (`check_tool_schemas`), not here: pydantic runs on
    # the event loop, and 40k tools took it 27 s.


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallParam(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessageParam(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class JsonSchemaSpec(_Request):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    type: str = "text"
    json_schema: JsonSchemaSpec | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # vLLM extra: at most this many reasoning tokens, then `</think>` (0 = no reasoning)
    thinking_token_budget: Int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, "
                    f"which is not in tools ({', '.join(names)})"
                )
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class FunctionCallOut(_Out):
    name: str
    arguments: str


class ToolCallOut(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(_Out):
    cached_tokens: int = 0


class Usage(_Out):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(_Out):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class DeltaMessageOut(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: DeltaMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------------------------
# Completions


class CompletionRequest(_SamplingFields):
    # strict: `false` / `1.0` are not token ids. Left to right, token ids first: pydantic's
    # smart mode would validate a long id list against list[str] too (seconds for 3M ids).
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        union_mode="left_to_right"
    )
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: Int | None = None
    response_format: ResponseFormat | None = None  # vLLM allows json_object / json_schema here

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        p = self.prompt
        if isinstance(p, list) and not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p, list) and any(isinstance(x, list) and not x for x in p):
            raise ValueError("prompt must not contain an empty token list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each entry is a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if not isinstance(x, int)]


class CompletionLogprobs(_Out):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Out):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------------------------
# Models


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "k2serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------------------------
# Tokenizer endpoints (vLLM's /tokenize and /detokenize)


class TokenizeRequest(_Request):
    """Either `prompt` (text, tokenized as is) or `messages` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1)
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = True  # accepted as vLLM; Kimi's tokenizer adds none

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        return self


class TokenizeResponse(_Out):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Out):
    prompt: str
