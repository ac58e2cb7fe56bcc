"""POST /v1/chat/completions: messages -> Kimi prompt -> engine -> OpenAI chat response or SSE.

Owns: message normalisation for the chat template, tool_choice handling, reasoning / tool-call
parsing of the output (whole and streaming), logprobs and usage in the chat format.

Invariants:
- Tool calls are parsed only when tools are given and tool_choice is not "none"; otherwise the
  model is prevented from opening a tool-call section, so no raw markers reach `content`.
- finish_reason is "tool_calls" when a choice ends normally having produced tool calls.
- Every engine request started here is closed when the handler ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.requests import Request

from k2serve.engine.logits_processors import BanTokens, ForceToolCallPrefix
from k2serve.engine.reasoning_budget import ThinkingBudget
from k2serve.parsers import StreamingOutputParser, parse_output
from k2serve.parsers.markers import CALL_BEGIN, SECTION_BEGIN
from k2serve.server.access_log import request_usage
from k2serve.server.errors import APIError, bad_request, stream_error
from k2serve.server.images import image_refs, load_images, process_images, template_content
from k2serve.server.protocol import ChatCompletionRequest, NamedToolChoice
from k2serve.server.serving import (
    EngineStream,
    MergedStreams,
    ServerState,
    chat_logprobs,
    new_request_id,
    nonfinite_warner,
)
from k2serve.server.sse import SSE_DONE, SSEResponse, cancel_on_disconnect, sse_event
from k2serve.server.structured import check_compiles, output_constraint, tool_constraint
from k2serve.server.tool_checks import (
    ToolSchemaError,
    check_forced_tool_names,
    check_tool_schemas,
)
from k2serve.tokenizer.safe import guard_for, render_and_encode

logger = logging.getLogger(__name__)


def render_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as plain dicts for the chat template (reasoning under `reasoning_content`)."""
    out = []
    image_refs(req.messages)  # a 400 for a part that is neither text nor an image
    for i, m in enumerate(req.messages):
        d: dict = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = template_content(m.content, i) or ""
        if m.name is not None:
            d["name"] = m.name
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                d["reasoning_content"] = reasoning
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": tc.id or f"functions.{tc.function.name}:{k}",
                        "type": "function",
                        "function": {
                            "name": tc.function.name,
                            "arguments": tc.function.arguments
                            if isinstance(tc.function.arguments, str)
                            else json.dumps(tc.function.arguments, ensure_ascii=False),
                        },
                    }
                    for k, tc in enumerate(m.tool_calls)
                ]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(
                    f"messages[{i}] has role 'tool' but no tool_call_id",
                    param=f"messages.{i}.tool_call_id",
                )
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render_prompt(st: ServerState, req, add_generation_prompt: bool = True) -> tuple[str, bool]:
    """(prompt text, thinking) for a request with `messages`, `tools`, `chat_template_kwargs`.

    NOTE: to get token ids use `encode_prompt`: encoding this text with specials allowed would
    turn special-token strings the client wrote into control tokens."""
    text, _ids, thinking = encode_prompt(st, req, add_generation_prompt)
    return text, thinking


def encode_prompt(
    st: ServerState, req, add_generation_prompt: bool = True
) -> tuple[str, list[int], bool]:
    """(prompt text, prompt ids, thinking) for a chat request.

    Everything the client sent (contents, names, tools, tool-call history, reasoning, kwargs) is
    encoded as text; only the template's own markers become special tokens, unless the server
    runs with --allow-special-tokens-in-chat (then the rendered text is encoded as vLLM does)."""
    kwargs = {**st.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", st.default_thinking)))
    kwargs.setdefault("thinking", thinking)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    tok = st.tokenizer

    def render(messages, tools, kwargs) -> str:
        return tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=kwargs,
        )

    messages = render_messages(req)
    if not st.allow_special_in_chat:
        guard_for(tok)  # a tokenizer without `special_tokens` is the server's fault, not a 400
    try:
        if st.allow_special_in_chat:
            text = render(messages, tools, kwargs)
            ids = tok.encode(text, allow_special=True)
        else:
            template = getattr(tok, "chat_template", None)
            text, ids = render_and_encode(
                tok, render, messages, tools, kwargs, trusted=[template or ""]
            )
    except APIError:
        raise
    except Exception as e:  # template errors are the request's fault (bad message order...)
        raise bad_request(
            f"the messages cannot be rendered with the chat template: {e}", param="messages"
        ) from None
    return text, ids, thinking


class ChatHandler:
    def __init__(self, state: ServerState):
        self.state = state

    # ---------------------------------------------------------------------------------------
    def _prepare(self, req: ChatCompletionRequest, images: list | None = None):
        """(prompt ids, params, thinking, tools, image inputs); `images`: the request's
        decoded images (server.images.load_images), preprocessed and expanded here."""
        st = self.state
        st.check_model(req.model)
        tool_choice = req.tool_choice or ("auto" if req.tools else "none")
        try:  # here, in the CPU pool: not on the event loop, each distinct schema once
            check_tool_schemas(req.tools)
            if req.tools and tool_choice == "required":
                check_forced_tool_names(req.tools, [t.function.name for t in req.tools])
            elif isinstance(tool_choice, NamedToolChoice):
                check_forced_tool_names(req.tools, [tool_choice.function.name])
        except ToolSchemaError as e:
            raise bad_request(str(e), param=e.param) from None
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        use_tools = bool(tools) and tool_choice != "none"
        _text, prompt_ids, thinking = encode_prompt(st, req)
        prompt_ids, mm_inputs = process_images(st, prompt_ids, images or [])
        max_tokens = st.resolve_max_tokens(len(prompt_ids), req.effective_max_tokens(), "messages")

        procs: list[Any] = []
        constraint = output_constraint(req, thinking)  # (params, field) or None
        forced = tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
        forced = forced and use_tools
        if forced and constraint is not None:
            raise bad_request(
                f"{constraint[1]} cannot be combined with a forced tool_choice", param=constraint[1]
            )
        if tools and use_tools and constraint is None:
            so = tool_constraint(tools, tool_choice, req.parallel_tool_calls, thinking)
            constraint = (so, "tools") if so is not None else None
        # tool_choice required / named: the grammar constrains the whole section; the prefix
        # processor also makes the call open with the canonical tokens of its prefix
        if tools and use_tools and tool_choice == "required":
            names = [t["function"]["name"] for t in tools]
            procs.append(ForceToolCallPrefix(st.tokenizer, names, thinking))
        elif use_tools and isinstance(tool_choice, NamedToolChoice):
            procs.append(ForceToolCallPrefix(st.tokenizer, [tool_choice.function.name], thinking))
        elif not use_tools:
            # the parser opens a call at either marker, so the model may emit neither
            ban = [st.tokenizer.token_to_id(m) for m in (SECTION_BEGIN, CALL_BEGIN)]
            if any(t is not None for t in ban):
                procs.append(BanTokens([t for t in ban if t is not None]))
        budget = getattr(req, "thinking_token_budget", None)
        if thinking and budget is not None:
            procs.insert(0, ThinkingBudget(st.tokenizer, budget))
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        params = st.sampling_params(
            req,
            max_tokens,
            logprobs=logprobs,
            logits_processors=procs,
            structured_outputs=constraint[0] if constraint is not None else None,
        )
        return prompt_ids, params, thinking, (tools if use_tools else None), mm_inputs

    async def create(self, req: ChatCompletionRequest, raw: Request):
        images = await load_images(self.state, image_refs(req.messages))
        prompt_ids, params, thinking, tools, mm = await self.state.cpu.run(
            self._prepare, req, images
        )
        await check_compiles(self.state, params)
        stream = EngineStream(
            self.state,
            prompt_ids,
            params,
            new_request_id("chatcmpl"),
            request_usage(raw.scope),
            mm_inputs=mm,
        )
        await cancel_on_disconnect(raw, stop=self.state.stop_event, work=stream.start())
        if req.stream:
            return SSEResponse(self._stream(req, stream, thinking, tools), self.state.stop_event)
        try:
            return await cancel_on_disconnect(
                raw, stop=self.state.stop_event, work=self._full(req, stream, thinking, tools)
            )
        finally:
            await stream.close()

    # ---------------------------------------------------------------------------------------
    async def _full(self, req, stream: EngineStream, thinking: bool, tools) -> dict:
        n = req.n
        texts = [""] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list] = [[] for _ in range(n)]
        finish: list = [None] * n
        stop_reason: list = [None] * n
        warn = nonfinite_warner(stream.request_id)
        async for out in stream:
            for c in out.outputs:
                texts[c.index] += c.text
                ids[c.index].extend(c.token_ids)
                if c.logprobs:
                    lps[c.index].extend(c.logprobs)
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
                    stop_reason[c.index] = c.stop_reason
        choices = []
        for i in range(n):
            parsed = parse_output(
                texts[i], thinking=thinking, tools=tools, truncated=finish[i] == "length"
            )
            calls = list(parsed.tool_calls) if tools else []
            if calls and not req.parallel_tool_calls:
                calls = calls[:1]
            reason = finish[i] or "abort"
            if calls and reason == "stop":
                reason = "tool_calls"
            content = parsed.content
            if content is None and not calls:
                content = ""
            choice = {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": parsed.reasoning_content,
                    "reasoning": parsed.reasoning_content,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in calls
                    ],
                },
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": stop_reason[i],
            }
            if req.logprobs:
                choice["logprobs"] = {
                    "content": chat_logprobs(
                        self.state.tokenizer, ids[i], lps[i], req.top_logprobs or 0, warn
                    )
                }
            choices.append(choice)
        completion = sum(len(x) for x in ids)
        return {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.state.model_name,
            "choices": choices,
            "usage": _usage(len(stream.prompt_ids), completion, stream.num_cached_tokens),
        }

    # ---------------------------------------------------------------------------------------
    async def _stream(self, req, stream: EngineStream, thinking: bool, tools):
        st = self.state
        n = req.n
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        parsers = [
            StreamingOutputParser(thinking=thinking, tools=tools, stream_arguments=True)
            for _ in range(n)
        ]
        max_tokens = getattr(stream.params, "max_tokens", None)
        num_calls = [0] * n
        counts = [0] * n
        merged = MergedStreams([stream])
        warn = nonfinite_warner(stream.request_id)

        def chunk(index: int, delta: dict, finish=None, logprobs=None, stop_reason=None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            body = {
                "id": stream.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": st.model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = (
                    _usage(len(stream.prompt_ids), sum(counts), stream.num_cached_tokens)
                    if continuous
                    else None
                )
            return sse_event(body)

        def delta_dict(msg, i: int) -> dict:
            d: dict = {}
            if msg.reasoning_content:
                d["reasoning_content"] = msg.reasoning_content
                d["reasoning"] = msg.reasoning_content
            if msg.content:
                d["content"] = msg.content
            calls = [
                tool_call_delta(tc)
                for tc in (msg.tool_calls if tools else ())  # no tools: never report calls
                if tc.index == 0 or req.parallel_tool_calls
            ]
            num_calls[i] += sum(1 for c in calls if "id" in c)
            if calls:
                d["tool_calls"] = calls
            return d

        try:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for _, out in merged:
                for c in out.outputs:
                    i = c.index
                    counts[i] += len(c.token_ids)
                    parsers[i].stream_arguments = may_stream_arguments(max_tokens, counts[i])
                    d = delta_dict(parsers[i].feed(c.text), i) if c.text else {}
                    lp = None
                    if req.logprobs and c.logprobs:
                        lp = {
                            "content": chat_logprobs(
                                st.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0, warn
                            )
                        }
                    if c.finish_reason is not None:
                        tail = delta_dict(
                            parsers[i].finish(truncated=c.finish_reason == "length"), i
                        )
                        for k, v in tail.items():
                            d[k] = d[k] + v if k in d else v  # str or list
                        reason = c.finish_reason
                        if num_calls[i] and reason == "stop":
                            reason = "tool_calls"
                        yield chunk(i, d, reason, lp, c.stop_reason)
                    elif d or lp:
                        yield chunk(i, d, None, lp)
            if include_usage:
                yield sse_event(
                    {
                        "id": stream.request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": st.model_name,
                        "choices": [],
                        "usage": _usage(
                            len(stream.prompt_ids), sum(counts), stream.num_cached_tokens
                        ),
                    }
                )
            yield SSE_DONE
        except Exception as e:
            logger.exception("chat stream %s failed", stream.request_id)
            err = stream_error(e)
            yield sse_event(err.body())
            yield SSE_DONE
        finally:
            await merged.aclose()


# A tool call's arguments stream fragment by fragment only while at least this many tokens are
# left before max_tokens when the call opens; nearer the limit a call is held back and sent
# whole once complete, so a call that max_tokens cuts is not shown. NOTE: a call that opens with
# more tokens left but is longer than them is still cut mid-stream: its fragments were sent and
# the choice ends with finish_reason "length" (as vLLM). Full hold-back is the parser's
# stream_arguments=False.
ARGUMENT_STREAM_RESERVE = 256


def may_stream_arguments(max_tokens: int | None, generated: int) -> bool:
    return max_tokens is None or max_tokens - generated >= ARGUMENT_STREAM_RESERVE


def tool_call_delta(tc) -> dict:
    """A parser ToolCallDelta in the chat chunk format (vLLM's: id, type and name first)."""
    fn: dict = {}
    if tc.name is not None:
        fn["name"] = tc.name
    fn["arguments"] = tc.arguments or ""
    d: dict = {"index": tc.index}
    if tc.id is not None:
        d["id"] = tc.id
        d["type"] = "function"
    d["function"] = fn
    return d


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
