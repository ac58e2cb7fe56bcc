"""Where the engine's step loop runs: `EngineLoop` on a thread (`k2serve-engine`), in the
server's process or, with `EngineProcess`, in a process of its own (vLLM's engine core), so
that the server's per-token Python never holds the GIL the step loop needs.

In one process, the event loop's work for every streamed token (the ASGI send chain, the
per-request generators, JSON, metrics: ~30 us a token on the dev CPU, ~2x that on an H100
host's cores) and the engine thread's (scheduling, outputs, detokenizing: ~10 us) take turns
on one GIL: at 256 requests that is ~20 ms of host work a step against the model's 11.3 ms, and
the served rate fell to 0.76 of the model's (benchmarks/RESULTS.md, "Served throughput"). With
the engine here, the step loop has its process's GIL to itself and the server's process, when
it falls behind, merges the deltas waiting for a request into one output (AsyncLLMEngine), so
it costs one send per request per wake-up, not one per token.

    server process (AsyncLLMEngine)            engine process (run_engine_core)
    generate() -> validate, send "add"  --->   reader (main thread) -> EngineLoop commands
    reader thread <- "step" / "added" / ...    EngineLoop thread: step(), one message a step

Used where `use_engine_process` says (CUDA, one data-parallel rank, one node; the
K2SERVE_ENGINE_PROCESS variable forces it on or off). Not on the CPU: there the forward's own
threads want every core, and a second process's event loop would compete for them.

Invariants:
- The messages are pickled with the standard pickler (tensors of image inputs copied, no
  shared-memory handles) and sent whole over one pipe each way; each side reads on one thread,
  so the order of a step's outputs, the adds' acknowledgements and failures is kept.
- The server process checks every request (`RequestChecks.validate`, images, structured
  outputs) before sending it, with the settings the engine process resolved and sent at start;
  the engine process checks again (its add_request) and answers a failure as "request_failed".
- The engine process ignores SIGINT and SIGTERM (the server drains, then stops it) and exits
  when the server's end of the pipe closes, however the server ended.
- If the engine process fails or dies, every open stream gets EngineDeadError and new requests
  are refused (AsyncLLMEngine.stopped), exactly as when the in-process step loop fails.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import pickle
import queue
import signal
import sys
import threading
import types
from typing import Any

from k2serve import envs
from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import EngineStats, LLMEngine, RequestChecks
from k2serve.engine.errors import EngineDeadError
from k2serve.engine.multimodal import MultiModalInputs
from k2serve.engine.outputs import RequestOutput
from k2serve.engine.setup import describe_weights, load_tokenizer, resolve_device

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # the engine process's own wait for a step in flight when told to stop


def use_engine_process(cfg: EngineConfig | None) -> bool:
    """Whether AsyncLLMEngine runs the engine in a process of its own: on CUDA with one
    data-parallel rank on one node, unless K2SERVE_ENGINE_PROCESS says otherwise."""
    cfg = cfg if cfg is not None else EngineConfig()
    forced = envs.engine_process()
    if forced is False:
        return False
    if cfg.data_parallel_size > 1 or cfg.nnodes > 1:
        if forced:
            logger.info("K2SERVE_ENGINE_PROCESS=1 does nothing with several data-parallel ranks "
                        "or nodes: the engine runs in the server's process")  # fmt: skip
        return False
    if forced:
        return True
    try:
        return resolve_device(cfg.device).type == "cuda"
    except ValueError:  # no CUDA for device="cuda": the engine itself says so
        return False


class EngineLoop:
    """The step loop on a thread (`k2serve-engine`): add / abort commands in, every step's
    outputs and stats out to `sink` (AsyncLLMEngine, or the engine process's pipe)."""

    def __init__(self, engine: LLMEngine, sink) -> None:
        self.engine = engine
        self.sink = sink
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="k2serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit_add(self, rid, ids, params, prompt, cache_salt, mm_inputs) -> None:
        self._cmds.put(("add", rid, ids, params, prompt, cache_salt, mm_inputs))
        self._wake.set()

    def submit_abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))
        self._wake.set()

    def stop(self, timeout: float) -> bool:
        """Stop the loop; False if a step still runs after `timeout` seconds."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        eng = self.engine
        try:
            delay = getattr(eng, "schedule_delay", None)  # async scheduling (engine.pipeline)
            while not self._stop:
                wait = delay() if delay is not None else 0.0
                if wait > 0:  # a long step in flight: let requests arriving now join the next
                    eng.wait_in_flight(wait)
                self._drain_commands()
                if not eng.has_unfinished_requests():
                    self.sink.step_done([], eng.get_stats())
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = eng.step()
                self.sink.step_done(outputs, eng.get_stats())
        except BaseException as e:  # noqa: BLE001 - any failure ends the engine
            logger.exception("engine step loop failed")
            self.sink.stopped(e)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, prompt, salt, mm = cmd
                try:
                    if self.sink.wants(rid):  # else the caller left before the engine saw it
                        self.engine.add_request(
                            rid, ids, params, prompt=prompt, cache_salt=salt, mm_inputs=mm
                        )
                except ValueError as e:
                    self.sink.request_failed(rid, e)
                self.sink.added(self.engine.get_stats())
            else:
                self.engine.abort_request(cmd[1])


# RequestOutput's fields, as `pack_outputs` sends them (the prompt stays in the server process)
PACKED_FIELDS = ("request_id", "outputs", "finished", "num_cached_tokens", "metrics")
SERVER_SIDE_FIELDS = ("prompt", "prompt_token_ids")


def pack_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """A step's outputs without their prompts: every delta carries the request's prompt ids
    (a 1K prompt: 256 requests a step pickled to 0.77 MB, 7.5 + 12 ms to pickle and unpickle
    on the dev CPU, against 0.04 MB and 0.9 + 0.8 ms without)."""
    return [(o.request_id, o.outputs, o.finished, o.num_cached_tokens, o.metrics) for o in outputs]


@contextlib.contextmanager
def _main_module_hidden():
    """While the engine process starts: spawn would import the caller's __main__ in it (to
    unpickle what the target needs), re-running a script's top level that has no
    `if __name__ == "__main__"` guard; the target lives in this module, so it needs nothing
    from __main__."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(e: BaseException, fallback: type[Exception] = RuntimeError) -> BaseException:
    """`e` if it survives pickling, else a `fallback` naming it."""
    try:
        pickle.loads(_dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that cannot cross
        return fallback(f"{type(e).__name__}: {e}")


class EngineProcess(RequestChecks):
    """The server process's end: starts the engine process, waits until it has loaded the
    model, then stands in for the LLMEngine where AsyncLLMEngine and the server read one
    (tokenizer, config, spec, model_config, mm, validate, grammar_backend, runner health)."""

    model = None  # the weights live in the engine process

    def __init__(self, cfg: EngineConfig, sink) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state copied
        self._conn, child = ctx.Pipe()
        root = logging.getLogger()
        fmt = next((getattr(h.formatter, "_fmt", None) for h in root.handlers if h.formatter), None)
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(child, cfg, root.level, fmt),
            name="k2serve-engine-core",
            daemon=False,  # its tensor-parallel workers are its own children
        )
        with _main_module_hidden():
            self._proc.start()
        child.close()
        self._sink = sink
        self._send_lock = threading.Lock()
        self._closing = False
        self._ended = False  # the sink was told the engine stopped
        self._on_failure = None
        try:
            info = self._wait_ready()
        except BaseException:
            self._end_process(5.0)
            raise
        logger.info("engine process %d ready", self._proc.pid)
        self.config: EngineConfig = info["config"]
        self.spec = info["spec"]
        self.model_config = info["model_config"]
        self.max_model_len = self.spec.max_model_len
        self.vocab_size = info["vocab_size"]
        self.eos_token_ids = info["eos_token_ids"]
        self.weights: tuple[str, str] = info["weights"]
        self._stats: EngineStats = info["stats"]
        model_dir = info["model_dir"]
        self.tokenizer = load_tokenizer(cfg.tokenizer or model_dir) if info["tokenizer"] else None
        self.mm = MultiModalInputs.for_model(self.model_config, model_dir, cfg)
        self._grammar = None
        self._grammar_lock = threading.Lock()
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # unfinished requests'
        self.runner = self  # check_health / set_on_failure, where LLMEngine has its runner
        self._reader = threading.Thread(target=self._read, name="k2serve-engine-reader",
                                        daemon=True)  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _wait_ready(self) -> dict[str, Any]:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(
                    f"the engine process exited (code {self._proc.exitcode}) while loading the "
                    "model; see its log above"
                )
        kind, payload = pickle.loads(self._conn.recv_bytes())
        if kind == "failed":
            raise payload
        return payload

    # ---- the engine loop's interface (AsyncLLMEngine._core) ----------------------------------
    def start(self) -> None:
        self._reader.start()

    def submit_add(self, rid, ids, params, prompt, cache_salt, mm_inputs) -> None:
        try:
            data = _dumps(("add", rid, ids, params, prompt, cache_salt, mm_inputs))
        except Exception as e:  # noqa: BLE001 - e.g. a logits processor defined in a closure
            raise ValueError(f"the request cannot be sent to the engine process: {e}") from None
        self._prompts[rid] = (prompt, ids)
        try:
            self._send(data)
        except EngineDeadError:
            self._prompts.pop(rid, None)
            raise

    def submit_abort(self, rid: str) -> None:
        try:
            self._send(_dumps(("abort", rid)))
        except EngineDeadError:
            pass  # nothing left to abort

    def stop(self, timeout: float) -> bool:
        """Tell the engine process to stop and wait for it (then end it); always True: nothing
        of it is left to stop afterwards."""
        self._closing = True
        try:
            self._send(_dumps(("stop",)))
        except EngineDeadError:
            pass
        self._end_process(timeout)
        return True

    def shutdown(self) -> None:
        """After `stop`: close the pipe and wait for the reader. Idempotent."""
        self._closing = True
        self._end_process(0.0)
        self._conn.close()
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(5.0)

    def _end_process(self, timeout: float) -> None:
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine process %d still running; terminating it", self._proc.pid)
            self._proc.kill()
            self._proc.join(10.0)

    def _send(self, data: bytes) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # a broken pipe, or closed at shutdown
            raise EngineDeadError(f"the engine process is gone: {e!r}") from None

    def _read(self) -> None:
        sink = self._sink
        while True:
            try:
                kind, *rest = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 - a message that does not unpickle here
                logger.exception("bad message from the engine process")
                self._report_end(e)
                break
            if kind == "step":
                self._stats = rest[1]
                sink.step_done(self._unpack(rest[0]), rest[1])
            elif kind == "added":
                self._stats = rest[0]
                sink.added(rest[0])
            elif kind == "request_failed":
                self._prompts.pop(rest[0], None)
                sink.request_failed(rest[0], rest[1])
            elif kind == "stopped":
                self._report_end(rest[0])
        if not self._closing:
            self._proc.join(1.0)
            self._report_end(
                RuntimeError(f"the engine process exited (code {self._proc.exitcode})")
            )

    def _unpack(self, rows: list[tuple]) -> list[RequestOutput]:
        """`pack_outputs`' rows -> RequestOutputs, the prompt put back from what was sent."""
        outs = []
        for rid, outputs, finished, cached, metrics in rows:
            got = self._prompts.pop(rid, None) if finished else self._prompts.get(rid)
            prompt, ids = got if got is not None else (None, [])
            outs.append(RequestOutput(rid, prompt, ids, outputs, finished, cached, metrics))
        return outs

    def _report_end(self, cause: BaseException) -> None:
        if self._ended:
            return
        self._ended = True
        self._sink.stopped(cause)
        if self._on_failure is not None and not self._closing:
            self._on_failure(f"the engine process stopped: {cause!r}")

    # ---- what AsyncLLMEngine reads from its engine -------------------------------------------
    def get_stats(self) -> EngineStats:
        return self._stats

    def check_health(self) -> None:
        if not self._proc.is_alive():
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode})")

    def set_on_failure(self, fn) -> None:
        self._on_failure = fn


class _PipeSink:
    """The engine process's side of AsyncLLMEngine's sink interface: one message an event."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._last_stats: EngineStats | None = None

    def send(self, *msg) -> None:
        self._conn.send_bytes(_dumps(msg))

    def wants(self, request_id: str) -> bool:
        return True  # the server process sends an abort for a caller that left

    def request_failed(self, request_id: str, err: BaseException) -> None:
        self.send("request_failed", request_id, _portable(err, ValueError))

    def added(self, stats: EngineStats) -> None:
        self._last_stats = stats
        self.send("added", stats)

    def step_done(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        if outputs or stats != self._last_stats:
            self._last_stats = stats
            self.send("step", pack_outputs(outputs), stats)

    def stopped(self, cause: BaseException) -> None:
        try:
            self.send("stopped", _portable(cause))
        except OSError:
            pass  # the server is gone


def run_engine_core(conn, cfg: EngineConfig, log_level: int, log_format: str | None) -> None:
    """The engine process: load the engine, report it ready (or why not), then run its step
    loop and feed it the server's commands until told to stop or the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=log_format or logging.BASIC_FORMAT)
    sys.setswitchinterval(envs.gil_switch_interval_s())  # as the server's (server.launch)
    sink = _PipeSink(conn)
    try:
        engine = LLMEngine(cfg)
    except BaseException as e:  # noqa: BLE001 - the server process raises it
        sink.send("failed", _portable(e))
        conn.close()
        return
    sink.send("ready", {
        "config": engine.config, "spec": engine.spec, "model_config": engine.model_config,
        "vocab_size": engine.vocab_size, "eos_token_ids": engine.eos_token_ids,
        "model_dir": engine.model_dir, "tokenizer": engine.tokenizer is not None,
        "weights": describe_weights(engine.model, engine.model_config),
        "stats": engine.get_stats(),
    })  # fmt: skip
    loop = EngineLoop(engine, sink)
    loop.start()
    while True:
        try:
            kind, *rest = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the server process is gone
            break
        if kind == "add":
            loop.submit_add(*rest)
        elif kind == "abort":
            loop.submit_abort(rest[0])
        else:  # "stop"
            break
    if loop.stop(STOP_TIMEOUT_S):
        engine.shutdown()
    conn.close()
