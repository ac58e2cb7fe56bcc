"""Test doubles for the HTTP layer: a byte-level fake tokenizer and a scripted async engine.

The fake engine follows docs/interfaces.md: `generate()` is an async generator of DELTA
`RequestOutput`s that validates before queueing (ValueError / EngineQueueFull on the first
step), applies `SamplingParams.logits_processors` to a real logits row each step (so forced tool
calls are exercised), honours stop strings, stop tokens, max_tokens and n, and holds "pages"
for each live request that it frees when the request finishes or its iterator is closed.
"""

from __future__ import annotations

import asyncio
import math
import re

import torch

from k2serve.engine.outputs import CompletionOutput, Logprob, RequestOutput

SPECIALS = [
    "<|im_end|>",
    "[EOS]",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
FLAGGED_SPECIAL = {
    "<|im_end|>",
    "[EOS]",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
}
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))


class EngineQueueFull(RuntimeError):
    """Same name as the engine's, which is how the server recognises it."""


class FakeTokenizer:
    """Specials are ids 0..12; every other byte b is id 13 + b."""

    def __init__(self):
        self.n_special = len(SPECIALS)
        self.vocab_size = self.n_special + 256
        self.eos_token_id = SPECIALS.index("<|im_end|>")

    special_tokens = tuple(SPECIALS)

    def token_to_id(self, s: str) -> int | None:
        return SPECIALS.index(s) if s in SPECIALS else None

    def id_to_bytes(self, i: int) -> bytes:
        return SPECIALS[i].encode() if i < self.n_special else bytes([i - self.n_special])

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if not allow_special:
            return [self.n_special + b for b in text.encode()]
        out, pos = [], 0
        for m in _SPECIAL_RE.finditer(text):
            out += [self.n_special + b for b in text[pos : m.start()].encode()]
            out.append(SPECIALS.index(m.group()))
            pos = m.end()
        return out + [self.n_special + b for b in text[pos:].encode()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        parts = []
        for i in ids:
            if i < self.n_special and skip_special_tokens and SPECIALS[i] in FLAGGED_SPECIAL:
                continue
            parts.append(self.id_to_bytes(i))
        return b"".join(parts).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages, tools=None, add_generation_prompt=True, chat_template_kwargs=None
    ) -> str:
        kw = chat_template_kwargs or {}
        out = ""
        if tools:
            names = ",".join(t["function"]["name"] for t in tools)  # short: max_model_len 512
            out += f"<|im_system|>tool_declare<|im_middle|>{names}<|im_end|>"
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"bad role {m['role']}")
            body = m.get("content") or ""
            if m["role"] == "assistant" and m.get("reasoning_content"):
                body = f"<think>{m['reasoning_content']}</think>{body}"
            if m["role"] == "tool":
                body = f"## Return of {m['tool_call_id']}\n{body}"
            if m.get("tool_calls"):
                body += "<|tool_calls_section_begin|>"
                for tc in m["tool_calls"]:
                    body += f"<|tool_call_begin|>{tc['id']}<|tool_call_argument_begin|>"
                    body += f"{tc['function']['arguments']}<|tool_call_end|>"
                body += "<|tool_calls_section_end|>"
            name = m.get("name") or m["role"]
            out += f"<|im_{m['role'] if m['role'] != 'tool' else 'system'}|>{name}"
            out += f"<|im_middle|>{body}<|im_end|>"
        if add_generation_prompt:
            out += "<|im_assistant|>assistant<|im_middle|>"
            out += "<think>" if kw.get("thinking", True) else "<think></think>"
        return out


def default_script(prompt: str) -> str:
    """What the fake model 'wants' to say for a prompt (thinking on when it ends in <think>)."""
    thinking = prompt.endswith("<think>")
    head = "Let me think.</think>" if thinking else ""
    if "Paris and Rome" in prompt and "tool_declare" in prompt:
        return head + "".join(
            f"<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>"
            f'{{"city": "{c}"}}<|tool_call_end|>'
            for i, c in enumerate(["Paris", "Rome"])
        ).join(["<|tool_calls_section_begin|>", "<|tool_calls_section_end|><|im_end|>"])
    if "bare call" in prompt:  # a call without the section marker
        return head + (
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Oslo"}<|tool_call_end|><|im_end|>'
        )
    if "weather" in prompt and "tool_declare" in prompt:
        return head + (
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>"
        )
    if "count" in prompt:
        return head + " ".join(str(i) for i in range(1, 200))
    if "forever" in prompt:
        return head + "la " * 5000
    return head + "Hello! I am a fake model. How can I help you today?<|im_end|>"


class FakeAsyncEngine:
    def __init__(
        self,
        *,
        max_model_len=512,
        max_num_seqs=8,
        max_waiting=64,
        page_size=16,
        num_pages=4096,
        delay=0.002,
        script=default_script,
    ):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.page_size = page_size
        self.num_pages = num_pages
        self.delay = delay
        self.script = script
        self.live: dict[str, int] = {}  # request id -> pages held
        self.waiting = 0
        self.running = 0
        self.aborted: list[str] = []
        self.started: list[str] = []
        self.healthy = True
        self.errored = False
        self._slots = asyncio.Semaphore(max_num_seqs)

    def get_stats(self) -> dict:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_pages_used": sum(self.live.values()),
            "kv_pages_total": self.num_pages,
            "prefix_cache_hit_rate": 0.25,
        }

    def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("engine loop died")

    def abort(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def check_structured_outputs(self, structured_outputs) -> None:
        pass  # the fake's script ignores constraints

    def shutdown(self) -> None:
        pass

    def _pages(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    async def generate(self, prompt_token_ids, params, request_id):
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens, max_model_len is {self.max_model_len}"
            )
        if self.waiting >= self.max_waiting:
            raise EngineQueueFull(f"{self.waiting} requests are waiting")
        self.started.append(request_id)
        self.waiting += 1
        acquired = finished = False
        try:
            await self._slots.acquire()
            acquired = True
            self.waiting -= 1
            self.running += 1
            self.live[request_id] = self._pages(len(prompt_token_ids)) * params.n
            async for out in self._run(prompt_token_ids, params, request_id):
                if out.finished:
                    finished = True
                yield out
        finally:
            if not acquired:
                self.waiting -= 1
            else:
                self.running -= 1
                self._slots.release()
            if not finished:
                self.aborted.append(request_id)
            self.live.pop(request_id, None)

    async def _run(self, prompt_ids, params, request_id):
        tok = self.tokenizer
        prompt = tok.decode(prompt_ids)
        want = tok.encode(self.script(prompt))
        n = params.n
        outs: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        sent = [0] * n
        done = [False] * n
        stops = list(params.stop or [])
        while not all(done):
            await asyncio.sleep(self.delay)
            deltas = []
            for i in range(n):
                if done[i]:
                    continue
                k = len(outs[i])
                natural = want[k] if k < len(want) else tok.eos_token_id
                logits = torch.full((tok.vocab_size,), -10.0)
                logits[natural] = 10.0
                for proc in params.logits_processors:
                    logits = proc(list(outs[i]), logits)
                lp = torch.log_softmax(logits, -1)
                tid = int(torch.argmax(lp))
                outs[i].append(tid)
                reason = stop_reason = None
                if tid == tok.eos_token_id and not params.ignore_eos:
                    reason, stop_reason = "stop", tid
                else:
                    texts[i] += tok.decode([tid], skip_special_tokens=params.skip_special_tokens)
                visible = len(texts[i])
                for s in stops:
                    if reason is None and s in texts[i]:
                        visible = texts[i].index(s)
                        reason, stop_reason = "stop", s
                if reason is None and len(outs[i]) >= params.max_tokens:
                    reason = "length"
                if reason is None:  # hold back a tail that may still become a stop string
                    for s in stops:
                        for k in range(min(len(s) - 1, len(texts[i])), 0, -1):
                            if texts[i].endswith(s[:k]):
                                visible = min(visible, len(texts[i]) - k)
                                break
                piece = texts[i][sent[i] : visible]
                sent[i] = max(sent[i], visible)
                logprobs = None
                if params.logprobs is not None:
                    top = torch.topk(lp, max(params.logprobs, 1))
                    entry = {
                        int(t): Logprob(float(v), r + 1, tok.decode([int(t)]))
                        for r, (v, t) in enumerate(zip(top.values, top.indices, strict=True))
                        if r < params.logprobs
                    }
                    rank = int((lp > lp[tid]).sum()) + 1
                    entry[tid] = Logprob(float(lp[tid]), rank, tok.decode([tid]))
                    logprobs = [entry]
                if reason:
                    done[i] = True
                self.live[request_id] = self._pages(len(prompt_ids) + max(map(len, outs))) * n
                deltas.append(
                    CompletionOutput(
                        index=i,
                        text=piece,
                        token_ids=[tid],
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=stop_reason,
                    )
                )
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=list(prompt_ids),
                outputs=deltas,
                finished=all(done),
                num_cached_tokens=0,
            )
