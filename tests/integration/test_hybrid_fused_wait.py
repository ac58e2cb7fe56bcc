"""Fused waits of the one-graph hybrid decode step (issue 33 item 4; kernels.zero_copy "Fused
waits"): the zero-copy staging kernel writes the layer's ready word itself (and clears the
host's flag), and the result kernel can spin on that flag itself (kernel-level tests only: the
runner keeps the wait its own node, measured faster on the H100). CPU: both kernels under Triton's
interpreter (fences as no-ops there), the host side's protocol with fakes (HostJob.unblock,
the runner's error path, the switch); the PTX order is checked by test_hybrid_zero_copy's
compile test (benchmarks/zero_copy_compile.py). GPU: the protocol replay after replay, graphs
with and without the fused waits bit for bit, a late CPU part, an error in a CPU part."""

from __future__ import annotations

import functools
import threading
import time
import types

import pytest
import torch

from k2serve.model.cuda_graph import DecodeGraphRunner
from k2serve.moe.host_round_trip import HostJob

from .conftest import needs_cuda
from .test_hybrid_slow_cpu import late_cpu
from .test_hybrid_timeline import WordFactory
from .test_piecewise_graphs import (
    PAGES,
    PS,
    _caches,
    _cuda_decode_md,
    _cuda_runner,
    _decode_md,
    _model,
)

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _no_fence():
    pass


@triton.jit
def _plain_store(ptr, value):
    tl.store(ptr, value)


@pytest.fixture
def interpreted(monkeypatch):
    """kernels.zero_copy's kernels rebuilt under Triton's CPU interpreter, its inline-asm
    helpers (fences, st.relaxed.sys) replaced by what the interpreter runs: no fence (its
    programs run one after another), a plain store."""
    from k2serve.kernels import zero_copy as zc

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in ("_stage_kernel", "_add_kernel"):
        monkeypatch.setattr(zc, name, triton.jit(getattr(zc, name).fn))
    monkeypatch.setattr(zc, "_fence_sc_sys", _no_fence)
    monkeypatch.setattr(zc, "_fence_acq_rel_sys", _no_fence)
    monkeypatch.setattr(zc, "_store_sys", _plain_store)
    return zc


def _hs(flag: bool):
    """A Handshake's device side on CPU tensors: word 0, flag 1 (the last step's release)."""
    return types.SimpleNamespace(word=torch.zeros(1, dtype=torch.int32),
                                 flag=torch.ones(1, dtype=torch.int32) if flag else None,
                                 count=torch.zeros(1, dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("clear", [True, False])
@pytest.mark.parametrize("T", [1, 5])
def test_fused_staging_stores_the_data_then_the_word(interpreted, T, clear):
    """The fused staging kernel (T x 2 programs: the counter's last one writes): the
    memcpys' bits, then word = 1, the flag cleared (only with a spinning wait), the counter
    back at 0 for the next launch, step after step."""
    zc = interpreted
    D, k = zc.BLOCK + 77, 8
    hs = _hs(clear)
    g = torch.Generator().manual_seed(T)
    for step in range(3):
        hidden = torch.randn(T, D, generator=g).to(torch.bfloat16)
        tid = torch.randint(0, 384, (T, k), generator=g, dtype=torch.int32)
        tw = torch.rand(T, k, generator=g)
        x, ids = torch.zeros(T, D, dtype=torch.bfloat16), torch.zeros(T, k, dtype=torch.long)
        w = torch.zeros(T, k)
        zc.stage_to_host(hidden, tid, tw, x, ids, w, handshake=hs)
        assert torch.equal(x, hidden) and torch.equal(ids, tid.long()) and torch.equal(w, tw)
        assert int(hs.word) == 1 and int(hs.count) == 0, step
        if clear:
            assert int(hs.flag) == 0
            hs.flag.fill_(1)  # the host's release of this step
        hs.word.zero_()  # the host saw it (HostReadyWord.wait_set)


def test_fused_staging_word_waits_for_every_program(interpreted):
    """The word is written by the program that finds the counter at programs - 1: with the
    counter off by one (a program missing), no word and no clear."""
    zc = interpreted
    hs = _hs(True)
    hs.count.fill_(-1)
    T, D, k = 2, 3 * zc.BLOCK, 4
    hidden, tid, tw = torch.randn(T, D), torch.zeros(T, k, dtype=torch.long), torch.ones(T, k)
    zc.stage_to_host(hidden, tid, tw, torch.empty(T, D), torch.empty(T, k, dtype=torch.long),
                     torch.empty(T, k), handshake=hs)  # fmt: skip
    assert int(hs.word) == 0 and int(hs.flag) == 1 and int(hs.count) == 2 * 3 - 1


def test_fused_result_kernel_adds_once_released_and_leaves_the_flag(interpreted):
    """With the flag set (the host released it), the spinning result kernel is the plain
    one's gpu_out + out, and the flag stays set (the next staging clears it)."""
    zc = interpreted
    g = torch.Generator().manual_seed(3)
    gpu_out = torch.randn(3, zc.BLOCK + 5, generator=g)
    out = torch.randn(3, zc.BLOCK + 5, generator=g)
    flag = torch.ones(1, dtype=torch.int32)
    got = zc.add_from_host(gpu_out, out, wait_flag=flag)
    assert torch.equal(got, zc.add_from_host(gpu_out, out)) and int(flag) == 1


def test_a_fused_word_needs_a_token(interpreted):
    zc = interpreted
    e = torch.empty(0, 8)
    with pytest.raises(ValueError, match="at least one token"):
        zc.stage_to_host(e, e.long(), e, e, e.long(), e, handshake=_hs(True))


# ---------------------------------------------------------------- the host side, with fakes
class _Word:
    """HostReadyWord's host side: `wait_set` spins until the "GPU" wrote 1, then clears it."""

    def __init__(self, log: list) -> None:
        self.value, self.log = 0, log

    def wait_set(self) -> None:
        end = time.monotonic() + 5
        while self.value != 1:
            if time.monotonic() > end:
                raise RuntimeError("no word")
            time.sleep(1e-4)
        self.value = 0
        self.log.append("word")


def _job(fused: bool, log: list) -> HostJob:
    sig = types.SimpleNamespace(release=lambda: log.append("release"))
    cpu = types.SimpleNamespace(prewake=lambda: None)
    be = types.SimpleNamespace(signal=sig, ready_word=None, trace=None, dry_run=False,
                               cpu_backend=cpu)  # fmt: skip
    t = torch.zeros(1, 4)
    hs = types.SimpleNamespace(flag=torch.zeros(1)) if fused else None
    job = HostJob(be, t, t.long(), t, t, cuda=False, handshake=hs)
    job.graph_word = _Word(log)
    return job


def test_unblock_releases_a_fused_wait_only_after_its_staging_ran():
    """Error recovery: a fused spinning wait whose word was not seen this step is released
    after the word comes (before it, the staging kernel's clear would undo the release); one
    seen, or an unfused wait, at once."""
    log: list = []
    job = _job(True, log)
    threading.Timer(0.05, lambda: setattr(job.graph_word, "value", 1)).start()
    job.unblock()
    assert log == ["word", "release"] and job.staged_seen
    log.clear()
    job.unblock()  # seen this step: no second wait
    assert log == ["release"]
    log.clear()
    _job(False, log).unblock()
    assert log == ["release"]
    log.clear()
    assert not _job(True, log).unblock(wait=False)  # not launched: no wait, release
    assert log == ["release"]
    log.clear()
    late = _job(True, log)
    late.graph_word.wait_set = lambda: (_ for _ in ()).throw(RuntimeError("no word"))
    assert not late.unblock()  # the word never came: released, and later jobs won't wait
    assert log == ["release"]


def test_a_fused_wait_is_not_released_when_the_word_never_came():
    """A CPU part whose staged inputs never arrived (the word's wait raised): with the fused
    wait no release (unblock's job), without it the release as before."""
    for fused, want in ((True, []), (False, ["release"])):
        log: list = []
        job = _job(fused, log)
        job.graph_word.value = 5  # never 1
        job.graph_word.wait_set = lambda: (_ for _ in ()).throw(RuntimeError("no word"))
        with pytest.raises(RuntimeError, match="no word"):
            job.complete_in_graph()
        assert log == want and not job.staged_seen


class _HandshakeFactory(WordFactory):
    """The fake stream with a `handshake` per layer (a marker: CPU jobs never stage zero-copy,
    so their graphs keep the separate nodes; the runner's choice is what is tested)."""

    def __init__(self, give: bool = True) -> None:
        super().__init__()
        self.give, self.made = give, []

    def handshake(self, word, signal):
        self.made.append((word, signal))
        return types.SimpleNamespace(word=word, flag=None) if self.give else None


def _fused_runner(monkeypatch, zero_copy=(True, True), give=True, **kw):
    model = _model(0)
    hybrid = [model.model.layers[i].mlp.expert_backend for i in model.config.moe_layers]
    for be, zc in zip(hybrid, zero_copy, strict=True):  # `zero_copy` is `_mapped is not None`
        monkeypatch.setattr(be, "_mapped", {} if zc else None, raising=False)
        monkeypatch.setattr(be, "reserve", lambda *a, **k: None)
    kw.setdefault("device_wait", True)
    kw.setdefault("one_graph", True)
    r = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                          graph_factory=_HandshakeFactory(give), **kw)  # fmt: skip
    r.capture()
    assert all(be.graph_handshake is None for be in hybrid)  # only while capturing
    return r


def test_fused_waits_are_chosen_by_the_switch_and_need_one_zero_copy_graph(monkeypatch):
    monkeypatch.delenv("K2SERVE_HYBRID_FUSED_WAIT", raising=False)
    assert _fused_runner(monkeypatch).fused_waits  # on by default
    assert not _fused_runner(monkeypatch, fused_wait=False).fused_waits
    monkeypatch.setenv("K2SERVE_HYBRID_FUSED_WAIT", "0")
    assert not _fused_runner(monkeypatch).fused_waits
    assert _fused_runner(monkeypatch, fused_wait=True).fused_waits  # the explicit choice wins
    assert not _fused_runner(monkeypatch, fused_wait=True, one_graph=False).fused_waits
    assert not _fused_runner(monkeypatch, fused_wait=True, zero_copy=(True, False)).fused_waits
    assert not _fused_runner(monkeypatch, fused_wait=True, give=False).fused_waits  # probe
    monkeypatch.setenv("K2SERVE_HYBRID_FUSED_WAIT", "maybe")
    with pytest.raises(ValueError, match="K2SERVE_HYBRID_FUSED_WAIT"):
        _fused_runner(monkeypatch)


def test_an_error_unblocks_the_one_graph_jobs_in_layer_order(monkeypatch):
    """A CPU part that raises in a one-graph step: every job of the step is unblocked, in
    layer order (each fused one after its staging ran), and the next step is right."""
    r = _fused_runner(monkeypatch, fused_wait=True)
    model = r.model
    order: list = []
    real = HostJob.unblock
    monkeypatch.setattr(
        HostJob, "unblock", lambda self, wait=True: (order.append(self), real(self, wait))[1]
    )
    cpu = model.model.layers[model.config.moe_layers[0]].mlp.expert_backend.cpu_backend
    submit, fail = cpu.submit, [True]

    def flaky(*a, **k):
        if fail[0]:
            raise ValueError("boom")
        return submit(*a, **k)

    cpu.submit = flaky
    ids = torch.randint(0, 500, (3,), generator=torch.Generator().manual_seed(0))
    pos, md = _decode_md([3, 6, 9])
    with pytest.raises(ValueError, match="boom"):
        r.run(ids, pos, md)
    assert order == r.jobs[4]
    fail[0] = False
    out = r.run(ids, pos, md).clone()
    r.factory.synchronize()
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@needs_cuda
def test_cuda_fused_protocol_replay_after_replay():
    """Both fused kernels in one CUDA graph, replayed 60 times, the host as in a step: wait
    for the word (the staged bits are then in host memory), write `out`, release the flag;
    the result reads that step's `out` (never the last one's), the flag is cleared by the
    next staging and the counter is back at 0 each time."""
    from k2serve.kernels.stream_wait import HostReadyWord, host_mapped
    from k2serve.kernels.zero_copy import Handshake, add_from_host, fused_wait_supported
    from k2serve.kernels.zero_copy import stage_to_host as stage

    dev = torch.cuda.current_device()
    assert fused_wait_supported(dev)
    T, D, k = 2, 7168, 8
    word, flag = HostReadyWord(), torch.zeros(1, dtype=torch.int32, pin_memory=True)
    hs = Handshake(word.word, flag, torch.device("cuda", dev))
    host = dict(x=torch.zeros(T, D, dtype=torch.bfloat16, pin_memory=True),
                ids=torch.zeros(T, k, dtype=torch.long, pin_memory=True),
                w=torch.zeros(T, k, pin_memory=True),
                out=torch.zeros(T, D, dtype=torch.bfloat16, pin_memory=True))  # fmt: skip
    m = {n: host_mapped(t) for n, t in host.items()}
    hidden = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    tid = torch.randint(0, 384, (T, k), device="cuda", dtype=torch.int32)
    tw = torch.rand(T, k, device="cuda")
    gpu_out = torch.randn(T, D, device="cuda").to(torch.bfloat16)
    hs.warm_up(hidden, tid, tw, m["x"], m["ids"], m["w"], m["out"])  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(200_000)  # the host really waits for the word
        stage(hidden, tid, tw, m["x"], m["ids"], m["w"], handshake=hs)
        res = add_from_host(gpu_out, m["out"], wait_flag=hs.flag)
    for step in range(60):
        x = torch.randn(T, D).to(torch.bfloat16)
        hidden.copy_(x)  # (no device sync between the replay and the release: it would hang)
        graph.replay()
        word.wait_set()
        assert torch.equal(host["x"], x) and int(flag) == 0, step
        new = torch.randn(T, D).to(torch.bfloat16)
        host["out"].copy_(new)
        flag[0] = 1  # the release
        torch.cuda.synchronize()
        assert torch.equal(res, gpu_out + new.cuda()), step
        assert int(hs.count.item()) == 0 and int(flag) == 1


# (spin_wait): the one-graph ways; spinning: staging and result fused, stream waits: the word
ONE_GRAPH = {"one graph, spin kernel": True, "one graph": False}


@functools.cache  # one pair per way for the module's tests (each restores what it patches)
def _pair(spin: bool):
    """One model, two one-graph zero-copy runners: fused waits and the separate nodes (every
    routed expert on the CPU: no GPU kernel whose atomics could reorder a sum, so the two
    graphs' bits must agree)."""
    model, fused = _cuda_runner(0, device_wait=True, one_graph=True, spin_wait=spin,
                                zero_copy=True, fused_wait=True)  # fmt: skip
    dim = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    caches = [torch.zeros(3 * PAGES, PS, dim, dtype=torch.bfloat16, device="cuda")
              for _ in model.model.layers]  # fmt: skip
    plain = DecodeGraphRunner(model, caches, PAGES, buckets=(4,), device_wait=True,
                              one_graph=True, spin_wait=spin, zero_copy=True,
                              fused_wait=False)  # fmt: skip
    plain.capture()
    assert fused.fused_waits and not plain.fused_waits
    assert all(j.handshake is not None for j in fused.jobs[4])
    # the word only: the runner keeps the wait its own node (model.cuda_graph, "Fused waits")
    assert not any(j.waits_in_kernel for j in fused.jobs[4])
    return model, fused, plain


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("way", list(ONE_GRAPH))
def test_cuda_fused_waits_give_the_unfused_bits_for_60_steps(way):
    """The same model's one graph with and without the fused waits: the same bits, 60 decode
    steps (each replay a new token and position: a flag or counter protocol that breaks on a
    later replay shows as a hang, an error or other bits)."""
    model, fused, plain = _pair(ONE_GRAPH[way])
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,), device="cuda")
    for step in range(60):
        pos, md = _cuda_decode_md([min(n, PAGES * PS) for n in lens])
        got = fused.run(ids, pos, md).clone()
        want = plain.run(ids, pos, md).clone()
        assert torch.isfinite(got).all() and torch.equal(got, want), step
        ids, lens = model.compute_logits(got).argmax(-1), [n + 1 for n in lens]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("way", list(ONE_GRAPH))
def test_cuda_fused_waits_wait_for_a_late_cpu_part(way):
    """Every CPU part 20 ms late, its `out` NaN until then: the fused result kernel must not
    read `out` before the host's flag (NaN otherwise), replay after replay, on-time steps
    between (the flag of the step before must not count)."""
    model, fused, plain = _pair(ONE_GRAPH[way])
    ids = torch.randint(0, 500, (3,), device="cuda")
    pos, md = _cuda_decode_md([3, 6, 9])
    want = plain.run(ids, pos, md).clone()
    for _ in range(3):
        with late_cpu(model, 0.02):
            for _ in range(2):
                got = fused.run(ids, pos, md).clone()
                assert torch.isfinite(got).all() and torch.equal(got, want)
        assert torch.equal(fused.run(ids, pos, md), want)


@pytest.mark.gpu
@needs_cuda
def test_cuda_fused_waits_an_error_in_a_cpu_part_releases_the_device():
    """A CPU part that raises with the fused word and spinning waits: the step raises (no hang: each
    later layer released after its staging kernel ran), the device drains, and the next
    steps give the unfused bits."""
    model, fused, plain = _pair(True)
    cpu = model.model.layers[model.config.moe_layers[0]].mlp.expert_backend.cpu_backend
    submit, fail = cpu.submit, [True]

    def flaky(*a, **k):
        if fail[0]:
            raise ValueError("boom")
        return submit(*a, **k)

    cpu.submit = flaky
    ids = torch.randint(0, 500, (3,), device="cuda")
    pos, md = _cuda_decode_md([3, 6, 9])
    try:
        with pytest.raises(ValueError, match="boom"):
            fused.run(ids, pos, md)
        torch.cuda.synchronize()
        fail[0] = False
        for _ in range(3):
            assert torch.equal(fused.run(ids, pos, md), plain.run(ids, pos, md))
    finally:
        del cpu.submit


def test_the_ptx_order_checks_fail_on_a_misordered_kernel():
    """benchmarks/zero_copy_compile.py's order checks of the fused kernels (run on the real
    PTX by test_hybrid_zero_copy's compile test): what they accept, and what they refuse."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench)
    try:
        import zero_copy_compile as zcc
    finally:
        sys.path.remove(bench)
    word = "st.relaxed.sys.global.b32"
    stage = ["ld.global.v4.b32", "st.global.v4.b32", "fence.sc.sys", "bar.sync",
             "atom.global.gpu.acq_rel.add.u32", "bar.sync", "st.global.b32", word,
             "fence.sc.sys", "bar.sync", word]  # fmt: skip
    assert zcc.fused_stage_ok(stage)
    assert not zcc.fused_stage_ok([o for o in stage if o != "fence.sc.sys"])
    assert not zcc.fused_stage_ok(stage[:2] + stage[4:])  # no fence before the counter
    assert not zcc.fused_stage_ok(stage[:-3] + [word, "fence.sc.sys", "bar.sync"])  # word early
    assert not zcc.fused_stage_ok(stage[:-1] + [word, "st.global.v4.b32"])  # data after it
    add = ["ld.global.v4.b32", "ld.volatile.global.b32", "ld.volatile.global.b32",
           "fence.acq_rel.sys", "ld.volatile.global.v4.b32", "st.global.v4.b32"]  # fmt: skip
    assert zcc.fused_add_ok(add)
    assert not zcc.fused_add_ok([o for o in add if o != "fence.acq_rel.sys"])
    assert not zcc.fused_add_ok(add[:1] + add[4:5] + add[1:4] + add[5:])  # out before the flag
