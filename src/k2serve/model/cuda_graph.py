"""Decode CUDA graphs: per batch-size bucket, captured once, largest first, sharing one memory
pool (the nano-vllm scheme); eager fallback for anything outside the buckets.

Piecewise around the host round trip: the model's forward is a generator (`model.pieces`) that
yields a host action wherever a hybrid MoE layer needs the CPU (moe.host_round_trip.HostJob). Each
stretch of GPU work between two yields is captured as its own graph, so a bucket is a list of
graphs [g0, g1, ..., gn] and host actions [a0, ..., a(n-1)], and a step replays
g0, a0, g1, a1, ..., gn. Without CPU experts nothing is yielded: one graph per bucket. The host
actions read and write static (pinned) buffers that the captured copies use, so they are
re-run as they are at every replay. Graphs come from a `graph_factory` (default
`CudaGraphFactory`); tests pass a fake that records and replays torch ops on the CPU.

Device wait (`device_wait`, K2SERVE_HYBRID_DEVICE_WAIT, off by default; used when the factory
gives host signals: CUDA stream memory operations or a spinning kernel, kernels.stream_wait):
each hybrid layer waits for its CPU experts on a flag inside the graph; the GPU runs each
layer's shared expert and GPU experts during the CPU part and resumes the moment the flag is
written. By default (`one_graph`, `spin_wait`) a step is ONE graph: it also writes a ready
word per hybrid layer after its staging copies (kernels.stream_wait.HostReadyWord), so the
host needs no piece boundary to learn a layer's inputs are staged: one launch, then the
layers' CPU parts in order (HostJob.complete_in_graph: spin on the word, compute, release the
flag), and each wait is a one-program kernel spinning on the flag's host-mapped address
(CudaHostSignal(spin=True)) instead of the stream-wait memory operation and its 12-19 us poll.
Where the factory gives no ready words the step is 1 + n pieces, cut where the host must learn
that a layer's inputs are staged (an event), piece i + 1 launched before layer i's CPU part;
where it gives no spinning kernels, stream waits.
Without the device wait (host wait): 1 + 2n pieces, g0, a0, g1, a1, ... with the CPU part
inside a1, the rest launched by the host once the CPU's result is written.
Zero-copy (`zero_copy`, K2SERVE_HYBRID_ZERO_COPY, on by default where its probe passes; any way
of waiting): the captured staging and result are kernels on the pinned buffers' host-mapped
addresses instead of memcpy nodes (moe.hybrid reserve, kernels.zero_copy).
Fused waits (`fused_wait`, K2SERVE_HYBRID_FUSED_WAIT, on by default where its probe passes; one
graph with zero-copy): each layer's staging kernel writes its ready word (kernels.zero_copy.
Handshake): one node a layer fewer. The result kernel can also spin on the flag itself
(Handshake with the flag), but on the H100 that was slower than the separate one-program spin
kernel (GPU part +45 us a step, wave 11 call 8: every program of the result kernel polls over
PCIe), so the runner does not use it.
Measured (benchmarks/hybrid_moe.py, H100 host, RESULTS.md "Hybrid GPU + CPU experts"): the
one graph with spinning waits had the shortest serial part per MoE layer, GPU part and real step
in one run of wave 10 and the longest GPU part and real step in the next; the host wait stays
the default.

Owns: `DecodeGraphRunner`. A decode step = B sequences with one new token each
(`max_query_len == 1`). The runner owns static input buffers sized for the largest bucket; a
step of B <= max bucket is padded to the smallest bucket >= B: padding rows are fake sequences
of length 1 reading page 0 whose `slot_mapping` is -1 (never stored), and their outputs are
dropped. Steps with prefills, more sequences than the largest bucket, or wider block tables run
eagerly through the model.

Invariants: graphs are captured only from `capture()`; the attention backend must not sync with
the host nor change its launch grid with sequence lengths (TritonMLABackend keeps both); the
output returned by `run` is a view into a graph-owned buffer, valid until the next `run`; the
pieces of one bucket are replayed in capture order (they share the pool).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from k2serve import envs
from k2serve.attention.base import AttentionMetadata
from k2serve.moe.host_round_trip import drive

# decode batch sizes captured (up to --max-num-seqs, which is also captured): a step of B
# sequences replays the smallest bucket >= B; above the largest it runs eagerly (at B=256 on
# the 6-layer k2-slice an eager step costs ~9 ms more than a replay). vLLM captures to 512.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CudaGraphFactory:
    """Captures torch.cuda.CUDAGraph objects into one shared memory pool."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn):
        """-> (graph, fn()), the CUDA work fn() enqueues captured in the graph."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            result = fn()
        if self.pool is None:
            self.pool = g.pool()
        return g, result

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def ready_word(self):
        """A GPU -> host ready word (kernels.stream_wait.HostReadyWord), or None where
        unsupported."""
        from k2serve.kernels.stream_wait import HostReadyWord, host_ready_word_supported

        if not host_ready_word_supported(torch.cuda.current_device()):
            return None
        return HostReadyWord()

    def host_signal(self, spin: bool = False):
        """A host -> GPU signal a captured graph can wait on, or None where unsupported
        (`spin`: its wait a spinning kernel, see kernels.stream_wait.CudaHostSignal)."""
        from k2serve.kernels.stream_wait import CudaHostSignal, cuda_host_signal_supported

        if not cuda_host_signal_supported(torch.cuda.current_device(), spin):
            return None
        return CudaHostSignal(spin=spin)

    def spin_signal(self):
        """host_signal(spin=True)."""
        return self.host_signal(spin=True)

    def handshake(self, word, signal):
        """The fused word of one hybrid layer (kernels.zero_copy.Handshake over its ready
        word; no flag: the wait stays the signal's own node, see "Fused waits" above), or None
        where the probe fails."""
        from k2serve.kernels.zero_copy import Handshake, fused_wait_supported

        dev = torch.cuda.current_device()
        if not fused_wait_supported(dev):
            return None
        return Handshake(word.word, None, torch.device("cuda", dev))


def capture_pieces(gen, factory) -> tuple[list, list, Any]:
    """Capture a pieces generator: -> (graphs, host actions, the generator's return value);
    len(graphs) == len(host actions) + 1. Host actions are not run while capturing."""
    graphs: list = []
    actions: list = []

    def step():
        try:
            return False, next(gen)
        except StopIteration as stop:
            return True, stop.value

    while True:
        g, (done, value) = factory.capture(step)
        graphs.append(g)
        if done:
            return graphs, actions, value
        actions.append(value)


def replay_pieces(graphs, actions, trace: list | None = None) -> None:
    """Replay g0, a0, g1, ..., gn; `trace` (benchmarks): ("launch", perf_counter_ns) appended
    after each piece is launched (moe.host_round_trip's timeline)."""
    for g, act in zip(graphs, actions, strict=False):
        g.replay()
        if trace is not None:
            trace.append(("launch", time.perf_counter_ns()))
        act()
    graphs[-1].replay()
    if trace is not None:
        trace.append(("launch", time.perf_counter_ns()))


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        max_pages_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        with_logits: bool = False,
        graph_factory=None,
        device_wait: bool | None = None,  # None: K2SERVE_HYBRID_DEVICE_WAIT (see the docstring)
        ready_words: bool = False,  # the staged inputs marked by ready words, not events
        one_graph: bool = True,  # device wait as one graph per step (see the docstring)
        spin_wait: bool = True,  # device wait: a spinning kernel waits, not the stream
        zero_copy: bool | None = None,  # hybrid staging / result through host-mapped memory
        fused_wait: bool | None = None,  # one graph: the word / wait inside those kernels
    ) -> None:  # (None: K2SERVE_HYBRID_ZERO_COPY / _FUSED_WAIT; moe.hybrid reserve)
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = kv_caches[0].shape[1]
        self.max_pages = max_pages_per_seq
        self.buckets = tuple(sorted(set(buckets)))
        self.with_logits = with_logits
        n, dev = self.buckets[-1], kv_caches[0].device
        i32: dict[str, Any] = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.context_lens = torch.zeros(n, **i32)
        self.block_table = torch.zeros(n, max_pages_per_seq, **i32)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.factory = graph_factory if graph_factory is not None else CudaGraphFactory()
        self.graphs: dict[int, list] = {}  # bucket -> its pieces' graphs, in replay order
        self.actions: dict[int, list] = {}  # bucket -> host actions between the pieces
        self.outputs: dict[int, torch.Tensor] = {}
        # EAGLE-3: each bucket's graph-owned [bucket, 3 * hidden] auxiliary hidden states, when
        # the model keeps them (model.aux_hidden_state_layers); set as the model's after a replay
        self.aux: dict[int, torch.Tensor | None] = {}
        self.device_wait = envs.hybrid_device_wait() if device_wait is None else device_wait
        self.ready_words = ready_words
        self.one_graph = one_graph
        self.spin_wait = spin_wait
        self.zero_copy = zero_copy
        self.fused_wait = fused_wait
        self._graph_words: list = []  # one graph: each hybrid layer's word, layer order
        self._handshakes: list = []  # fused waits: each hybrid layer's Handshake, layer order
        self.jobs: dict[int, list] = {}  # one graph: bucket -> its captured jobs, layer order
        self._waiting: list = []  # (hybrid backend, its signal) whose GPU waits, layer order
        # benchmarks: a list for the step's timeline marks (also set as the hybrid backends'
        # `trace`; moe.host_round_trip); None: nothing recorded
        self.trace: list | None = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_pages * self.page_size,
            page_size=self.page_size,
            num_decodes=bs,
        )

    def _pieces(self, bs: int):
        md = self._metadata(bs)
        h = yield from self.model.pieces(self.input_ids[:bs], self.positions[:bs], md,
                                         self.kv_caches)  # fmt: skip
        return self.model.compute_logits(h) if self.with_logits else h

    @property
    def num_pieces(self) -> dict[int, int]:
        """bucket -> graphs per step (1 without CPU experts; per hybrid MoE layer 2 more, or 1
        with the device wait)."""
        return {bs: len(g) for bs, g in self.graphs.items()}

    @property
    def waits_in_graph(self) -> bool:
        """True when the hybrid layers' GPU waits for the CPU experts inside the graphs."""
        return bool(self._waiting)

    def _reserve_host_buffers(self) -> None:
        """Static pinned buffers of the hybrid MoE layers, sized for the largest bucket, and
        how the graphs captured next move data through them (zero-copy or memcpys)."""
        cfg = self.model.config
        for layer in self.model.model.layers:
            reserve = getattr(getattr(layer.mlp, "expert_backend", None), "reserve", None)
            if reserve is not None:
                reserve(self.buckets[-1], cfg.hidden_size, cfg.num_experts_per_tok,
                        self.model.dtype, zero_copy=self.zero_copy)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        if self.graphs:
            raise RuntimeError("DecodeGraphRunner.capture() was already called")
        self._reserve_host_buffers()
        backends = [getattr(ly.mlp, "expert_backend", None) for ly in self.model.model.layers]
        hybrid: list[Any] = [be for be in backends if hasattr(be, "dry_run")]
        self._waiting = self._host_signals(hybrid)
        self._set_ready_words(hybrid)
        self._graph_words = self._make_graph_words(hybrid)
        self._handshakes = self._make_handshakes()
        for be, hs in zip(hybrid, self._handshakes, strict=False):
            be.graph_handshake = hs  # (the warm-up launches the fused kernels once: compiled)
        try:
            for bs in reversed(self.buckets):
                self._capture_bucket(bs, hybrid)
        finally:
            for be in hybrid:
                be.graph_handshake = None
        self.factory.synchronize()

    def _capture_bucket(self, bs: int, hybrid: list) -> None:
        """Warm up, then capture, the step of bucket `bs` (see capture)."""
        for be in hybrid:  # the CPU experts are not needed to warm up the GPU pieces
            be.dry_run = True
        try:
            drive(self._pieces(bs))  # warm-up: compiles kernels, sizes the caching allocator
        finally:
            for be in hybrid:
                be.dry_run = False
        self.factory.synchronize()
        jobs: list = []
        for be, _ in self._waiting:
            be.device_wait = True
        for be, word in zip(hybrid, self._graph_words, strict=False):
            be.graph_jobs, be.graph_word = jobs, word
        try:
            graphs, actions, out = capture_pieces(self._pieces(bs), self.factory)
        finally:
            for be, _ in self._waiting:
                be.device_wait = False
                be.deferred.clear()
            for be in hybrid:
                be.graph_jobs = be.graph_word = None
        self.graphs[bs], self.actions[bs], self.outputs[bs] = graphs, actions, out
        if self._graph_words:
            self.jobs[bs] = jobs
        if getattr(self.model, "aux_hidden_state_layers", ()):
            self.aux[bs] = self.model.aux_hidden_states

    def _host_signals(self, hybrid: list) -> list:
        """Give each hybrid backend a host signal (device wait), or none of them; -> the
        [(backend, signal)] this runner's graphs wait on."""
        make = getattr(self.factory, "host_signal", None)
        if not (hybrid and self.device_wait and make is not None):
            return []
        spin = getattr(self.factory, "spin_signal", None) if self.spin_wait else None
        signals = [spin() for _ in hybrid] if spin is not None else []
        if not signals or any(s is None for s in signals):  # no spin kernels: stream waits
            signals = [make() for _ in hybrid]
        if any(s is None for s in signals):
            return []
        for be, sig in zip(hybrid, signals, strict=True):
            be.signal = sig  # the jobs captured from here on keep theirs
        return list(zip(hybrid, signals, strict=True))

    def _set_ready_words(self, hybrid: list) -> None:
        """Each hybrid backend's ready word (moe.host_round_trip: how the host learns that
        the staged inputs are in host memory), when asked and the factory gives them: all or
        none. Eager host actions read it at every replay, so nothing captured depends on it."""
        make = getattr(self.factory, "ready_word", None)
        if not (hybrid and self.ready_words and make is not None):
            return
        words = [make() for _ in hybrid]
        if any(w is None for w in words):
            return
        for be, w in zip(hybrid, words, strict=True):
            be.ready_word = w

    def _make_graph_words(self, hybrid: list) -> list:
        """One graph per step (`one_graph`, with the device wait): a ready word per hybrid
        layer, which its graph writes after the staging copies, from the factory (all or
        none: [] keeps the 1 + n pieces)."""
        make = getattr(self.factory, "ready_word", None)
        if not (self._waiting and self.one_graph and make is not None):
            return []
        words = [make() for _ in hybrid]
        return [] if any(w is None for w in words) else words

    def _make_handshakes(self) -> list:
        """Fused waits (`fused_wait`, one graph, every hybrid layer zero-copy): each layer's
        kernels.zero_copy.Handshake over its graph word and host signal, from the factory
        (all or none: [] keeps the separate nodes)."""
        make = getattr(self.factory, "handshake", None)
        fused = envs.hybrid_fused_wait() if self.fused_wait is None else self.fused_wait
        if not (self._graph_words and fused and make is not None):
            return []
        if not all(getattr(be, "zero_copy", False) for be, _ in self._waiting):
            return []
        hs = [make(w, sig) for w, (_, sig) in zip(self._graph_words, self._waiting, strict=True)]
        return [] if any(h is None for h in hs) else hs

    @property
    def fused_waits(self) -> bool:
        """True when the graphs' staging / result kernels carry the waits (see the docstring)."""
        return bool(self._handshakes)

    def _replay(self, bucket: int) -> None:
        """Launch the bucket's pieces; with the device wait, then the CPU parts in layer
        order (each releases its layer's GPU wait). On an error every signal is released, the
        device drained and the signals re-armed: the stream never stays blocked, and no flag
        is left set for the next step."""
        trace = self.trace
        if not self._waiting:
            replay_pieces(self.graphs[bucket], self.actions[bucket], trace)
            return
        graphs, actions = self.graphs[bucket], self.actions[bucket]
        jobs = self.jobs.get(bucket) or []
        for job in jobs:
            job.staged_seen = False
        launched = False
        try:
            if jobs:  # one graph: the CPU parts in layer order, each on its graph's word
                graphs[0].replay()
                launched = True
                if trace is not None:
                    trace.append(("launch", time.perf_counter_ns()))
                for job in jobs:
                    job.complete_in_graph()
                return
            # piece i + 1 (the shared expert and GPU experts of layer i, then the wait on its
            # flag) is launched before layer i's CPU part, and no later piece: the CPU starts
            # after one graph launch, not after all of them
            graphs[0].replay()
            if trace is not None:
                trace.append(("launch", time.perf_counter_ns()))
            for act, g in zip(actions, graphs[1:], strict=True):
                act()
                g.replay()
                if trace is not None:
                    trace.append(("launch", time.perf_counter_ns()))
                for be, _ in self._waiting:
                    be.complete_deferred()
        except BaseException:
            for job in jobs:  # in layer order, each once its staging ran (HostJob.unblock)
                launched = job.unblock(wait=launched)  # (a word missing: the rest won't come)
            for be, sig in self._waiting:
                be.deferred.clear()
                sig.release()
            self.factory.synchronize()
            for _, sig in self._waiting:
                sig.reset()
            for word in self._graph_words:
                word.reset()
            raise

    def bucket_for(self, md: AttentionMetadata) -> int | None:
        """The graph bucket for this step, or None if it must run eagerly."""
        bs = md.num_seqs
        if not self.graphs or md.max_query_len != 1 or md.num_tokens != bs:
            return None
        if bs > self.buckets[-1] or md.block_table.shape[1] > self.max_pages:
            return None
        return next(b for b in self.buckets if b >= bs)

    @torch.inference_mode()
    def run(self, input_ids, positions, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] (or logits [B, vocab] with with_logits) for this step."""
        bucket = self.bucket_for(md)
        if bucket is None:
            h = self.model(input_ids, positions, md, self.kv_caches)
            return self.model.compute_logits(h) if self.with_logits else h
        bs = md.num_seqs
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.seq_lens[:bs].copy_(md.seq_lens)
        self.context_lens[:bs].copy_(md.context_lens)
        w = md.block_table.shape[1]
        self.block_table[:bs, :w].copy_(md.block_table)
        self.slot_mapping[:bs].copy_(md.slot_mapping)
        if bucket > bs:  # padding rows: length-1 sequences on page 0, never stored
            self.seq_lens[bs:bucket].fill_(1)
            self.context_lens[bs:bucket].zero_()
            self.slot_mapping[bs:bucket].fill_(-1)
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
        rec = getattr(self.model, "routing_recorder", None)
        if rec is not None:  # padding rows must not count as routed tokens
            rec.mark_padding(bs, bucket)
        self._replay(bucket)
        if rec is not None:
            rec.unmark_padding(bs, bucket)
        aux = self.aux.get(bucket)
        if aux is not None:
            self.model.aux_hidden_states = aux[:bs]
        return self.outputs[bucket][:bs]


__all__ = [
    "CudaGraphFactory",
    "DEFAULT_BUCKETS",
    "DecodeGraphRunner",
    "capture_pieces",
    "replay_pieces",
]
