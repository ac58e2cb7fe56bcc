"""AsyncLLMEngine: the async shell around LLMEngine for the server.

The step loop (`core_process.EngineLoop`) runs on its own thread (`k2serve-engine`), so the
event loop never waits on the model; on CUDA that thread is in a process of its own
(`core_process.EngineProcess`: the server's Python then never takes the step loop's GIL), and a
reader thread here receives each step's outputs. The event loop talks to the loop only through
commands (add / abort) and gets outputs
back through one asyncio.Queue per request, filled by ONE `loop.call_soon_threadsafe` per step
and event loop (each such call wakes the loop through its self-pipe; one per request per step
cost more than the engine step itself at batch 64). A consumer that falls behind gets the
deltas waiting in its queue merged into one output (as vLLM does), so a slow client or a busy
event loop costs one wake-up per step, not one per token.

Invariants:
- Only the engine thread touches the LLMEngine's mutable state; `validate()` (which reads only
  fixed settings: `engine.RequestChecks`) runs on the caller's side so bad requests fail before
  anything is queued.
  With async scheduling the model and the sampler run a prepared step on the engine's own
  `k2serve-step` thread (k2serve.engine.pipeline); requests, scheduler and cache stay here.
- Every request that `generate()` started ends in the engine: finished, or aborted when the
  caller leaves the iterator early (return, `aclose()`, cancellation, garbage collection).
- If the step loop fails, every open stream gets `EngineDeadError` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator

from k2serve.engine.config import EngineConfig
from k2serve.engine.core_process import EngineLoop, EngineProcess, use_engine_process
from k2serve.engine.engine import EngineStats, LLMEngine
from k2serve.engine.errors import EngineDeadError, EngineQueueFull
from k2serve.engine.outputs import RequestOutput
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.setup import describe_weights
from k2serve.engine.spec import RuntimeSpec

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineQueueFull"]


def _make_engine(cfg: EngineConfig | None, **kwargs):
    """LLMEngine, or one engine per data-parallel rank behind DPEngine (issue 29)."""
    if cfg is not None and cfg.data_parallel_size > 1:
        from k2serve.engine.dp import create_engine

        return create_engine(cfg, **kwargs)
    return LLMEngine(cfg, **kwargs)


class AsyncLLMEngine:
    def __init__(
        self,
        engine_config: EngineConfig | None = None,
        *,
        engine: LLMEngine | None = None,
        **llm_engine_kwargs,
    ) -> None:
        """Build an LLMEngine from `engine_config` (or wrap a given `engine`) and start the loop.

        Where the engine runs (`use_engine_process`): in a process of its own on CUDA (the
        server's per-token Python then never takes the GIL from the step loop), else on a
        thread of this process."""
        self._lock = threading.Lock()  # guards _streams and _pending_adds
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_adds = 0
        self._dead: BaseException | None = None
        self._core: EngineLoop | EngineProcess
        self.engine: LLMEngine | EngineProcess
        if engine is None and not llm_engine_kwargs and use_engine_process(engine_config):
            assert engine_config is not None
            self._core = EngineProcess(engine_config, self)
            self.engine = self._core  # the facade: tokenizer, config, spec, validate, ...
        else:
            if engine is None:
                engine = _make_engine(engine_config, **llm_engine_kwargs)
            self.engine = engine
            self._core = EngineLoop(engine, self)
        self.max_waiting = self.engine.config.max_waiting
        self._stats = self.engine.get_stats()
        self._core.start()

    @classmethod
    def from_config(cls, engine_config: EngineConfig | None = None, **kwargs) -> AsyncLLMEngine:
        return cls(engine_config, **kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def config(self) -> EngineConfig:
        """The engine config with the resolved max_model_len and page count."""
        return self.engine.config

    @property
    def spec(self) -> RuntimeSpec:
        return self.engine.spec

    @property
    def max_model_len(self) -> int:
        return self.engine.spec.max_model_len

    @property
    def model(self):
        """The model (None when the engine runs in its own process)."""
        return self.engine.model

    @property
    def in_process(self) -> bool:
        """False when the engine runs in a process of its own (`use_engine_process`)."""
        return isinstance(self._core, EngineLoop)

    def weights_description(self) -> tuple[str, str]:
        """(weight formats, where the experts live) for the start-up log."""
        if isinstance(self._core, EngineProcess):
            return self._core.weights
        return describe_weights(self.engine.model, self.engine.model_config)

    @property
    def errored(self) -> bool:
        return self._dead is not None

    # ---- API ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
        cache_salt: str | None = None,
        mm_inputs: list | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs (new token ids / text / logprobs per sample index) until finished.

        Raises ValueError (bad params, prompt too long), EngineQueueFull or EngineDeadError before
        queueing anything.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}")
        params = params if params is not None else SamplingParams()
        prompt_token_ids = list(prompt_token_ids)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        self.engine.validate(prompt_token_ids, params)
        if mm_inputs:  # K2.5 images, placed (engine.multimodal)
            self.engine.mm.check_placed(prompt_token_ids, mm_inputs)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self.max_waiting is not None:
                waiting = self._stats.num_waiting + self._pending_adds
                if waiting >= self.max_waiting:
                    raise EngineQueueFull(
                        f"{waiting} requests are waiting (max_waiting={self.max_waiting}); "
                        "retry later"
                    )
            self._streams[request_id] = (loop, q)
            self._pending_adds += 1
        try:
            self._core.submit_add(
                request_id, prompt_token_ids, params, prompt, cache_salt, mm_inputs
            )
        except BaseException:  # nothing was queued (a request the engine process cannot take)
            with self._lock:
                self._streams.pop(request_id, None)
                self._pending_adds -= 1
            raise
        finished = False
        carry = None  # an item taken from the queue while merging, handled next
        try:
            while True:
                item, carry = (carry, None) if carry is not None else (await q.get(), None)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not q.empty():  # behind: merge what is waiting
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        carry = nxt
                        break
                    item.merge(nxt)
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                with self._lock:
                    self._streams.pop(request_id, None)
                self._core.submit_abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its iterator gets a last output with finish_reason "abort"."""
        self._core.submit_abort(request_id)

    def check_health(self) -> None:
        """Raise if the runner reports a failed rank (tensor / multi-node parallel); /health."""
        self.engine.runner.check_health()

    def set_on_failure(self, fn) -> None:
        """`fn(message)` when a rank is lost while idle or busy (multi-node watchdog)."""
        self.engine.runner.set_on_failure(fn)

    def check_structured_outputs(self, structured_outputs) -> None:
        """Compile (and cache for the engine) a constraint; ValueError when it is bad. Any
        thread: the grammar backend is built under a lock and compiles are cached."""
        self.engine.grammar_backend().compile(structured_outputs)

    def get_stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its latest step."""
        return self._stats

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop, fail the open streams, then stop the engine's runner (TP workers).
        Idempotent."""
        stopped = self._core.stop(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))
        if not stopped:  # a step still running: its workers must not vanish under it
            logger.warning("engine thread still running after %.1fs; runner left up", timeout)
            return
        self.engine.shutdown()

    # ---- what the engine loop reports (its thread, or the engine process's reader thread) ----
    def wants(self, request_id: str) -> bool:
        """False once the caller has left (the engine need not start the request)."""
        with self._lock:
            return request_id in self._streams

    def request_failed(self, request_id: str, err: BaseException) -> None:
        self._dispatch(request_id, err, True)

    def added(self, stats: EngineStats) -> None:
        """An add command was handled; `stats` already counts the request (or its failure).
        NOTE: the snapshot is refreshed before the add is un-counted, so that max_waiting
        never sees a request in neither count."""
        self._stats = stats
        with self._lock:
            self._pending_adds -= 1

    def step_done(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        if outputs:
            self._dispatch_step(outputs)

    def stopped(self, cause: BaseException) -> None:
        """The step loop failed (or the engine process ended): fail every stream, refuse more."""
        self._dead = cause
        err = EngineDeadError(f"the engine step loop failed: {cause!r}")
        err.__cause__ = cause
        self._fail_all(err)

    def _dispatch(self, request_id: str, item, last: bool) -> None:
        with self._lock:
            target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is None:
            return
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            if not last:
                with self._lock:
                    self._streams.pop(request_id, None)
                self._core.submit_abort(request_id)

    def _dispatch_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            streams = self._streams
            for out in outputs:
                rid = out.request_id
                target = streams.pop(rid, None) if out.finished else streams.get(rid)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                for _, out in items:
                    if not out.finished:
                        with self._lock:
                            self._streams.pop(out.request_id, None)
                        self._core.submit_abort(out.request_id)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for loop, q in streams.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, err)
            except RuntimeError:
                pass


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    # runs on the consumers' event loop
    for q, item in items:
        q.put_nowait(item)
