"""POST /v1/responses (the OpenAI Responses API) on top of the chat path, and GET / DELETE
/v1/responses/{id}.

Owns: the Response object (output items `reasoning`, `message` with `output_text`,
`function_call` with `call_id`; status; usage) and the `response.*` streaming events as OpenAI
documents them, each with a `sequence_number`:
`response.created`, `response.in_progress`, then per item `response.output_item.added`,
(`response.content_part.added`, `response.output_text.delta`... / `response.reasoning_text.delta`
..., `*.done`, `response.content_part.done`) or (`response.function_call_arguments.delta`...,
`.done`), `response.output_item.done`, and last `response.completed` (or `response.incomplete`
when max_output_tokens cut the output). Request translation and the store: `responses_input`.

Invariants:
- The prompt, tool_choice constraints, sampling and parsing are the chat path's
  (`ChatHandler._prepare`, `parsers`), so both endpoints behave the same for one conversation.
- A call's `call_id` is the model's own id (`functions.NAME:IDX`), so a tool result sent back
  with it renders in the dialect the model was trained on.
- Every engine request started here is closed when the handler ends, however it ends.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.requests import Request

from k2serve.parsers import StreamingOutputParser, parse_output
from k2serve.parsers.markers import THINK_END
from k2serve.server.access_log import request_usage
from k2serve.server.auth import OWNER_SCOPE_KEY
from k2serve.server.chat import ChatHandler, may_stream_arguments
from k2serve.server.errors import APIError, stream_error
from k2serve.server.finite import dumps_utf8
from k2serve.server.images import image_refs, load_images
from k2serve.server.responses_input import (
    ResponsesRequest,
    ResponseStore,
    not_found,
    to_chat_request,
)
from k2serve.server.serving import EngineStream, ServerState
from k2serve.server.sse import SSEResponse, cancel_on_disconnect
from k2serve.server.structured import check_compiles

logger = logging.getLogger(__name__)


# chat request fields -> the Responses fields they came from (for error messages)
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": item_id or _id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": content,
        "encrypted_content": None,
        "status": status,
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "id": item_id or _id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)] if text or status == "completed" else [],
    }


def function_call_item(call_id: str, name: str, arguments: str, status="completed", item_id=None):
    return {
        "id": item_id or _id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesHandler:
    def __init__(self, state: ServerState, chat: ChatHandler, store: ResponseStore | None = None):
        self.state = state
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    # -- GET / DELETE -------------------------------------------------------------------------
    def get(self, response_id: str, owner: str | None = None) -> dict:
        got = self.store.get(response_id, owner)
        if got is None:
            raise not_found(response_id)
        return got[0]

    def delete(self, response_id: str, owner: str | None = None) -> dict:
        if not self.store.delete(response_id, owner):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # -- POST ---------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, raw: Request):
        st = self.state
        st.check_model(req.model)
        history: list[dict] = []
        if req.previous_response_id is not None:
            got = self.store.get(req.previous_response_id, raw.scope.get(OWNER_SCOPE_KEY))
            if got is None:
                raise not_found(req.previous_response_id, param="previous_response_id")
            history = got[1]
        chat_req, conversation = to_chat_request(req, history)
        try:
            images = await load_images(st, image_refs(chat_req.messages))
            prompt_ids, params, thinking, tools, mm = await st.cpu.run(
                self.chat._prepare, chat_req, images
            )
            await check_compiles(st, params)  # a bad text.format schema: 400 naming it
        except APIError as e:  # name the Responses field, not the chat one
            e.param = _PARAMS.get(e.param or "", e.param)
            m = re.match(r"messages\.(\d+)\.(.*)", e.param or "")
            if m:  # a part of the input: its index there (after history and instructions)
                k = int(m.group(1)) - len(history) - (1 if req.instructions else 0)
                e.param = f"input.{k}.{m.group(2)}"
            e.message = e.message.replace("the messages", "the input")
            raise
        rid = _id("resp")
        stream = EngineStream(st, prompt_ids, params, rid, request_usage(raw.scope), mm_inputs=mm)
        await cancel_on_disconnect(raw, stop=st.stop_event, work=stream.start())
        run = _Run(self, req, stream, thinking, tools, conversation)
        run.owner = raw.scope.get(OWNER_SCOPE_KEY)
        if req.stream:
            return SSEResponse(run.events(), st.stop_event)
        try:
            return await cancel_on_disconnect(raw, stop=st.stop_event, work=run.full())
        finally:
            await stream.close()


class _Run:
    """One response being generated: its skeleton, its items, usage and the store."""

    def __init__(self, h: ResponsesHandler, req: ResponsesRequest, stream: EngineStream,
                 thinking: bool, tools, conversation: list[dict]):  # fmt: skip
        self.h, self.req, self.stream = h, req, stream
        self.thinking, self.tools, self.conversation = thinking, tools, conversation
        self.created = int(time.time())
        self.owner: str | None = None  # the API key that made it (see ResponseStore)
        self.ids: list[int] = []
        tok = h.state.tokenizer
        self.think_end = tok.token_to_id(THINK_END) if thinking else None

    def response(self, status: str, output: list[dict], finish: str | None = None) -> dict:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if finish == "length" else "interrupted"}
        return {
            "id": self.stream.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.h.state.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": fmt},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": self.usage() if status != "in_progress" else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def usage(self) -> dict:
        prompt = len(self.stream.prompt_ids)
        out = len(self.ids)
        reasoning = 0
        if self.think_end is not None:
            reasoning = self.ids.index(self.think_end) if self.think_end in self.ids else out
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.stream.num_cached_tokens},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + out,
        }

    def finish(self, output: list[dict], finish: str | None, calls, reasoning, content) -> dict:
        status = "incomplete" if finish in ("length", None, "abort") else "completed"
        resp = self.response(status, output, finish)
        if self.req.store:
            turn: dict = {"role": "assistant", "content": content or ""}
            if reasoning:
                turn["reasoning_content"] = reasoning
            if calls:
                turn["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]  # fmt: skip
            self.h.store.put(resp, [*self.conversation, turn], self.owner)
        return resp

    # -- whole ---------------------------------------------------------------------------------
    async def full(self) -> dict:
        text, finish = "", None
        async for out in self.stream:
            for c in out.outputs:
                text += c.text
                self.ids.extend(c.token_ids)
                if c.finish_reason is not None:
                    finish = c.finish_reason
        parsed = parse_output(
            text, thinking=self.thinking, tools=self.tools, truncated=finish == "length"
        )
        calls = list(parsed.tool_calls) if self.tools else []
        if calls and not self.req.parallel_tool_calls:
            calls = calls[:1]
        output = []
        if parsed.reasoning_content:
            output.append(reasoning_item(parsed.reasoning_content))
        if parsed.content or not calls:
            output.append(message_item(parsed.content or ""))
        output += [function_call_item(c.id, c.name, c.arguments) for c in calls]
        return self.finish(output, finish, calls, parsed.reasoning_content, parsed.content)

    # -- streamed ------------------------------------------------------------------------------
    async def events(self):
        ev = _Events()
        try:
            yield ev.emit("response.created", response=self.response("in_progress", []))
            yield ev.emit("response.in_progress", response=self.response("in_progress", []))
            items = _Items(ev, self.req.parallel_tool_calls)
            parser = StreamingOutputParser(
                thinking=self.thinking, tools=self.tools, stream_arguments=True
            )
            max_tokens = getattr(self.stream.params, "max_tokens", None)
            finish = None
            reasoning, content = [], []
            async for out in self.stream:
                for c in out.outputs:
                    self.ids.extend(c.token_ids)
                    parser.stream_arguments = may_stream_arguments(max_tokens, len(self.ids))
                    deltas = [parser.feed(c.text)] if c.text else []
                    if c.finish_reason is not None:
                        finish = c.finish_reason
                        deltas.append(parser.finish(truncated=finish == "length"))
                    for d in deltas:
                        reasoning.append(d.reasoning_content or "")
                        content.append(d.content or "")
                        for e in items.delta(d, parser.tool_calls if self.tools else None):
                            yield e
            for e in items.close_all(parser.tool_calls if self.tools else []):
                yield e
            calls = list(parser.tool_calls)
            if not self.tools:
                calls = []
            elif not self.req.parallel_tool_calls:
                calls = calls[:1]
            resp = self.finish(
                items.output, finish, calls, "".join(reasoning) or None, "".join(content) or None
            )
            kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
            yield ev.emit(kind, response=resp)
        except Exception as e:
            logger.exception("responses stream %s failed", self.stream.request_id)
            err = stream_error(e)
            yield ev.emit("error", code=err.code, message=err.message, param=err.param)
        finally:
            await self.stream.close()


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def emit(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = dumps_utf8(body)
        return f"event: {kind}\ndata: {data}\n\n"


class _Items:
    """The output items of a streamed response, opened in the order their text arrives."""

    def __init__(self, ev: _Events, parallel: bool):
        self.ev = ev
        self.parallel = parallel
        self.output: list[dict] = []
        self.text: tuple[str, int, list[str]] | None = None  # (kind, output index, pieces)
        self.calls: dict[int, tuple[int, list[str]]] = {}  # parser index -> (output index, args)
        self.closed: set[int] = set()

    def _open_text(self, kind: str):
        if self.text is not None and self.text[0] == kind:
            return
        yield from self._close_text()
        idx = len(self.output)
        if kind == "reasoning":
            item = reasoning_item("", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item("", "in_progress")
            part = output_text("")
        self.output.append(item)
        self.text = (kind, idx, [])
        yield self.ev.emit("response.output_item.added", output_index=idx, item=item)
        yield self.ev.emit("response.content_part.added", item_id=item["id"], output_index=idx,
                           content_index=0, part=part)  # fmt: skip

    def _close_text(self):
        if self.text is None:
            return
        kind, idx, pieces = self.text
        self.text = None
        item, text = self.output[idx], "".join(pieces)
        common = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        if kind == "reasoning":
            done = reasoning_item(text, item_id=item["id"])
            part = {"type": "reasoning_text", "text": text}
            yield self.ev.emit("response.reasoning_text.done", **common, text=text)
        else:
            done = message_item(text, item_id=item["id"])
            part = output_text(text)
            yield self.ev.emit("response.output_text.done", **common, text=text, logprobs=[])
        yield self.ev.emit("response.content_part.done", **common, part=part)
        self.output[idx] = done
        yield self.ev.emit("response.output_item.done", output_index=idx, item=done)

    def _text_delta(self, kind: str, text: str):
        """`text` appended to the open reasoning / message item (opened if needed)."""
        yield from self._open_text(kind)
        assert self.text is not None  # _open_text opened it
        _, idx, pieces = self.text
        pieces.append(text)
        extra: dict[str, list] = {}
        if kind == "reasoning":
            event = "response.reasoning_text.delta"
        else:
            event, extra = "response.output_text.delta", {"logprobs": []}
        yield self.ev.emit(event, item_id=self.output[idx]["id"], output_index=idx,
                           content_index=0, delta=text, **extra)  # fmt: skip

    def delta(self, d, complete_calls):
        if d.reasoning_content:
            yield from self._text_delta("reasoning", d.reasoning_content)
        if d.content:
            yield from self._text_delta("message", d.content)
        if complete_calls is None:
            return
        for tc in d.tool_calls:
            if tc.index > 0 and not self.parallel:
                continue
            if tc.index not in self.calls:
                yield from self._close_text()
                idx = len(self.output)
                item = function_call_item(tc.id, tc.name, "", "in_progress")
                self.output.append(item)
                self.calls[tc.index] = (idx, [])
                yield self.ev.emit("response.output_item.added", output_index=idx, item=item)
            idx, args = self.calls[tc.index]
            if tc.arguments:
                args.append(tc.arguments)
                yield self.ev.emit("response.function_call_arguments.delta",
                                   item_id=self.output[idx]["id"], output_index=idx,
                                   delta=tc.arguments)  # fmt: skip
        yield from self._close_calls(complete_calls)

    def _close_calls(self, complete_calls, cut: bool = False):
        for k, (idx, args) in sorted(self.calls.items()):
            if k in self.closed:
                continue
            if k < len(complete_calls):
                call, status = complete_calls[k], "completed"
                arguments, name, call_id = call.arguments, call.name, call.id
            elif cut:
                item = self.output[idx]
                status, arguments = "incomplete", "".join(args)
                name, call_id = item["name"], item["call_id"]
            else:
                continue
            self.closed.add(k)
            item = self.output[idx]
            done = function_call_item(call_id, name, arguments, status, item_id=item["id"])
            self.output[idx] = done
            yield self.ev.emit("response.function_call_arguments.done", item_id=item["id"],
                               output_index=idx, name=name, arguments=arguments)  # fmt: skip
            yield self.ev.emit("response.output_item.done", output_index=idx, item=done)

    def close_all(self, complete_calls):
        yield from self._close_text()
        yield from self._close_calls(complete_calls, cut=True)
        if not self.calls and not any(it["type"] == "message" for it in self.output):
            # no answer text and no call: an empty message, as the non-streamed response has
            yield from self._open_text("message")
            yield from self._close_text()
