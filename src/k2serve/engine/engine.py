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

With async scheduling (`spec.async_scheduling`, k2serve.engine.pipeline) step 2 is pipelined:
`step()` schedules and submits step N+1, then processes step N's samples while N+1 computes;
each `step()` returns the outputs of the step before (the first returns none).

Invariant: every request that ends, however it ends, returns its pages (`check_integrity()`).
Not thread-safe: `AsyncLLMEngine` drives it from one thread.

NOTE: over 500 lines since wave 4 added the features' hooks here (drafts accepted several tokens
a step, images placed at add_request, the host KV tier's stats); the output processing
(`_make_output`) could follow `engine.detokenize` into its own module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.config import EngineConfig
from k2serve.engine.contract import resolve_max_tokens
from k2serve.engine.detokenize import OutputState, process_text
from k2serve.engine.errors import PromptTooLongError
from k2serve.engine.kv_tier import host_tier_stats, make_host_tier, num_host_pages
from k2serve.engine.multimodal import MultiModalInputs
from k2serve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from k2serve.engine.pipeline import StepWorker, needs_sync
from k2serve.engine.request import Request, RequestStatus
from k2serve.engine.runner import ModelRunner
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.scheduler import Scheduler, SchedulerOutput
from k2serve.engine.setup import eos_token_ids, load_tokenizer, resolve_device, setup_rank
from k2serve.engine.spec import RuntimeSpec
from k2serve.engine.spec_decode.drafter import SpecDecodingStats
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
    # K2 host KV tier (issue 27); zeros when it is off
    kv_host_pages_used: int = 0
    kv_host_pages_total: int = 0
    host_cache_hits: int = 0  # prompt tokens restored from host RAM (also in prefix_cache_hits)
    kv_offload_bytes_d2h: int = 0
    kv_offload_bytes_h2d: int = 0
    kv_offload_seconds_d2h: float = 0.0
    kv_offload_seconds_h2d: float = 0.0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swapped: int = 0  # requests whose KV is in host RAM now
    kv_copy_stalls: int = 0  # forwards that waited for a write-back to finish

    @property
    def host_cache_usage(self) -> float:
        return self.kv_host_pages_used / self.kv_host_pages_total if self.kv_host_pages_total else 0

    spec_decode: SpecDecodingStats | None = None  # --speculative-config: drafts / accepted

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0


class _Parent:
    def __init__(self, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children = children


class RequestChecks:
    """What a request is checked against before it is queued (fixed settings only, so any
    thread, and the server's process when the engine runs in its own: engine.core_process).
    Needs spec, config, max_model_len, vocab_size, tokenizer, eos_token_ids, _grammar (None)
    and _grammar_lock."""

    spec: RuntimeSpec
    config: EngineConfig
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    eos_token_ids: frozenset[int]
    _grammar: Any
    _grammar_lock: threading.Lock

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
        cap = self.spec.kv_cache_tokens
        if n + max_tokens > cap:
            raise PromptTooLongError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} tokens "
                f"exceeds the KV cache ({cap} tokens)"
            )
        budget = self.spec.max_num_batched_tokens
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


class LLMEngine(RequestChecks):
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
        if cfg.data_parallel_size > 1:  # issue 29: one engine per rank, behind a front end
            raise ValueError("data_parallel_size > 1 needs k2serve.engine.dp.DPEngine (what LLM, "
                             "AsyncLLMEngine and `serve` build), not one LLMEngine")  # fmt: skip
        self.device = resolve_device(cfg.device)
        model_dir = cfg.model
        if model is None and model_dir is None:
            from k2serve.demo import demo_path

            model_dir = os.fspath(demo_path())
        t0 = time.monotonic()
        rank = setup_rank(  # place experts -> load and shard -> backends -> KV cache, once each
            cfg,
            self.device,
            model_dir=model_dir,
            model=model,
            tp_size=cfg.tensor_parallel_size,  # tensor parallel: rank 0's shard only
            kv_cache_factory=kv_cache_factory,
        )
        if model is None:
            logger.info("loaded %s in %.1fs", model_dir, time.monotonic() - t0)
            if tokenizer is None:
                tokenizer = load_tokenizer(cfg.tokenizer or os.fspath(model_dir or ""))
        model, kv_caches, spec = rank.model, rank.kv_caches, rank.spec
        self.spec = spec  # what was resolved: every component below reads it
        self.model = model
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        # the config with the resolved length and page count (tensor-parallel workers get it)
        self.config = cfg.replace(max_model_len=spec.max_model_len, num_kv_pages=spec.num_kv_pages)
        self.max_model_len = spec.max_model_len
        host_pages = num_host_pages(cfg, spec.device, kv_caches, model)  # K2 host KV tier
        self.kv = KVCacheManager(
            spec.num_kv_pages,
            spec.page_size,
            cfg.enable_prefix_caching,
            make_host_tier(host_pages, kv_caches),
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
        )
        self.runner: ModelRunner | MultiprocExecutor
        if spec.parallel.tensor_parallel_size > 1:
            from k2serve.engine.executor import MultiprocExecutor

            self.runner = MultiprocExecutor(
                spec, self.config, model, kv_caches, model_dir=model_dir, kv_host_pages=host_pages
            )
        else:
            self.runner = ModelRunner(model, kv_caches, spec, kv_host_pages=host_pages)
        # async scheduling: the step thread (None: every step runs on the caller's thread)
        self.pipeline = StepWorker(self.runner) if spec.async_scheduling else None
        self._sync_reqs: set[str] = set()  # unfinished requests whose steps run synchronously
        self._stream_interval = cfg.stream_interval  # new tokens per output (first and last: 1)
        self.mm = MultiModalInputs.for_model(self.model_config, model_dir, cfg)
        self.eos_token_ids = eos_token_ids(self.model_config, tokenizer, model_dir)
        self.vocab_size = self.model_config.vocab_size
        self._requests: dict[str, Request] = {}  # child id -> request (unfinished)
        self._parents: dict[str, _Parent] = {}
        self._states: dict[str, OutputState] = {}
        self._pending: list[RequestOutput] = []  # abort outputs for the next step()
        self._prompt_tokens = self._generation_tokens = self._num_finished = 0
        self._grammar = None  # k2serve.structured GrammarBackend, made by the first request
        self._grammar_lock = threading.Lock()
        # speculative decoding (--speculative-config): k2serve.engine.spec_decode
        self.drafter = None
        if cfg.speculative_config is not None:
            from k2serve.engine.spec_decode.setup import build_drafter

            self.drafter = build_drafter(cfg.speculative_config, self)

    # ---- requests ----------------------------------------------------------------------------
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
        constraint = params.structured_outputs
        compiled = self.grammar_backend().compile(constraint) if constraint is not None else None
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
            if compiled is not None and constraint is not None:
                from k2serve.structured.state import GrammarState

                req.grammar = GrammarState(self._grammar, compiled, constraint)  # one per sequence
            children.append(req)
            if needs_sync(params):
                self._sync_reqs.add(cid)
            self._requests[cid] = req
            self._states[cid] = OutputState(req, self.tokenizer)
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
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or (self.pipeline is not None and self.pipeline.busy)
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        pipe = self.pipeline
        if pipe is not None and not self._sync_reqs:
            return self._step_async(pipe, outputs)
        if pipe is not None and pipe.busy:  # a request that needs the host: drain, then sync
            done = pipe.take()
            assert done is not None
            self._process_step(done.sched, *done.result(), outputs)
        if self.kv.host is not None:  # K2 host tier: restored requests whose copy is done
            self.kv.host.loads_done_seq = self.runner.kv_loads_done()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.transfers is not None:  # K2 host tier: copies only this step
                self.runner.apply_kv_transfers(sched.transfers)
                return outputs
            if self.kv.host is not None and self.kv.host.loading:  # nothing to do but wait
                self.runner.wait_kv_loads()
                return outputs
            self._check_progress()
            return outputs
        sample_reqs, samples = self.runner.execute(sched, self.kv)
        self._process_step(sched, sample_reqs, samples, outputs)
        return outputs

    def _step_async(self, pipe: StepWorker, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Schedule and submit the next step, then process the one in flight (pipeline)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(async_step=True)
        if sched.is_empty:
            done = pipe.take()
            if done is None:
                self._check_progress()
        else:
            prev_rows = pipe.inflight.rows if pipe.inflight is not None else None
            inp = pipe.runner.prepare(sched, self.kv, prev_rows)  # a ModelRunner (one process)
            self.scheduler.advance_async(sched)
            done = pipe.submit(sched, inp)
            pipe.note_host_time(time.perf_counter() - t0)
        if done is not None:
            result = done.result()
            pipe.wait_launched()  # CUDA: the next step's kernels first, then the outputs
            self._process_step(done.sched, *result, outputs)
        return outputs

    def _check_progress(self) -> None:
        """An empty schedule with nothing in flight: raise if requests are left (stuck)."""
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError(
                f"scheduler made no progress: {len(self.scheduler.running)} running, "
                f"{len(self.scheduler.waiting)} waiting, "
                f"{self.kv.pool.num_free_pages} free pages"
            )

    def schedule_delay(self) -> float:
        """Async scheduling: seconds the caller may wait (for new requests to arrive) before
        the next `step()` without delaying the model (k2serve.engine.pipeline); 0 otherwise."""
        pipe = self.pipeline
        if pipe is None or self._sync_reqs or self.scheduler.next_step_is_full():
            return 0.0  # nothing to wait for: a newcomer would not fit the next step
        return pipe.schedule_delay()

    def wait_in_flight(self, timeout: float) -> None:
        """Wait up to `timeout` s for the step in flight to finish (async scheduling)."""
        if self.pipeline is not None:
            self.pipeline.wait(timeout)

    def _process_step(self, sched: SchedulerOutput, sample_reqs, samples, outputs) -> None:
        """Apply a step's samples: advance the requests, finish those that end, detokenize and
        append the step's RequestOutputs to `outputs`."""
        sampled: dict[str, int | list[int]] = {}
        rows: dict[str, list[int]] = {}  # spec decode: each request's sampler rows
        num_before: dict[str, int] = {}
        if samples is not None and self.drafter is not None:
            sampled, rows = self.drafter.accept(sample_reqs, samples.token_ids)
            num_before = {rid: sample_reqs[rr[0]].num_output_tokens for rid, rr in rows.items()}
        elif samples is not None:  # None: no sequence sampled this step (partial prefills only)
            sampled = {r.request_id: samples.token_ids[i] for i, r in enumerate(sample_reqs)}
            for i, r in enumerate(sample_reqs):
                lp = samples.logprobs[i]
                if lp is not None and r.logprobs is not None and not r.is_finished:
                    r.cumulative_logprob += lp
                    r.logprobs.append(self._logprob_entry(samples, i))
        updated = self.scheduler.update_from_output(sched, sampled)
        touched: dict[str, list[Request]] = {}
        for req in updated:
            num_new = 1
            rr = rows.get(req.request_id)
            if rr is not None:  # spec decode: a verify step may append several tokens
                num_new = req.num_output_tokens - num_before[req.request_id]
                if req.logprobs is not None and samples is not None:
                    for i in rr[:num_new]:
                        req.cumulative_logprob += samples.logprobs[i] or 0.0
                        req.logprobs.append(self._logprob_entry(samples, i))
            st = self._states[req.request_id]
            self._generation_tokens += process_text(req, st, num_new, self.scheduler.finish_request)
            touched.setdefault(req.parent_id, []).append(req)
        for pid, reqs in touched.items():
            out = self._make_output(pid, self._parents[pid], reqs)
            if out is not None:
                outputs.append(out)
        if self.drafter is not None:  # drafts for the next step
            self.drafter.propose(self.scheduler.running, sched)
            self.drafter.maybe_log()

    def _logprob_entry(self, samples, i: int) -> dict[int, Logprob]:
        tok = samples.token_ids[i]
        dec = self._decode_one
        entry = {tok: Logprob(samples.logprobs[i], samples.ranks[i], dec(tok))}
        for rank, (t, lp) in enumerate(samples.top_logprobs[i] or [], start=1):
            if t not in entry:
                entry[t] = Logprob(lp, rank, dec(t))
        return entry

    def _decode_one(self, tok: int) -> str | None:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else None

    def _make_output(
        self, parent_id: str, parent: _Parent, reqs: list[Request]
    ) -> RequestOutput | None:
        outs = []
        states = self._states
        every = self._stream_interval
        for req in reqs:
            st = states[req.request_id]
            if st.done_sent:
                continue
            done = req.status.finished
            if every > 1 and not done and st.tokens_sent:
                if req.num_output_tokens - st.tokens_sent < every:
                    continue  # --stream-interval: not yet
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
                if self.drafter is not None:
                    self.drafter.finish(req)
                st.done_sent = True
                self._sync_reqs.discard(req.request_id)
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
        pipe = getattr(self, "pipeline", None)
        if pipe is not None:
            pipe.close()
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
            **host_tier_stats(self.kv.host, self.runner),  # K2 host KV tier
            spec_decode=self.drafter.stats.snapshot() if self.drafter is not None else None,
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
