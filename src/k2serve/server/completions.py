"""POST /v1/completions: text or token-id prompts (single or batch) -> OpenAI completions.

Owns: prompt normalisation (text is encoded, token ids are range-checked), echo, logprobs in the
completions format, choice numbering (`prompt_index * n + sample_index`, as vLLM).

Invariants:
- Every prompt of a batch is checked (context, token ids) before any is sent to the engine, so a
  bad batch starts nothing.
- Echoed prompt tokens carry `null` logprobs (the engine computes no prompt logprobs yet).
"""

from __future__ import annotations

import logging
import time

from starlette.requests import Request

from k2serve.server.access_log import request_usage
from k2serve.server.errors import bad_request, stream_error
from k2serve.server.protocol import CompletionRequest
from k2serve.server.serving import (
    EngineStream,
    MergedStreams,
    ServerState,
    completion_logprobs,
    new_request_id,
    nonfinite_warner,
)
from k2serve.server.sse import SSE_DONE, SSEResponse, cancel_on_disconnect, sse_event
from k2serve.server.structured import check_compiles, output_constraint

logger = logging.getLogger(__name__)


class CompletionHandler:
    def __init__(self, state: ServerState):
        self.state = state

    def _prompts(self, req: CompletionRequest) -> list[tuple[str, list[int]]]:
        tok = self.state.tokenizer
        vocab = tok.vocab_size
        out = []
        for i, p in enumerate(req.prompts()):
            if isinstance(p, str):
                ids = tok.encode(p, allow_special=True)
                if not ids:
                    raise bad_request(f"prompt[{i}] is empty", param="prompt")
                out.append((p, ids))
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise bad_request(
                        f"prompt[{i}] has token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                        param="prompt",
                    )
                out.append((tok.decode(p), list(p)))
        return out

    async def create(self, req: CompletionRequest, raw: Request):
        st = self.state
        st.check_model(req.model)
        prompts = await st.cpu.run(self._prompts, req)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        constraint = output_constraint(req, thinking=False)  # a raw prompt: no reasoning
        so = constraint[0] if constraint is not None else None
        plans = []
        for _text, ids in prompts:
            mt = st.resolve_max_tokens(len(ids), max_tokens, "prompt")
            plans.append(st.sampling_params(req, mt, logprobs=req.logprobs, structured_outputs=so))
        if plans:
            await check_compiles(st, plans[0])
        base = new_request_id("cmpl")
        streams = [
            EngineStream(st, ids, params, f"{base}-{i}", request_usage(raw.scope))
            for i, ((_t, ids), params) in enumerate(zip(prompts, plans, strict=True))
        ]
        merged = MergedStreams(streams)
        try:
            for s in streams:
                await cancel_on_disconnect(raw, stop=self.state.stop_event, work=s.start())
        except BaseException:
            await merged.aclose()
            raise
        if req.stream:
            return SSEResponse(self._stream(req, prompts, merged, base), self.state.stop_event)
        try:
            return await cancel_on_disconnect(
                raw, stop=self.state.stop_event, work=self._full(req, prompts, merged, base)
            )
        finally:
            await merged.aclose()

    async def _full(self, req, prompts, merged: MergedStreams, base: str) -> dict:
        n = req.n
        total = len(prompts) * n
        texts = [""] * total
        ids: list[list[int]] = [[] for _ in range(total)]
        lps: list[list] = [[] for _ in range(total)]
        finish: list = [None] * total
        stop_reason: list = [None] * total
        async for p, out in merged:
            for c in out.outputs:
                k = p * n + c.index
                texts[k] += c.text
                ids[k].extend(c.token_ids)
                if c.logprobs:
                    lps[k].extend(c.logprobs)
                if c.finish_reason is not None:
                    finish[k], stop_reason[k] = c.finish_reason, c.stop_reason
        tok = self.state.tokenizer
        warn = nonfinite_warner(base)
        choices = []
        for k in range(total):
            p = k // n
            text = (prompts[p][0] if req.echo else "") + texts[k]
            logprobs: dict | None = None
            if req.logprobs is not None:
                logprobs, off = (
                    {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
                    0,
                )
                if req.echo:
                    part, off = completion_logprobs(tok, prompts[p][1], None, 0, off)
                    _extend(logprobs, part)
                part, off = completion_logprobs(tok, ids[k], lps[k], req.logprobs, off, warn)
                _extend(logprobs, part)
            choices.append(
                {
                    "index": k,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish[k] or "abort",
                    "stop_reason": stop_reason[k],
                }
            )
        prompt_tokens = sum(len(ids_) for _t, ids_ in prompts)
        completion = sum(len(x) for x in ids)
        cached = sum(s.num_cached_tokens for s in merged.streams)
        return {
            "id": base,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.state.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }

    async def _stream(self, req, prompts, merged: MergedStreams, base: str):
        st = self.state
        tok = st.tokenizer
        n = req.n
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        total = len(prompts) * n
        offsets = [0] * total
        counts = [0] * total
        echoed = [not req.echo] * total
        warn = nonfinite_warner(base)

        def chunk(k: int, text: str, logprobs=None, finish=None, stop_reason=None) -> str:
            choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            body = {
                "id": base,
                "object": "text_completion",
                "created": created,
                "model": st.model_name,
                "choices": [choice],
            }
            if include_usage:
                body["usage"] = None
            return sse_event(body)

        try:
            async for p, out in merged:
                for c in out.outputs:
                    k = p * n + c.index
                    counts[k] += len(c.token_ids)
                    text = c.text
                    lp: dict | None = None
                    if req.logprobs is not None:
                        lp = {
                            "tokens": [],
                            "token_logprobs": [],
                            "top_logprobs": [],
                            "text_offset": [],
                        }
                    if not echoed[k]:
                        echoed[k] = True
                        text = prompts[p][0] + text
                        if lp is not None:
                            part, offsets[k] = completion_logprobs(
                                tok, prompts[p][1], None, 0, offsets[k]
                            )
                            _extend(lp, part)
                    if lp is not None:
                        part, offsets[k] = completion_logprobs(
                            tok, c.token_ids, c.logprobs, req.logprobs, offsets[k], warn
                        )
                        _extend(lp, part)
                    if text or c.finish_reason is not None or lp:
                        yield chunk(k, text, lp, c.finish_reason, c.stop_reason)
            if include_usage:
                prompt_tokens = sum(len(ids_) for _t, ids_ in prompts)
                completion = sum(counts)
                yield sse_event(
                    {
                        "id": base,
                        "object": "text_completion",
                        "created": created,
                        "model": st.model_name,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion,
                            "total_tokens": prompt_tokens + completion,
                        },
                    }
                )
            yield SSE_DONE
        except Exception as e:
            logger.exception("completion stream %s failed", base)
            err = stream_error(e)
            yield sse_event(err.body())
            yield SSE_DONE
        finally:
            await merged.aclose()


def _extend(dst: dict, part: dict) -> None:
    for key, vals in part.items():
        dst[key].extend(vals)
