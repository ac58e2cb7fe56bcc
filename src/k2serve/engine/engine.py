"""LLMEngine: the synchronous core. `step()` = schedule, run the model, process outputs.

Where a request goes, top to bottom:
1. `add_request` validates (prompt length vs max_model_len and the cache, params vs tokenizer),
   splits `n > 1` into n child `Request`s and queues them in the scheduler.
2. `step()` asks the scheduler for a batch, the runner builds the flat batch, runs the model and
   samples; the scheduler advances each request and finishes those that hit EOS / a stop token /
   max_tokens (freeing their pages); `_process_outputs` detokenizes, checks stop strings (which
   may finish a request) and returns DELTA `RequestOutput`s (new tokens and text only).
3. `abort_request` finishes a request at any moment; its final output (finish_reason "abort")
   comes out of the next `step()`.

Invariant: every request that ends, however it ends, returns its pages (`check_integrity()`).
Not thread-safe: `AsyncLLMEngine` drives it from one thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.config import EngineConfig
from k2serve.engine.contract import resolve_max_tokens
from k2serve.engine.detokenizer import make_detokenizer
from k2serve.engine.errors import PromptTooLongError
from k2serve.engine.multimodal import MultiModalInputs
from k2serve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from k2serve.engine.request import Request, RequestStatus
from k2serve.engine.runner import ModelRunner
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.scheduler import Scheduler
from k2serve.engine.setup import (
    eos_token_ids,
    load_tokenizer,
    num_kv_pages,
    resolve_device,
    setup_rank,
)
from k2serve.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from k2serve.engine.executor import MultiprocExecutor

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found cached
    num_preemptions: int
    prompt_tokens: int  # totals since start
    generation_tokens: int
    num_finished: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


class _OutputState:
    """Per child request: text so far and how much of it / of the tokens was already returned."""

    def __init__(self, req: Request, tokenizer) -> None:
        p = req.sampling_params
        self.detok = make_detokenizer(tokenizer, p.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.text_sent = 0
        self.tokens_sent = 0
        self.logprobs_sent = 0
        self.done_sent = False
        self.hold = max((len(s) for s in p.stop), default=1) - 1  # chars held back for stops


class _Parent:
    def __init__(self, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children = children


class LLMEngine:
    def __init__(
        self,
        engine_config: EngineConfig | None = None,
        *,
        model=None,
        tokenizer=None,
        kv_cache_factory=None,
    ) -> None:
        """`model` / `tokenizer` / `kv_cache_factory(num_pages, page_size, dtype, device)` are
        injected by tests; by default they come from `engine_config.model`."""
        cfg = engine_config or EngineConfig()
        self.device = resolve_device(cfg.device)
        model_dir = cfg.model
        if model is None and model_dir is None:
            from k2serve.demo import demo_path

            model_dir = os.fspath(demo_path())
        sized = {}

        def num_pages(model, kv_dtype) -> int:  # from the memory budget, after the load
            max_len = cfg.max_model_len or model.config.max_position_embeddings
            sized["pages"], sized["max_model_len"] = num_kv_pages(
                cfg, model.config, kv_dtype, self.device, max_len, cfg.max_model_len is None
            )
            return sized["pages"]

        t0 = time.monotonic()
        rank = setup_rank(  # place experts -> load and shard -> backends -> KV cache, once each
            cfg,
            self.device,
            model_dir=model_dir,
            num_pages=num_pages,
            model=model,
            tp_size=cfg.tensor_parallel_size,  # tensor parallel: rank 0's shard only
            kv_cache_factory=kv_cache_factory,
        )
        if model is None:
            logger.info("loaded %s in %.1fs", model_dir, time.monotonic() - t0)
            if tokenizer is None:
                tokenizer = load_tokenizer(cfg.tokenizer or os.fspath(model_dir or ""))
        model, kv_caches = rank.model, rank.kv_caches
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        pages, max_model_len = sized["pages"], sized["max_model_len"]
        self.config = cfg.replace(max_model_len=max_model_len, num_kv_pages=pages)
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(pages, cfg.page_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        self.runner: ModelRunner | MultiprocExecutor
        if cfg.tensor_parallel_size > 1:
            from k2serve.engine.executor import MultiprocExecutor

            self.runner = MultiprocExecutor(cfg, model, kv_caches, self.device, model_dir=model_dir)
        else:
            self.runner = ModelRunner(
                model, kv_caches, cfg.page_size, self.device, cfg.seed, engine_config=cfg
            )
        self.mm = MultiModalInputs.for_model(self.model_config, model_dir, cfg)
        self.eos_token_ids = eos_token_ids(self.model_config, tokenizer, model_dir)
        self.vocab_size = self.model_config.vocab_size
        self._requests: dict[str, Request] = {}  # child id -> request (unfinished)
        self._parents: dict[str, _Parent] = {}
        self._states: dict[str, _OutputState] = {}
        self._pending: list[RequestOutput] = []  # abort outputs for the next step()
        self._prompt_tokens = self._generation_tokens = self._num_finished = 0
        self._grammar = None  # k2serve.structured GrammarBackend, made by the first request
        self._grammar_lock = threading.Lock()

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError (PromptTooLongError) for a request that cannot be served; returns
        its max_tokens (resolved against max_model_len when None)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [
            t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        max_tokens = resolve_max_tokens(n, params.max_tokens, self.max_model_len)
        cap = self.kv.num_pages * self.kv.page_size
        if n + max_tokens > cap:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
                f"exceeds the KV cache ({cap} tokens)"
            )
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and n > budget:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but max_num_batched_tokens={budget} and chunked "
                "prefill is off, so it could never be scheduled"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary")
        if params.structured_outputs is not None:
            self.grammar_backend().compile(params.structured_outputs)  # cached; ValueError if bad
        return max_tokens

    def grammar_backend(self):
        """The structured-outputs grammar backend (built on first use: the vocab as bytes)."""
        with self._grammar_lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this engine has none")
                from k2serve.structured.backend import GrammarBackend

                self._grammar = GrammarBackend(
                    self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
                )
            return self._grammar

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        mm_inputs: list[ImageInput] | None = None,
    ) -> None:
        """`mm_inputs`: the prompt's images, placed (`process_images` / `MultiModalInputs`)."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        self.mm.check_placed(prompt_token_ids, mm_inputs or [])
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        children = []
        so = params.structured_outputs
        compiled = self.grammar_backend().compile(so) if so is not None else None
        for i, cid in enumerate(ids):
            req = Request(
                cid,
                prompt_token_ids,
                params,
                eos_token_ids=self.eos_token_ids,
                max_tokens=max_tokens,
                parent_id=request_id,
                index=i,
                cache_salt=cache_salt,
                arrival_time=arrival_time,
                mm_inputs=mm_inputs,
            )
            if compiled is not None and so is not None:
                from k2serve.structured.state import GrammarState

                req.grammar = GrammarState(self._grammar, compiled, so)  # one per sequence
            children.append(req)
            self._requests[cid] = req
            self._states[cid] = _OutputState(req, self.tokenizer)
            self.scheduler.add_request(req)
        self._parents[request_id] = _Parent(prompt, list(prompt_token_ids), children)
        self._prompt_tokens += len(prompt_token_ids) * params.n

    def abort_request(self, request_id: str | list[str]) -> None:
        """Finish a request (all its samples) now; unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for req in parent.children:
                if not req.is_finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
            out = self._make_output(rid, parent, parent.children)
            if out is not None:
                self._pending.append(out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.running)} running, "
                    f"{len(self.scheduler.waiting)} waiting, "
                    f"{self.kv.pool.num_free_pages} free pages"
                )
            return outputs
        sample_reqs, so = self.runner.execute(sched, self.kv)
        sampled: dict[str, int] = {}
        if so is not None:  # None: no sequence sampled this step (partial prefills only)
            sampled = {r.request_id: so.token_ids[i] for i, r in enumerate(sample_reqs)}
            for i, r in enumerate(sample_reqs):
                lp = so.logprobs[i]
                if lp is not None and r.logprobs is not None:
                    r.cumulative_logprob += lp
                    r.logprobs.append(self._logprob_entry(so, i))
        updated = self.scheduler.update_from_output(sched, sampled)
        self._generation_tokens += len(updated)
        touched: dict[str, list[Request]] = {}
        for req in updated:
            self._process_text(req)
            touched.setdefault(req.parent_id, []).append(req)
        for pid, reqs in touched.items():
            out = self._make_output(pid, self._parents[pid], reqs)
            if out is not None:
                outputs.append(out)
        return outputs

    def _logprob_entry(self, so, i: int) -> dict[int, Logprob]:
        tok = so.token_ids[i]
        dec = self._decode_one
        entry = {tok: Logprob(so.logprobs[i], so.ranks[i], dec(tok))}
        for rank, (t, lp) in enumerate(so.top_logprobs[i] or [], start=1):
            if t not in entry:
                entry[t] = Logprob(lp, rank, dec(t))
        return entry

    def _decode_one(self, tok: int) -> str | None:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else None

    def _process_text(self, req: Request) -> None:
        """Detokenize the new token; a stop string found in the new text finishes the request."""
        st = self._states[req.request_id]
        if st.detok is None:
            return
        new = st.detok.add(req.output_token_ids[-1:])
        if req.is_finished:
            new += st.detok.flush()
        if not new:
            return
        stops = req.sampling_params.stop
        search_from = max(0, len(st.text) - st.hold)
        st.text += new
        if stops:
            hit = None
            for s in stops:
                j = st.text.find(s, search_from)
                if j >= 0 and (hit is None or j < hit[0]):
                    hit = (j, s)
            if hit is not None:
                j, s = hit
                keep = j + len(s) if req.sampling_params.include_stop_str_in_output else j
                st.text = st.text[:keep]
                st.text_sent = min(st.text_sent, len(st.text))
                if not req.is_finished:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                else:
                    req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = s

    def _make_output(
        self, parent_id: str, parent: _Parent, reqs: list[Request]
    ) -> RequestOutput | None:
        outs = []
        states = self._states
        for req in reqs:
            st = states[req.request_id]
            if st.done_sent:
                continue
            done = req.status.finished
            text = st.text
            upto = len(text) if done else max(st.text_sent, len(text) - st.hold)
            lps = None
            if req.logprobs is not None:
                lps = req.logprobs[st.logprobs_sent :]
                st.logprobs_sent = len(req.logprobs)
            toks = req.output_token_ids
            outs.append(
                CompletionOutput(
                    req.index,
                    text[st.text_sent : upto] if upto > st.text_sent else "",
                    toks[st.tokens_sent :],
                    req.cumulative_logprob if lps is not None else None,
                    lps,
                    req.status.value if done else None,
                    req.stop_reason if done else None,
                )
            )
            st.text_sent = upto
            st.tokens_sent = len(toks)
            if done:
                st.done_sent = True
                req.metrics.finished_time = time.monotonic()
                self._requests.pop(req.request_id, None)
                self._num_finished += 1
        if not outs:
            return None
        children = parent.children
        if len(children) == 1:
            finished = states[children[0].request_id].done_sent
        else:
            finished = all(states[r.request_id].done_sent for r in children)
        first = reqs[0]
        out = RequestOutput(
            parent_id,
            parent.prompt,
            parent.prompt_token_ids,
            outs,
            finished,
            max(first.num_cached_tokens, 0),
            first.metrics,
        )
        if finished:
            del self._parents[parent_id]
            for r in parent.children:
                self._states.pop(r.request_id, None)
        return out

    # ---- lifetime ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop what the runner started (tensor-parallel worker processes); idempotent. The
        engine cannot step afterwards."""
        stop = getattr(getattr(self, "runner", None), "shutdown", None)
        if stop is not None:
            stop()

    # ---- introspection -----------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.kv.pool.num_used_pages,
            kv_pages_total=self.kv.num_pages,
            prefix_cache_queries=self.kv.prefix_query_tokens,
            prefix_cache_hits=self.kv.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_finished=self._num_finished,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if any page is leaked or double-owned (free + cached + used ==
        total, ref counts == holders, no finished request holds pages)."""
        self.scheduler.check_integrity()
        live = {r.request_id for r in self.scheduler.running}
        for rid in self.kv.req_pages:
            if rid not in live:
                raise AssertionError(f"request {rid} holds pages but is not running")
        if not self.has_unfinished_requests() and self.kv.pool.num_used_pages:
            raise AssertionError(f"{self.kv.pool.num_used_pages} pages used with no request left")
