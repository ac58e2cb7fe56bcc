"""What chat and completions share: server state, request -> SamplingParams, the context-length
rule, and one engine request driven with metrics and guaranteed cleanup.

Invariants:
- `generate()` wraps `engine.generate`: it primes the first output before the caller commits to
  a response (so bad params, over-long prompts and a full queue become 400 / 429), and however
  the caller stops iterating (finished, error, client gone, cancelled) the engine iterator is
  closed, which aborts the request and frees its pages.
- max_tokens follows vLLM: absent -> what is left of the context; prompt + max_tokens over the
  context -> 400 that gives the numbers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k2serve.engine.contract import EngineClient, resolve_max_tokens
from k2serve.engine.errors import PromptTooLongError
from k2serve.engine.logits_processors import LogitBias
from k2serve.multimodal.media import MediaPolicy
from k2serve.server.errors import APIError, bad_request, engine_error
from k2serve.server.finite import MIN_LOGPROB, finite_logprob
from k2serve.server.metrics import ServerMetrics
from k2serve.server.offload import CpuPool

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: Any
    model_name: str
    served_names: list[str]
    max_model_len: int
    metrics: ServerMetrics
    sampling_params_cls: Callable[..., Any]
    default_thinking: bool = True
    default_chat_template_kwargs: dict = field(default_factory=dict)
    # sampling defaults for fields a request leaves unset (generation_config.json)
    default_sampling: dict = field(default_factory=dict)
    draining: bool = False
    # set when the drain timeout runs out: in-flight requests end with a 503 / an error event
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once started
    background: set = field(default_factory=set)
    # --allow-special-tokens-in-chat: special-token strings in messages become control tokens
    allow_special_in_chat: bool = False
    cpu: CpuPool = field(default_factory=CpuPool)  # tokenizing / rendering off the event loop
    # image URLs: --allowed-local-media-path / --allowed-media-domains (multimodal.media)
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.served_names)}",
                param="model",
                code="model_not_found",
            )

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, what: str) -> int:
        """The engine's rule (`engine.contract.resolve_max_tokens`), its error worded as
        OpenAI / vLLM do."""
        limit = self.max_model_len
        if max_tokens is None:  # generation_config.json's default, capped at what is left
            default = self.default_sampling.get("max_tokens")
            if default:
                max_tokens = max(1, min(default, limit - prompt_len))
        try:
            return resolve_max_tokens(prompt_len, max_tokens, limit)
        except PromptTooLongError:
            pass
        if prompt_len >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_len} input tokens. Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )
        assert max_tokens is not None
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in "
            "the completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )

    def sampling_params(self, req, max_tokens: int, **extra) -> Any:
        kw: dict[str, Any] = dict(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            seed=req.seed,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            ignore_eos=req.ignore_eos,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            speculative_decoding=getattr(req, "speculative_decoding", True),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            val = getattr(req, name)
            if val is None:
                val = self.default_sampling.get(name)
            if val is not None:
                kw[name] = val
        kw.update(extra)
        if req.logit_bias:
            kw["logits_processors"] = [*kw.get("logits_processors", []), self._logit_bias(req)]
        try:
            return self.sampling_params_cls(**kw)
        except ValueError as e:
            param = str(e).split("=", 1)[0] if "=" in str(e).split(" ", 1)[0] else None
            raise bad_request(str(e), param=param) from None

    def _logit_bias(self, req) -> LogitBias:
        vocab = self.tokenizer.vocab_size
        bias: dict[int, float] = {}
        for key, val in req.logit_bias.items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias key {key!r} is not a token id", "logit_bias"
                ) from None
            if not 0 <= tid < vocab:
                raise bad_request(
                    f"logit_bias token id {tid} is outside [0, {vocab})", "logit_bias"
                )
            if not -100 <= val <= 100:
                raise bad_request(f"logit_bias value {val} is outside [-100, 100]", "logit_bias")
            bias[tid] = float(val)
        return LogitBias(bias)

    def spawn(self, coro) -> None:
        """Run a cleanup coroutine outside the current (possibly cancelled) task."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class EngineStream:
    """One engine request: `await start()` (raises APIError), then `async for out in stream`."""

    def __init__(
        self,
        state: ServerState,
        prompt_ids: list[int],
        params,
        request_id: str,
        usage: list[int] | None = None,
        mm_inputs=None,
    ):
        """`usage`: [prompt, completion] token counts of the HTTP request, added to as the
        request runs (for its access-log line). `mm_inputs`: the prompt's images, placed."""
        self.state = state
        self.usage = usage if usage is not None else [0, 0]
        self.usage[0] += len(prompt_ids)
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.timer = state.metrics.timer()
        self.params = params
        kw = {"mm_inputs": mm_inputs} if mm_inputs else {}  # K2.5 images (engine.multimodal)
        self._it: Any = state.engine.generate(prompt_ids, params, request_id, **kw)
        self._first: Any = None
        self.finished = False
        self.num_cached_tokens = 0
        self._reasons: list[str | None] = []
        self._closed = False

    async def start(self) -> None:
        try:
            self._first = await self._it.__anext__()
        except StopAsyncIteration:
            self._first = None
            self.finished = True
        except BaseException as e:
            self.timer.done = True  # rejected (or client gone while queued): not a generation
            await self.close()
            if isinstance(e, Exception):
                raise engine_error(e) from None
            raise
        self.timer.admitted(len(self.prompt_ids), getattr(self.params, "max_tokens", None))

    def _account(self, out) -> None:
        cached = getattr(out, "num_cached_tokens", 0) or 0
        if cached and not self.num_cached_tokens:
            self.timer.cached(cached)
        self.num_cached_tokens = cached
        num = sum(len(c.token_ids) for c in out.outputs)
        self.timer.tokens(num)
        self.usage[1] += num
        for c in out.outputs:
            if c.finish_reason is not None:
                self._reasons.append(c.finish_reason)
        if out.finished:
            self.finished = True
            self.timer.finish(self._reasons[-1] if self._reasons else "stop")

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> Any:
        if self._first is not None:
            out, self._first = self._first, None
        elif self.finished:
            raise StopAsyncIteration
        else:
            try:
                out = await self._it.__anext__()
            except StopAsyncIteration:
                self.finished = True
                self.timer.finish(self._reasons[-1] if self._reasons else "stop")
                raise
            except BaseException:
                await self.close()
                raise
        self._account(out)
        return out

    async def close(self) -> None:
        """Idempotent; aborts the engine request if it has not finished."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.timer.finish("abort")
        try:
            await self._it.aclose()
        except Exception:  # closing must never mask the original outcome
            logger.exception("closing engine request %s failed", self.request_id)
        if not self.finished:
            abort = getattr(self.state.engine, "abort", None)
            if abort is not None:
                res = abort(self.request_id)
                if asyncio.iscoroutine(res):
                    self.state.spawn(res)
            self.finished = True


class MergedStreams:
    """Interleave EngineStreams as (stream index, output). Always `await aclose()` when done.

    One stream (every chat request, completions with one prompt and n=1) is read in place: a
    pump task and a queue would add two task wake-ups to every token of every stream, which at
    a few hundred concurrent streams is what the event loop spends its step on."""

    _DONE = object()

    def __init__(self, streams: list[EngineStream]):
        self.streams = streams
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Future] = []
        self.remaining = len(streams)

    async def _pump(self, i: int, s: EngineStream) -> None:
        try:
            async for out in s:
                self.queue.put_nowait((i, out))
        except Exception as e:
            self.queue.put_nowait((i, e))
            return
        self.queue.put_nowait((i, self._DONE))

    def __aiter__(self) -> MergedStreams:
        if not self.tasks and len(self.streams) > 1:
            self.tasks = [
                asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)
            ]
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if len(self.streams) == 1:
            if self.remaining:
                try:
                    return 0, await self.streams[0].__anext__()
                except StopAsyncIteration:
                    self.remaining = 0
            raise StopAsyncIteration
        while self.remaining:
            i, item = await self.queue.get()
            if item is self._DONE:
                self.remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return i, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.streams:
            await s.close()


# --------------------------------------------------------------------------------------------
# Logprobs


def token_text(tokenizer, token_id: int, lp=None) -> str:
    if lp is not None and getattr(lp, "decoded_token", None) is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def token_bytes(tokenizer, token_id: int) -> list[int]:
    f = getattr(tokenizer, "id_to_bytes", None)
    if f is not None:
        return list(f(token_id))
    return list(tokenizer.decode([token_id]).encode())


def _ranked(entry: dict) -> list[tuple[int, Any]]:
    def key(kv):
        lp = kv[1].logprob
        return (kv[1].rank or 10**9, -lp if lp == lp else math.inf)  # NaN sorts last

    return sorted(entry.items(), key=key)


OnBad = Callable[[float], None] | None


def nonfinite_warner(request_id: str) -> Callable[[float], None]:
    """`on_bad` for the logprob helpers: logs once (per request) that logprobs were replaced."""
    warned: list[float] = []

    def warn(value: float) -> None:
        if not warned:
            warned.append(value)
            logger.warning(
                "request %s: the model produced a non-finite logprob (%r), sent as %s; NaN "
                "logits come from NaN weights or sampling parameters that overflow",
                request_id,
                value,
                "0.0" if value > 0 else "-9999.0",
            )

    return warn


def chat_logprobs(
    tokenizer, token_ids: list[int], logprobs, top_n: int, on_bad: OnBad = None
) -> list[dict]:
    """OpenAI chat format: [{token, logprob, bytes, top_logprobs: [...]}] per generated token.

    Non-finite logprobs are replaced (see server/finite.py) and reported to `on_bad`."""
    warn = on_bad
    out = []
    for tid, entry in zip(token_ids, logprobs or [], strict=False):
        lp = entry.get(tid)
        tops = [
            {
                "token": token_text(tokenizer, t, x),
                "logprob": finite_logprob(x.logprob, warn),
                "bytes": token_bytes(tokenizer, t),
            }
            for t, x in _ranked(entry)[:top_n]
        ]
        out.append(
            {
                "token": token_text(tokenizer, tid, lp),
                "logprob": finite_logprob(lp.logprob, warn) if lp is not None else MIN_LOGPROB,
                "bytes": token_bytes(tokenizer, tid),
                "top_logprobs": tops,
            }
        )
    return out


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs,
    top_n: int,
    text_offset: int,
    on_bad: OnBad = None,
) -> tuple[dict, int]:
    """OpenAI completions format for one run of tokens; returns (dict, next text offset)."""
    warn = on_bad
    res: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    entries = list(logprobs) if logprobs is not None else [None] * len(token_ids)
    for tid, entry in zip(token_ids, entries, strict=False):
        lp = entry.get(tid) if entry else None
        tok = token_text(tokenizer, tid, lp)
        res["tokens"].append(tok)
        res["token_logprobs"].append(finite_logprob(lp.logprob, warn) if lp is not None else None)
        if entry is None:
            res["top_logprobs"].append(None)
        else:
            res["top_logprobs"].append(
                {
                    token_text(tokenizer, t, x): finite_logprob(x.logprob, warn)
                    for t, x in _ranked(entry)[:top_n]
                }
            )
        res["text_offset"].append(text_offset)
        text_offset += len(tok)
    return res, text_offset
