"""The CPU part of one hybrid MoE layer's step and how the GPU waits for it (KT-Kernel's
submit_forward / sync_forward).

Owns: `HostJob` (one step's CPU part of one layer: pinned buffers and the host actions) and
`drive` (runs a pieces generator eagerly).

Two ways to wait, same numerics (the CPU writes `out`, the GPU adds `out` to its part):
- host wait (eager steps, and graphs where stream waits are unavailable): the layer yields
  `start`, enqueues the GPU part, yields `finish`; `finish` waits for the staged inputs, runs
  the CPU experts on the calling thread while the GPU part runs, and writes `out`; the work
  after it (the copy of `out` back, the add, the next layers) is launched only then, so a
  graph step is cut into 1 + 2n pieces with a host round trip between.
- device wait (`HybridExpertBackend.device_wait`, set while a graph runner captures): the
  layer yields only `launch`, then enqueues the GPU part, a stream wait on the layer's
  `signal` (kernels.stream_wait.CudaHostSignal) and the rest. A step is 1 + n pieces, all
  launched at once; `launch` records an event after the staged inputs and queues the job; after
  the last piece is launched the runner calls `complete()` on the queued jobs in layer order:
  each waits for its event, runs the CPU experts, writes `out` and releases the signal, and the
  GPU, which went on with the shared expert and the GPU experts, resumes within a PCIe poll:
  no launch, no Python between the CPU's result and the next layer's attention.
The copies in and out are memcpys, or with zero-copy (HybridExpertBackend.reserve,
kernels.zero_copy) one kernel storing the inputs into the pinned buffers and one reading
`out` fused with the add (`add_result`); the host actions are the same either way.
The main thread is the CPU worker in both: it has nothing else to do during a step, so no
hand-off to another thread (and no GIL contention with a launching thread) is needed; the
native kernel releases the GIL and uses the calling thread as one of its workers.

How the host learns that the staged inputs are in host memory: an event (record /
synchronize), or, when the backend has a `ready_word` (kernels.stream_wait.HostReadyWord), a
number the stream writes into pinned memory after the copies, the host spinning on it; both
are eager host actions, so the choice can change between replays of the same graphs.
One-graph device wait (`HybridExpertBackend.graph_jobs` / `graph_word`, set while a graph
runner captures): the graph itself writes a ready word of the job's own after the staging
copies (`gpu_set`), so nothing is yielded and the step is one graph; the runner then calls
`complete_in_graph()` on the captured jobs in layer order. Fused waits (a job's `handshake`,
kernels.zero_copy "Fused waits"): the staging kernel writes that word and, with spinning
waits, `add_result`'s kernel spins on the signal's flag, which the next step's staging kernel
clears; so a release must never come before that layer's staging kernel ran (it would be
cleared and lost): `unblock` (error recovery) waits for the word first.

Timeline (benchmarks only): when the backend's `trace` is a list, each job appends
(mark, time.perf_counter_ns()) at: "wake" (the CPU pool prewoken / the CPU part submitted on a
CPU device), "sync" (the host starts waiting for the staged inputs), "in" (it sees them in host
memory), "cpu0" / "cpu1" (the CPU experts start / their result is in `out`), "rel" (device
wait: the flag released). The graph runner adds "launch" after each piece it launches (the
host wait's release of the result); benchmarks/hybrid_timeline.py reads the marks. None (the
default): nothing is recorded, one attribute test per mark.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from k2serve.kernels.zero_copy import add_from_host


class HostJob:
    """One step's CPU part of one hybrid layer (see the module docstring). `x`, `ids`, `w`,
    `out` are host tensors [T, ...] (pinned and static when the backend reserved them, so a
    captured graph's copies keep reading and writing them); on a CPU device they are the
    layer's own tensors and `start` submits to the CPU backend's worker thread, so the CPU
    experts overlap the main thread's GPU-part math. `out_mapped`: `out`'s host-mapped CUDA
    view when the backend stages zero-copy (kernels.zero_copy): `add_result` reads it there.
    `handshake`: the kernels.zero_copy.Handshake the staging kernel was given (fused waits)."""

    def __init__(self, backend, x, ids, w, out, cuda: bool, out_mapped=None,
                 handshake=None) -> None:  # fmt: skip
        self.backend = backend
        self.x, self.ids, self.w, self.out = x, ids, w, out
        self.out_mapped = out_mapped
        self.handshake = handshake  # fused waits: the staging kernel's Handshake (or None)
        self.staged_seen = False  # this step's staged inputs seen (the runner clears it)
        self.cuda = cuda
        self.event = torch.cuda.Event() if cuda else None
        self.signal = backend.signal  # device wait: the one this job's graph waits on
        self._seq: int | None = None  # the staged inputs' number in backend.ready_word
        self.graph_word: Any = None  # one-graph device wait: the word its graph writes

    def _record_staged(self, record) -> None:
        """Mark the point after the staging copies: the backend's `ready_word` when it has
        one (kernels.stream_wait.HostReadyWord: the GPU writes a number into pinned memory,
        the host spins on it), else `record()` (an event)."""
        word = self.backend.ready_word
        self._seq = None if word is None else word.record()
        if word is None:
            record()

    def _wait_staged(self, wait) -> None:
        """Until the staged inputs are in host memory (the same way they were marked)."""
        if self._seq is None:
            wait()
        else:
            self.backend.ready_word.wait(self._seq)

    def _mark(self, name: str) -> None:
        trace = self.backend.trace  # see "Timeline" in the module docstring
        if trace is not None:
            trace.append((name, time.perf_counter_ns()))

    def _wake(self) -> None:
        """The CPU experts' threads spin from now until the CPU part is submitted."""
        self.backend.cpu_backend.prewake()
        self._mark("wake")

    def _compute(self) -> None:
        """The CPU experts on this thread, their result in `out` (the staged inputs are in
        host memory)."""
        self._mark("cpu0")
        self.backend.cpu_backend.submit(self.x, self.ids, self.w, inline=True, out=self.out)
        self._collect()

    def _collect(self) -> None:
        """The CPU part's result into `out` (the kernel wrote it there already when it could:
        no copy on torch's threads)."""
        res = self.backend.cpu_backend.wait()
        if res.data_ptr() != self.out.data_ptr():
            self.out.copy_(res)
        self._mark("cpu1")

    # ------------------------------------------------------------------ host wait
    def start(self) -> None:
        if self.backend.dry_run:
            return
        if self.event is not None:
            self._record_staged(self.event.record)
            self._wake()  # its threads spin until finish() submits
        else:
            for mark in ("wake", "in", "cpu0"):  # on the CPU backend's worker thread from here
                self._mark(mark)
            self.backend.cpu_backend.submit(self.x, self.ids, self.w, out=self.out)

    def finish(self) -> None:
        if self.backend.dry_run:  # a warm-up pass: the CPU part contributes zeros
            self.out.zero_()
            return
        if self.event is None:  # submitted by start()
            self._collect()
            return
        self._mark("sync")
        self._wait_staged(self.event.synchronize)  # the staged inputs are in host memory
        self._mark("in")
        self._compute()

    # ------------------------------------------------------------------ device wait
    def launch(self) -> None:
        """Host action between graph pieces: mark the staged inputs, queue the job."""
        self._record_staged(self.signal.record)
        self._wake()
        self.backend.deferred.append(self)

    def complete(self) -> None:
        """Wait for the staged inputs, compute the CPU part into `out`, release the GPU (also
        when the CPU part raised: the stream must not stay blocked)."""
        self._complete(lambda: self._wait_staged(self.signal.wait_recorded))

    def complete_in_graph(self) -> None:
        """One-graph device wait (model.cuda_graph: the whole step one graph): the graph writes
        this job's `graph_word` after its staging copies; wake the CPU pool, wait for that
        word (and clear it), then as `complete`."""
        self._wake()
        self._complete(self.graph_word.wait_set)

    @property
    def waits_in_kernel(self) -> bool:
        """True when `add_result`'s kernel itself waits for the flag (fused spinning wait)."""
        return self.handshake is not None and self.handshake.flag is not None

    def _complete(self, wait_staged) -> None:
        try:
            self._mark("sync")
            wait_staged()
            self.staged_seen = True
            self._mark("in")
            if self.backend.dry_run:
                self.out.zero_()
            else:
                self._compute()
        finally:  # (fused, inputs not seen: a release now could be cleared; see unblock)
            if self.staged_seen or not self.waits_in_kernel:
                self.signal.release()
            self._mark("rel")

    def unblock(self, wait: bool = True) -> bool:
        """Error recovery (model.cuda_graph, after a step raised; jobs in layer order): release
        the GPU's wait for this job so that the stream drains. With a fused spinning wait the
        staging kernel clears the flag, so first wait until it ran (its word), unless that
        was seen this step or `wait` is False (the graph was not launched, or an earlier
        layer's word never came); if the word does not come, release anyway (nothing
        better). -> whether later jobs should still wait (False once a word did not come)."""
        if self.waits_in_kernel and not self.staged_seen and wait:
            try:
                self.graph_word.wait_set()
                self.staged_seen = True
            except RuntimeError:
                wait = False
        self.signal.release()
        return wait

    def add_result(self, gpu_out: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        """gpu_out + the CPU part's `out`, enqueued after the wait for it: one kernel reading
        `out` through its host-mapped address (zero-copy), else `out` copied to the device and
        added (also on a CPU device, where the copy is none)."""
        if self.out_mapped is not None:  # (fused: the kernel spins on the flag first)
            flag = self.handshake.flag if self.handshake is not None else None
            return add_from_host(gpu_out, self.out_mapped, wait_flag=flag)
        return gpu_out + self.out.to(gpu_out.device, gpu_out.dtype, non_blocking=True)


def drive(gen):
    """Run a pieces generator eagerly: each yielded host action is called where it was
    yielded; returns the generator's return value."""
    try:
        while True:
            next(gen)()
    except StopIteration as stop:
        return stop.value


__all__ = ["HostJob", "drive"]
