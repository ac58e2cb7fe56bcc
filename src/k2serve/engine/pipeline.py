"""Async scheduling (vLLM's `--async-scheduling`): the engine's host work overlaps the model.

With it on, `LLMEngine.step()` schedules and prepares step N+1 while step N computes on the
`k2serve-step` thread (`StepWorker`), then processes step N's samples (stop checks,
detokenizing, outputs) while step N+1 computes. A one-deep pipeline:

    engine thread:  schedule N+1 | prepare N+1 | submit | wait N | outputs of N | schedule N+2 ...
    step thread:    ... forward + sample N ...| forward + sample N+1 ...

On CUDA the step thread launches ahead (`StepWorker`'s docstring): it queues each step's kernels
as soon as the step is submitted and a `k2serve-result` thread waits for the samples, so the GPU
runs N+1 right after N with no host hop between them (H100, served k2-slice: C=1 395 -> 517 and
C=16 2194 -> 2521 output tok/s, benchmarks/RESULTS.md; `K2SERVE_LAUNCH_AHEAD=0` turns it off).

The scheduler counts the token that step N samples for each request as a placeholder
(`Request.num_output_placeholders`, engine.scheduler's docstring), and the runner fills the
placeholder inputs of step N+1 from step N's sampled-token tensor on the device
(`ModelInput.fill`): the worker runs steps in order, so step N's tokens exist when N+1 starts.
Outputs are one step behind the model, tokens are the same: a request found finished by step N
(stop token, stop string, max_tokens, abort) drops the token step N+1 computed for it.

What the host must know before the next step runs cannot be overlapped:
- engine-wide (decided once, `resolve_async_scheduling`, logged at start-up): tensor parallel
  (the workers step in lock-step with the executor), data-parallel ranks (lock-step MoE
  collectives), speculative decoding (drafts are proposed from the step's accepted tokens), the
  host KV tier (copies are planned per step against the step's outcome) and image inputs (the
  encoder's rows are taken from the scheduled requests' progress);
- per request (`needs_sync`): repetition / frequency / presence penalties, min_tokens, logits
  processors (other than token bans and logit biases) and structured outputs read the previous
  token on the host; while such a request
  is unfinished the engine drains the pipeline and steps synchronously.

Scheduling late: a step scheduled ahead is fixed before requests that arrive while the step
before computes, so they would wait one step more than in the synchronous engine (their prefill
in the step after next). So the server schedules the next step only shortly before the one in
flight is expected to end (`StepWorker.schedule_delay`: a least-squares model of the measured
step times, minus twice the host's own time to schedule and prepare, minus 0.5 ms), draining
the requests that arrived meanwhile. If the model overestimates, the wait ends when the step
does (the synchronous engine's gap for that step). On the served rig this also raised
throughput (C=16 0.91 -> 0.95 of the ideal: the step thread's launch no longer competes with the
scheduling for the GIL).

The GIL: the engine thread's Python (and the server's event loop) runs while the step thread
waits on the device, and the step thread needs the GIL again for each launch after a wait. With
CPython's default switch interval (5 ms) a busy thread can hold it that long before handing it
over, so the step thread lowers the interpreter's switch interval to envs.gil_switch_interval_s()
(0.1 ms; the served rig at C=256: 0.89 -> 0.94 of the ideal at 0.5 ms, benchmarks/RESULTS.md).

Invariants: one step at most in flight; only the engine thread touches requests, the scheduler
and the KV cache manager (the step thread runs the model and the sampler on a prepared batch);
a step's samples are applied exactly once, in step order.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future

import numpy as np
import torch

from k2serve import envs
from k2serve.engine.logits_processors import BanTokens, LogitBias
from k2serve.engine.request import Request
from k2serve.engine.runner import ModelInput
from k2serve.engine.sampler import PendingSample, SamplerOutput
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# where `--async-scheduling` is on when not given: CUDA with every expert on the GPU (H100 served
# C=16 1704 -> 2015, C=256 4052 -> 4298 out tok/s). Not on the CPU, where the engine thread's
# overlap competes with the forward's threads for the same cores (tiny model, 2-core dev CPU,
# C=16: 2153-2207 sync vs 1776-1804 async out tok/s), nor with CPU experts (their threads share
# the host's cores too; not measured): the flag turns it on there.
ASYNC_SCHEDULING_DEFAULT_DEVICES = ("cuda",)

# logits processors that do not read the output so far
_HISTORY_FREE = (BanTokens, LogitBias)
_RIDGE = np.diag([1e-6, 1e-9, 1e-12])  # feature scales: 1, decodes, prompt tokens

SYNC_REQUEST_FEATURES = (
    "penalties, min_tokens, logits processors (not bans or logit_bias) and structured outputs "
    "(they read the previous token on the host)"
)


def resolve_async_scheduling(
    asked: bool | None,
    *,
    tp_size: int,
    model,
    speculative: bool,
    host_tier: bool,
    device_type: str = "cuda",
    cpu_experts: bool = False,
) -> tuple[bool, str]:
    """(on, why) for the RuntimeSpec: `asked` is the flag (None: on for the devices of
    ASYNC_SCHEDULING_DEFAULT_DEVICES without CPU-placed experts)."""
    if asked is False:
        return False, "off (--no-async-scheduling)"
    if asked is None and (device_type not in ASYNC_SCHEDULING_DEFAULT_DEVICES or cpu_experts):
        where = "experts on the CPU" if cpu_experts else f"a {device_type} device"
        return False, f"off (the default with {where}; --async-scheduling turns it on)"
    blockers = []
    if tp_size > 1:
        blockers.append("tensor parallel (the workers step in lock-step)")
    if getattr(model, "ep_context", None) is not None:
        blockers.append("data-parallel ranks (lock-step MoE collectives)")
    if speculative:
        blockers.append("speculative decoding (drafts come from the step's tokens)")
    if host_tier:
        blockers.append("the KV host tier (copies are planned from each step's outcome)")
    if getattr(getattr(model, "config", None), "vision", None) is not None:
        blockers.append("image inputs (the encoder reads the scheduled progress)")
    if blockers:
        return False, "off: steps run one after another with " + "; ".join(blockers)
    return True, "on; steps of requests using " + SYNC_REQUEST_FEATURES + " run synchronously"


def needs_sync(params: SamplingParams) -> bool:
    """Whether a request's sampling reads its previous token on the host (module docstring).
    Token bans and logit biases do not (the chat API bans the tool-call markers of every request
    without tools)."""
    return bool(
        params.needs_penalties
        or params.min_tokens
        or any(not isinstance(p, _HISTORY_FREE) for p in params.logits_processors)
        or params.structured_outputs is not None
    )


class InFlight:
    """A step submitted to the worker: its schedule, its batch and its result to come."""

    __slots__ = ("sched", "inp", "future", "rows", "started", "launched")

    def __init__(self, sched: SchedulerOutput, inp: ModelInput, future: Future) -> None:
        self.sched = sched
        self.inp = inp
        self.future = future
        self.started: float | None = None  # perf_counter when the worker started it
        # set once its device work is queued (the sampler's host sync comes next) or it ended
        self.launched = threading.Event()
        # id(request) -> its sampler row (where the next step's placeholders read)
        self.rows = {id(r): i for i, r in enumerate(inp.sample_reqs)}

    def result(self) -> tuple[list[Request], SamplerOutput | None]:
        return self.future.result()


class StepWorker:
    """Runs prepared steps in submission order on the `k2serve-step` thread; each step gets the
    samples of the one before (the source of its placeholder tokens). After a failure every
    later step fails with the same error.

    Launch ahead (CUDA; `launch_ahead`): the step thread only queues each step's kernels, its
    samples' device->host copies and an event (sampler.PendingSample), and hands the step to
    the `k2serve-result` thread, which waits for that event and completes the step's future.
    So step N+1's kernels are queued as soon as the engine submits it, behind step N's on the
    device, instead of after step N's host sync: the GPU goes from N to N+1 with no host hop
    (the step thread's wake-up, its GIL and the launches after each sync were a gap of every
    step, that grew with the event loop's and the engine thread's Python at large batches)."""

    def __init__(self, runner, launch_ahead: bool | None = None) -> None:
        self.runner = runner
        self.inflight: InFlight | None = None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._prev: SamplerOutput | None = None
        self._error: BaseException | None = None
        self._running: InFlight | None = None  # the step the worker is on
        # CUDA: the engine thread lets the step thread queue the next step's kernels before it
        # takes the GIL for the outputs (the GPU would wait for that launch); on the CPU the
        # forward runs inside the launch, so nothing waits for it
        self.cuda = getattr(getattr(runner, "device", None), "type", None) == "cuda"
        if self.cuda:
            runner.sampler.on_launched = self._on_launched
        self.launch_ahead = (
            (self.cuda and envs.launch_ahead()) if launch_ahead is None else launch_ahead
        )
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # launched steps, in order
        self._result_thread: threading.Thread | None = None
        self._last_done = 0.0  # perf_counter when the last step's samples reached the host
        self._result_error: BaseException | None = None
        # step-time model for schedule_delay: seconds = c0 + c1 * decodes + c2 * prompt tokens,
        # least squares over the recent steps (normal equations, forgetting 0.98); and an EWMA
        # of the engine thread's schedule + prepare time
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.host_s = 0.0

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def submit(self, sched: SchedulerOutput, inp: ModelInput) -> InFlight | None:
        """Queue a step; returns the step that was in flight before it (to be processed)."""
        if self._thread is None:
            want = envs.gil_switch_interval_s()
            if sys.getswitchinterval() > want:
                logger.info("async scheduling: GIL switch interval %.1f -> %.1f ms",
                            sys.getswitchinterval() * 1e3, want * 1e3)  # fmt: skip
                sys.setswitchinterval(want)
            self._thread = threading.Thread(target=self._loop, name="k2serve-step", daemon=True)
            self._thread.start()
            if self.launch_ahead:
                self._result_thread = threading.Thread(
                    target=self._result_loop, name="k2serve-result", daemon=True
                )
                self._result_thread.start()
        fut: Future = Future()
        step = InFlight(sched, inp, fut)
        self._q.put(step)
        prev, self.inflight = self.inflight, step
        return prev

    def _on_launched(self) -> None:
        step = self._running
        if step is not None:
            step.launched.set()

    def wait_launched(self, timeout: float = 2e-3) -> None:
        """CUDA: wait (at most `timeout` s) until the step in flight's kernels are queued."""
        step = self.inflight
        if self.cuda and step is not None:
            step.launched.wait(timeout)

    def note_host_time(self, seconds: float) -> None:
        self.host_s += 0.2 * (seconds - self.host_s)

    def schedule_delay(self) -> float:
        """Seconds to wait before scheduling the next step (module docstring): until shortly
        before the step in flight is expected to end; 0 if it is not running."""
        step = self.inflight
        if step is None or step.started is None or step.future.done():
            return 0.0
        expected = self.expected_seconds(step.sched)
        due = step.started + 0.9 * expected - 2 * self.host_s - 0.5e-3
        return max(0.0, due - time.perf_counter())

    def wait(self, timeout: float) -> None:
        """Wait up to `timeout` s for the step in flight (returns early when it is done)."""
        step = self.inflight
        if step is not None and timeout > 0:
            try:
                step.future.exception(timeout=timeout)
            except TimeoutError:
                pass

    @staticmethod
    def _features(sched: SchedulerOutput) -> np.ndarray:
        decodes = sched.num_decodes
        return np.array([1.0, decodes, sched.num_batched_tokens - decodes])

    def expected_seconds(self, sched: SchedulerOutput) -> float:
        """The step time model's estimate for a step (0 until it has seen steps)."""
        coef = np.linalg.solve(self._xtx + _RIDGE, self._xty)  # the ridge: never singular
        return max(0.0, float(coef @ self._features(sched)))

    def _learn(self, sched: SchedulerOutput, seconds: float) -> None:
        x = self._features(sched)
        self._xtx = 0.98 * self._xtx + np.outer(x, x)
        self._xty = 0.98 * self._xty + x * seconds

    def take(self) -> InFlight | None:
        prev, self.inflight = self.inflight, None
        return prev

    def _loop(self) -> None:
        dev = getattr(self.runner, "device", None)
        if dev is not None and dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)  # kernels that launch on the thread's current device
        while True:
            step = self._q.get()
            if step is None:
                return
            if self._error is not None:
                step.future.set_exception(self._error)
                continue
            step.started = t0 = time.perf_counter()  # launch ahead: moved to its real start
            self._running = step
            try:
                reqs, samples = self.runner.run(
                    step.sched, step.inp, self._prev, defer=self.launch_ahead
                )
            except BaseException as e:  # noqa: BLE001 - handed to the engine thread
                self._error = e
                step.future.set_exception(e)
                continue
            finally:
                self._running = None
                step.launched.set()
            self._prev = samples
            if self.launch_ahead:
                self._results.put((step, reqs, samples))
                continue
            self._learn(step.sched, time.perf_counter() - t0)
            step.future.set_result((reqs, samples))

    def _result_loop(self) -> None:
        """Launch ahead: wait for each launched step's samples, in order, and complete it."""
        while True:
            item = self._results.get()
            if item is None:
                return
            step, reqs, pending = item
            if self._result_error is not None:  # every step after a failed one fails too
                step.future.set_exception(self._result_error)
                continue
            try:
                samples = pending.result() if isinstance(pending, PendingSample) else pending
            except BaseException as e:  # noqa: BLE001 - a device error surfaces at the wait
                self._result_error = e
                self._error = self._error or e  # and the steps not launched yet
                step.future.set_exception(e)
                continue
            done = time.perf_counter()
            # the step ran on the device from when it was queued or the one before it ended
            started = max(step.started or done, self._last_done)
            self._last_done = done
            nxt = self.inflight  # queued behind this one: it starts now (schedule_delay)
            if nxt is not step and nxt is not None and nxt.started is not None:
                nxt.started = max(nxt.started, done)
            self._learn(step.sched, done - started)
            step.future.set_result((reqs, samples))

    def close(self) -> None:
        """Stop the threads after the steps queued; idempotent."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        if self._result_thread is not None:
            self._results.put(None)
            self._result_thread.join(timeout=30)
            self._result_thread = None
