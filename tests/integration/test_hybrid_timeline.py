"""The hybrid decode step's timeline (issue 33 items 4-5): the host marks a step's CPU parts
leave (moe.host_round_trip, model.cuda_graph) in both ways of waiting, on the CPU fakes, and
the arithmetic of benchmarks/hybrid_timeline.py (per-layer period and its parts, the full K2
extrapolated) on a trace with known times."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from k2serve.model.cuda_graph import DecodeGraphRunner

from .conftest import needs_cuda
from .fake_graphs import StreamTapeGraphFactory
from .test_piecewise_graphs import (
    PAGES,
    _caches,
    _cuda_decode_md,
    _cuda_runner,
    _decode_md,
    _model,
    _stream_runner,
)

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def tlm():
    sys.path.insert(0, BENCH)
    try:
        import hybrid_timeline
    finally:
        sys.path.remove(BENCH)
    return hybrid_timeline


# one host-wait step of 2 MoE layers, times in ms: CPU experts 2.0 then 1.9, result -> launch
# 0.04, the GPU's next attention + router + D2H seen 0.32 later, submit 0.01
STEP = [("step0", 0.0), ("launch", 0.01), ("wake", 0.02), ("launch", 0.03), ("sync", 0.04),
        ("in", 0.30), ("cpu0", 0.31), ("cpu1", 2.31), ("launch", 2.35), ("wake", 2.36),
        ("launch", 2.37), ("sync", 2.38), ("in", 2.67), ("cpu0", 2.68), ("cpu1", 4.58),
        ("launch", 4.62), ("step1", 5.00)]  # fmt: skip


def _ns(marks, t0=0.0):
    return [(n, round((t + t0) * 1e6)) for n, t in marks]


def test_timeline_arithmetic_on_known_marks(tlm):
    trace = _ns(STEP) + [("junk", 1)] + _ns(STEP, 10.0)  # two steps; marks between are ignored
    tl = tlm.timeline(trace)
    assert (tl.steps, tl.n_layers) == (2, 2)
    approx = pytest.approx
    assert (tl.step, tl.head, tl.tail) == (approx(5.0), approx(0.31), approx(0.42))
    assert (tl.cpu, tl.cpu_last, tl.period) == (approx(1.95), approx(1.9), approx(2.37))
    assert (tl.serial, tl.release, tl.inputs) == (approx(0.37), approx(0.04), approx(0.32))
    assert (tl.submit, tl.blocked, tl.wake_lead) == (approx(0.01), approx(0.29), approx(0.305))
    assert tl.launch == approx(0.01)
    # the parts add up: period = CPU + serial, serial = release + inputs + submit
    assert tl.serial == approx(tl.release + tl.inputs + tl.submit)
    # the slice itself (2 MoE layers) is reproduced exactly
    two = tlm.extrapolate(tl, 2, cpu_alone=1.9, gpu_fixed=0.4, gpu_per_layer=0.2)
    assert two["step"] == approx(5.0)
    assert two["ratio"] == approx(5.0 / 3.8)
    k2 = tlm.extrapolate(tl, 60, cpu_alone=1.9, gpu_fixed=0.4, gpu_per_layer=0.2)
    # 0.31 + 59 x 2.37 + 1.9 + 0.42 = 142.46 against max(12.4, 114)
    assert (k2["step"], k2["gpu_part"], k2["cpu_part"]) == (approx(142.46), approx(12.4), 114)
    assert k2["ratio"] == approx(142.46 / 114)
    # 1.1 x 114 = 125.4 = 2.63 + 59 x (2.0 + s): s = 0.0809...
    assert k2["serial_for_1_1"] == approx((125.4 - 2.63) / 59 - 2.0)
    # CPU parts 0.5 ms longer each (cold weights): 0.31 + 59 x 2.87 + 2.4 + 0.42 vs 60 x 2.4
    cold = tlm.extrapolate(tlm.cpu_shifted(tl, 0.5), 60, 2.4, 0.4, 0.2)
    assert cold["ratio"] == approx((0.31 + 59 * 2.87 + 2.4 + 0.42) / 144.0)
    assert tlm.cpu_shifted(tl, 0.5).serial == approx(tl.serial)
    # every CPU part 2.0 ms (the fastest measurement), serial 0.37 as measured:
    # 0.31 + 59 x 2.37 + 2.0 + 0.42 against 60 x 2.0
    strict = tlm.extrapolate_c(tl, 60, 2.0, 0.4, 0.2)
    assert strict["step"] == approx(0.31 + 59 * 2.37 + 2.0 + 0.42)
    assert strict["ratio"] == approx((0.31 + 59 * 2.37 + 2.42) / 120.0)
    assert tlm.extrapolate_c(tl, 2, 1.9, 0.4, 0.2)["step"] == approx(0.31 + 0.37 + 3.8 + 0.42)
    gpu_bound = tlm.extrapolate(tl, 60, cpu_alone=0.1, gpu_fixed=1.0, gpu_per_layer=0.5)
    assert gpu_bound["limit"] == approx(31.0) and gpu_bound["ratio"] == approx(142.46 / 31.0)


def test_timeline_refuses_a_trace_without_steps_or_cpu_parts(tlm):
    with pytest.raises(ValueError, match="no complete step"):
        tlm.timeline(_ns(STEP[:-1]))
    with pytest.raises(ValueError, match="no CPU part"):
        tlm.timeline(_ns([("step0", 0), ("launch", 0.1), ("step1", 0.2)]))
    one = [m for m in STEP if m[1] < 2.35 or m[0] == "step1"]
    tl = tlm.timeline(_ns(one))
    assert tl.n_layers == 1 and tl.period is None
    with pytest.raises(ValueError, match="no period"):
        tlm.extrapolate(tl, 60, 1.0, 0.1, 0.1)


def _traced_steps(tlm, runner, model, sync, steps=3):
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    state = {"lens": [3, 6, 9]}
    ids = torch.randint(0, 500, (3,))

    def step():
        pos, md = _decode_md(state["lens"])
        runner.run(ids, pos, md)
        state["lens"] = [n + 1 for n in state["lens"]]

    trace = tlm.traced_steps(runner, hybrid, step, sync, steps)
    assert runner.trace is None and all(be.trace is None for be in hybrid)  # off again
    return trace, len(hybrid)


def _check_marks(tlm, trace, n_hybrid, steps, names, pieces):
    for marks in tlm.split_steps(trace):  # every layer's marks in the order the host passes
        got = [n for n, _ in marks if n in names]
        assert got == names * n_hybrid
        assert sum(n == "launch" for n, _ in marks) == pieces  # one per piece launched
        assert [t for _, t in marks] == sorted(t for _, t in marks)
    tl = tlm.timeline(trace)
    assert (tl.steps, tl.n_layers) == (steps, n_hybrid)
    for fig in (tl.head, tl.tail, tl.cpu, tl.period, tl.serial, tl.release, tl.inputs):
        assert fig is not None and fig >= 0
    for marks in tlm.split_steps(trace):  # a step = head + periods + last CPU part + tail
        f = tlm.step_figures(marks)
        whole = f["head"] + sum(f["period"]) + f["cpu"][-1] + f["tail"]
        assert whole == pytest.approx(f["step"], abs=1e-6)
    return tl


def test_host_wait_graph_steps_leave_the_timeline_marks(tlm):
    """Host wait (tape graphs on the CPU: the CPU part is submitted in `start`, waited in
    `finish`): per layer wake, in, cpu0, cpu1, then the next piece's launch releases it."""
    from .fake_graphs import TapeGraphFactory

    model = _model(4)
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                               graph_factory=TapeGraphFactory())  # fmt: skip
    runner.capture()
    trace, n = _traced_steps(tlm, runner, model, lambda: None)
    assert n == 2
    tl = _check_marks(tlm, trace, n, 3, ["wake", "in", "cpu0", "cpu1"], 1 + 2 * n)
    assert tl.blocked is None  # nothing to wait for on a CPU device


def test_device_wait_graph_steps_leave_the_timeline_marks(tlm):
    """Device wait (the fake stream): per layer wake, sync, in, cpu0, cpu1, rel."""
    model, runner, factory = _stream_runner(4, buckets=(4,))
    trace, n = _traced_steps(tlm, runner, model, factory.synchronize)
    tl = _check_marks(tlm, trace, n, 3, ["wake", "sync", "in", "cpu0", "cpu1", "rel"], 1 + n)
    assert tl.blocked is not None and tl.blocked >= 0


def test_no_marks_without_a_trace():
    model = _model(4)
    be = model.model.layers[1].mlp.expert_backend
    assert be.trace is None
    ids = torch.randint(0, 500, (5,))
    model(ids, torch.arange(5))  # eager: HostJob with cuda=False, nothing recorded anywhere
    trace: list = []
    be.trace = trace
    model(ids, torch.arange(5))
    assert [n for n, _ in trace] == ["wake", "in", "cpu0", "cpu1"]


class FakeReadyWord:
    """kernels.stream_wait.HostReadyWord on the fake stream: the "device" thread writes the
    number after the work launched before `record()`; `wait` blocks until it is there."""

    def __init__(self, factory) -> None:
        self.factory, self.seq, self.value, self.waits = factory, 0, 0, 0

    def record(self) -> int:
        self.seq += 1
        seq = self.seq
        self.factory.enqueue(lambda: setattr(self, "value", seq))
        return seq

    def wait(self, seq: int) -> None:
        end = time.monotonic() + 30
        while self.value != seq:
            assert time.monotonic() < end, "the device never wrote the ready word"
            time.sleep(1e-5)
        self.waits += 1

    def gpu_set(self) -> None:  # captured: the "device" writes 1 when the tape gets there
        self.factory.capturing.ops.append(lambda: setattr(self, "value", 1))

    def wait_set(self) -> None:
        self.wait(1)
        self.value = 0

    def reset(self) -> None:
        self.value = 0


class WordFactory(StreamTapeGraphFactory):
    def ready_word(self):
        return FakeReadyWord(self)


def test_device_wait_with_a_ready_word_gives_the_same_bits():
    """The staged inputs marked by a word the "device" writes instead of an event (switched
    on between replays of the same graphs): the same logits as with the event, every CPU part
    waited for through the word, and back to the event when it is taken away."""
    model, runner, factory = _stream_runner(4, buckets=(4,))
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    pos, md = _decode_md(lens)
    out = runner.run(ids, pos, md)  # a graph-owned buffer, written by the "device" thread
    factory.synchronize()
    want = out.clone()
    words = [FakeReadyWord(factory) for _ in hybrid]
    for be, w in zip(hybrid, words, strict=True):
        be.ready_word = w
    for _ in range(2):
        runner.run(ids, pos, md)
        factory.synchronize()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert [w.waits for w in words] == [2, 2]
    for be in hybrid:
        be.ready_word = None
    runner.run(ids, pos, md)
    factory.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert [w.waits for w in words] == [2, 2]


@pytest.mark.gpu
@needs_cuda
def test_cuda_ready_word_is_written_after_the_copies_before_it():
    """HostReadyWord: the number arrives after the stream's earlier work, whose D2H copy the
    host then reads complete, step after step."""
    from k2serve.kernels.stream_wait import HostReadyWord, host_ready_word_supported

    assert host_ready_word_supported(torch.cuda.current_device())
    word = HostReadyWord()
    dev = torch.zeros(1 << 20, device="cuda")
    host = torch.empty(1 << 20, pin_memory=True)
    for step in range(1, 6):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time first: the host must really wait
        dev.fill_(float(step))
        host.copy_(dev, non_blocking=True)
        seq = word.record()
        word.wait(seq)
        assert int(word.word.item()) == seq == step
        assert float(host[0]) == float(host[-1]) == float(step)
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("device_wait", [False, True])
def test_cuda_graphs_with_ready_words_equal_those_with_events(device_wait):
    """bf16 on CUDA, one runner: the staged inputs marked by ready words (switched on between
    replays) give what the events gave (1e-3: room for GPU kernels that add in any order)."""
    from k2serve.kernels.stream_wait import HostReadyWord

    # the pieces' device wait (not one graph: its ready words are captured in the graph, not
    # switched between replays)
    model, runner = _cuda_runner(device_wait=device_wait, one_graph=False, spin_wait=False)
    assert runner.waits_in_graph == device_wait
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    ids = torch.randint(0, 500, (3,), device="cuda")
    pos, md = _cuda_decode_md([3, 6, 9])
    want = runner.run(ids, pos, md).clone()
    for be in hybrid:
        be.ready_word = HostReadyWord()
    try:
        for _ in range(3):
            got = runner.run(ids, pos, md).clone()
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert all(be.ready_word.seq == 3 for be in hybrid)
    finally:
        for be in hybrid:
            be.ready_word = None


@pytest.mark.parametrize("ready_words", [True, False])
def test_a_runner_gives_its_hybrid_layers_ready_words_when_asked(ready_words):
    """DecodeGraphRunner(ready_words=True) with a factory that makes them: every hybrid layer
    marks its staged inputs with one (and the step's output is the events' one); without the
    flag, or from a factory without them, none does."""
    outs = []
    for factory, asked in ((StreamTapeGraphFactory(), True), (WordFactory(), ready_words)):
        model = _model(4)
        runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                                   graph_factory=factory, device_wait=True, one_graph=False,
                                   ready_words=asked)  # fmt: skip
        runner.capture()
        hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
        has = [be.ready_word is not None for be in hybrid]
        assert has == [asked and isinstance(factory, WordFactory)] * len(hybrid)
        torch.manual_seed(0)
        ids = torch.randint(0, 500, (3,))
        pos, md = _decode_md([3, 6, 9])
        out = runner.run(ids, pos, md)
        factory.synchronize()
        outs.append(out.clone())
        if any(has):
            assert all(be.ready_word.waits == 1 for be in hybrid)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def _one_graph_runner(n_gpu=4):
    model = _model(n_gpu)
    factory = WordFactory()
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(1, 4),
                               graph_factory=factory, device_wait=True,
                               one_graph=True)  # fmt: skip
    runner.capture()
    return model, runner, factory


@pytest.mark.parametrize("n_gpu", [4, 0])
def test_one_graph_device_wait_equals_the_pieces(n_gpu):
    """One graph per step (the ready words written inside it): the logits of the 1 + n
    pieces, step after step, every layer's CPU part waited for through its word, no host
    action between pieces (there are none)."""
    torch.manual_seed(0)
    model, runner, factory = _one_graph_runner(n_gpu)
    ref_model, ref_runner, ref_factory = _stream_runner(n_gpu, buckets=(1, 4))
    n_moe = len(model.config.moe_layers)
    assert runner.num_pieces == {1: 1, 4: 1} and runner.actions == {1: [], 4: []}
    assert [len(j) for j in runner.jobs.values()] == [n_moe, n_moe]
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    assert all(be.graph_jobs is None and be.graph_word is None for be in hybrid)
    words = [job.graph_word for job in runner.jobs[4]]
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    for step in range(3):
        pos, md = _decode_md(lens)
        out = runner.run(ids, pos, md)
        factory.synchronize()
        want = ref_runner.run(ids, pos, md)
        ref_factory.synchronize()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert [w.waits for w in words] == [step + 1] * n_moe
        assert all(w.value == 0 for w in words)
        ids, lens = model.compute_logits(out).argmax(-1), [n + 1 for n in lens]


def test_one_graph_an_error_in_the_cpu_part_releases_the_device():
    """A CPU part that raises in the one-graph step: the step raises, every signal released
    and re-armed, every word cleared, and the same step again gives the pieces' output."""
    model, runner, factory = _one_graph_runner(0)
    ref_model, ref_runner, ref_factory = _stream_runner(0, buckets=(1, 4))
    cpu = model.model.layers[1].mlp.expert_backend.cpu_backend
    submit, fail = cpu.submit, [True]

    def flaky(*a, **k):
        if fail[0]:
            raise ValueError("boom")
        return submit(*a, **k)

    cpu.submit = flaky
    ids = torch.randint(0, 500, (3,))
    pos, md = _decode_md([3, 6, 9])
    with pytest.raises(ValueError, match="boom"):
        runner.run(ids, pos, md)
    assert all(not s.released.is_set() for s in factory.signals)
    assert all(job.graph_word.value == 0 for job in runner.jobs[4])
    fail[0] = False
    out = runner.run(ids, pos, md)
    factory.synchronize()
    want = ref_runner.run(ids, pos, md)
    ref_factory.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_one_graph_needs_the_device_wait_and_words():
    """Without the device wait, or from a factory without ready words, one_graph keeps the
    pieces."""
    model = _model(4)
    r = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                          graph_factory=WordFactory(), device_wait=False,
                          one_graph=True)  # fmt: skip
    r.capture()
    assert r.num_pieces == {4: 1 + 2 * 2} and not r.jobs
    model = _model(4)
    r = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                          graph_factory=StreamTapeGraphFactory(), device_wait=True,
                          one_graph=True)  # fmt: skip
    r.capture()
    assert r.num_pieces == {4: 1 + 2} and not r.jobs


@pytest.mark.gpu
@needs_cuda
def test_cuda_one_graph_device_wait_equals_the_pieces():
    """bf16 on CUDA: the one-graph step (ready words written inside the graph) gives the
    1 + n pieces' output, step after step, each word cleared by the host."""
    runners = [_cuda_runner(device_wait=True, one_graph=one)[1] for one in (False, True)]
    n_moe = len(runners[0].model.config.moe_layers)
    assert [r.num_pieces[4] for r in runners] == [1 + n_moe, 1]
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,), device="cuda")
    for _ in range(3):
        pos, md = _cuda_decode_md(lens)
        want, got = (r.run(ids, pos, md).clone() for r in runners)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        assert all(int(job.graph_word.word.item()) == 0 for job in runners[1].jobs[4])
        ids = runners[0].model.compute_logits(want).argmax(-1)
        lens = [n + 1 for n in lens]


def test_spin_wait_kernel_clears_a_set_flag(monkeypatch):
    """The spin-wait kernel's logic in Triton's interpreter (CPU): a set flag lets it return
    at once and is cleared (the wait itself, on host-mapped memory, is the gpu test's)."""
    pytest.importorskip("triton")
    from k2serve.kernels.stream_wait import _spin_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = _spin_kernel.__wrapped__()  # not the cached (compiled) one
    flag = torch.tensor([7], dtype=torch.int32)
    kernel[(1,)](flag)
    assert flag.tolist() == [0]


@pytest.mark.gpu
@needs_cuda
def test_cuda_one_graph_with_the_spin_wait_equals_the_pieces():
    """bf16 on CUDA: one graph per step whose layers wait in spinning kernels gives the 1 + n
    pieces' output, step after step."""
    runners = [_cuda_runner(device_wait=True, one_graph=one, spin_wait=one)[1]
               for one in (False, True)]  # fmt: skip
    assert runners[1].num_pieces[4] == 1
    assert all(sig.spin for _, sig in runners[1]._waiting)
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,), device="cuda")
    for _ in range(3):
        pos, md = _cuda_decode_md(lens)
        want, got = (r.run(ids, pos, md).clone() for r in runners)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        ids = runners[0].model.compute_logits(want).argmax(-1)
        lens = [n + 1 for n in lens]


def test_spin_wait_falls_back_to_stream_waits():
    """spin_wait with a factory that has no spin signals (or whose spin signals are refused):
    the stream-wait signals, not the host wait."""

    class Refusing(StreamTapeGraphFactory):
        def spin_signal(self):
            return None

    for factory in (StreamTapeGraphFactory(), Refusing()):
        model = _model(4)
        r = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                              graph_factory=factory, device_wait=True,
                              spin_wait=True)  # fmt: skip
        r.capture()
        assert r.waits_in_graph and r.num_pieces == {4: 1 + 2}
