"""Piecewise decode graphs around the CPU experts' host round trip, on the CPU: the pieces are
captured by a fake graph factory that records and replays torch ops (fake_graphs.py), so
capture order, static buffers, padding and the host actions between pieces are exercised as
a CUDA graph would exercise them. The CUDA path itself is in the `gpu` tests."""

from __future__ import annotations

import pytest
import torch

from k2serve.attention import AttentionMetadata
from k2serve.model.cuda_graph import DecodeGraphRunner
from k2serve.moe import make_placement
from k2serve.moe.base import ExpertBackend

from .conftest import load_tiny, needs_cuda
from .fake_graphs import GraphSafeMLA, TapeGraphFactory

PS = 4  # page size
PAGES = 8  # pages per sequence


class DenseExpertBackend(ExpertBackend):
    """Every expert on every token, weighted by the routing: no data-dependent shapes."""

    name = "dense"

    def __init__(self, experts) -> None:
        self.experts = list(experts)

    def __call__(self, hidden, topk_ids, topk_weights):
        out = torch.zeros_like(hidden)
        for e, ex in enumerate(self.experts):
            w = ((topk_ids == e) * topk_weights).sum(1, keepdim=True)  # [T, 1]
            y = ex.down_proj(torch.nn.functional.silu(ex.gate_proj(hidden)) * ex.up_proj(hidden))
            out = out + y * w
        return out


def _model(n_gpu):
    cfg = load_tiny("int4").config
    model = load_tiny("int4", expert_placement=make_placement(cfg, n_gpu))
    model.set_attn_backend(GraphSafeMLA())
    for i in cfg.moe_layers:
        mlp = model.model.layers[i].mlp
        be = mlp.expert_backend
        if be.name != "hybrid":
            mlp.expert_backend = DenseExpertBackend(mlp.experts)
        elif be.gpu_backend is not None:
            be.gpu_backend = DenseExpertBackend(be.gpu_backend.experts)
    return model


def _caches(model, num_seqs):
    c = model.config
    n = num_seqs * PAGES
    return [torch.zeros(n, PS, c.kv_lora_rank + c.qk_rope_head_dim) for _ in model.model.layers]


def _cuda_decode_md(seq_lens):
    """`_decode_md` on the GPU: (positions, metadata) with every tensor on CUDA."""
    pos, md = _decode_md(seq_lens)
    md = AttentionMetadata(**{k: (v.cuda() if torch.is_tensor(v) else v)
                              for k, v in vars(md).items()})  # fmt: skip
    return pos.cuda(), md


def _cuda_runner(n_gpu: int = 3, **runner_kw):
    """A bf16 tiny int4 model on CUDA, n_gpu experts of each MoE layer on the GPU (the rest on
    the CPU: hybrid layers), and its decode graphs for up to 4 sequences (DecodeGraphRunner with
    `runner_kw`), captured: (model, runner)."""
    cfg = load_tiny("int4").config
    model = load_tiny("int4", dtype=torch.bfloat16, device="cuda",
                      expert_placement=make_placement(cfg, n_gpu))  # fmt: skip
    dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    caches = [torch.zeros(3 * PAGES, PS, dim, dtype=torch.bfloat16, device="cuda")
              for _ in model.model.layers]  # fmt: skip
    runner = DecodeGraphRunner(model, caches, PAGES, buckets=(4,), **runner_kw)
    runner.capture()
    return model, runner


def _decode_md(seq_lens):
    B = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    pos = lens.long() - 1
    slots = table.long()[torch.arange(B), pos // PS] * PS + pos % PS
    return pos, AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int32), seq_lens=lens,
        context_lens=lens - 1, block_table=table, slot_mapping=slots, max_query_len=1,
        max_seq_len=int(lens.max()), page_size=PS, num_decodes=B,
    )  # fmt: skip


@pytest.mark.parametrize("n_gpu", [8, 4, 0])
def test_piecewise_graph_replay_equals_the_eager_model(n_gpu):
    """Three sequences decode 5 steps on bucket 4 (one padding row): graph replays give the
    eager logits, with 2 pieces more per hybrid MoE layer and the CPU part run per replay."""
    torch.manual_seed(0)
    eager, graphed = _model(n_gpu), _model(n_gpu)
    kv_e, kv_g = _caches(eager, 3), _caches(graphed, 3)
    factory = TapeGraphFactory()
    runner = DecodeGraphRunner(graphed, kv_g, PAGES, buckets=(1, 4), graph_factory=factory)
    hooked = []
    for mod in (graphed.model.layers[1], graphed.model.layers[1].mlp):
        mod.register_forward_hook(lambda m, a, o, _h=hooked: _h.append(type(m).__name__))
    runner.capture()
    # forward hooks run on the split (generator) path too: warm-up + capture per bucket
    assert sorted(hooked) == ["DecoderLayer"] * 4 + ["MoE"] * 4
    hybrid = 0 if n_gpu == 8 else len(graphed.config.moe_layers)
    assert runner.num_pieces == {1: 1 + 2 * hybrid, 4: 1 + 2 * hybrid}
    if hybrid:  # count the CPU part's runs
        cpu = graphed.model.layers[1].mlp.expert_backend.cpu_backend
        calls = []
        submit = cpu.submit
        cpu.submit = lambda *a, **k: (calls.append(a[0].shape[0]), submit(*a, **k))[1]
    lens = [3, 6, 9]
    ids = torch.randint(0, 500, (3,))
    for _ in range(5):
        pos, md = _decode_md(lens)
        ref = eager.compute_logits(eager(ids, pos, md, kv_e))
        got = graphed.compute_logits(runner.run(ids, pos, md))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        ids = ref.argmax(-1)
        lens = [n + 1 for n in lens]
    assert all(g.replays == 5 for g in runner.graphs[4])
    assert all(g.replays == 0 for g in runner.graphs[1])
    if hybrid:
        assert calls == [4] * 5  # the bucket's rows, once per step


def test_a_host_sync_inside_a_piece_is_caught():
    """The fake graph refuses what a CUDA capture refuses: the torch expert backend's bincount."""
    model = load_tiny("int4", expert_placement=make_placement(load_tiny("int4").config, 4))
    model.set_attn_backend(GraphSafeMLA())
    runner = DecodeGraphRunner(model, _caches(model, 1), PAGES, buckets=(1,),
                               graph_factory=TapeGraphFactory())  # fmt: skip
    with pytest.raises(RuntimeError, match="syncs with the host"):
        runner.capture()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("device_wait", [True, False])
@pytest.mark.parametrize("n_gpu", [8, 4, 0])
def test_cuda_piecewise_graphs_equal_eager(n_gpu, device_wait):
    """On CUDA: hybrid layers with real CUDA graphs, pinned staging, and the CPU's result
    waited for inside the graph (the default: one graph per step, ready words out, spinning
    waits on host flags in) or between pieces (event + host actions)."""
    from k2serve.kernels.stream_wait import cuda_host_signal_supported

    cfg = load_tiny("int4").config
    kw = dict(dtype=torch.bfloat16, device="cuda", expert_placement=make_placement(cfg, n_gpu))
    model = load_tiny("int4", **kw)
    dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    caches = [[torch.zeros(3 * PAGES, PS, dim, dtype=torch.bfloat16, device="cuda")
               for _ in model.model.layers] for _ in range(2)]  # fmt: skip
    runner = DecodeGraphRunner(model, caches[1], PAGES, buckets=(1, 4), device_wait=device_wait)
    runner.capture()
    hybrid = 0 if n_gpu == 8 else len(cfg.moe_layers)
    if device_wait:
        assert cuda_host_signal_supported(torch.cuda.current_device(), True)
    assert runner.num_pieces[4] == (1 if device_wait else 1 + 2 * hybrid)
    lens = [3, 6, 9]
    ids = torch.randint(0, 500, (3,), device="cuda")
    for _ in range(4):
        pos, md = _cuda_decode_md(lens)
        ref = model.compute_logits(model(ids, pos, md, caches[0]))
        got = model.compute_logits(runner.run(ids, pos, md))
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        ids = ref.argmax(-1)
        lens = [n + 1 for n in lens]


@pytest.mark.gpu
@needs_cuda
def test_engine_keeps_decode_graphs_with_cpu_experts_and_the_eager_tokens():
    """The engine's decode graphs (the default host wait: two pieces per hybrid layer more)
    sample the tokens of the eager engine."""
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine

    from .test_runner import _greedy_tokens

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
    cfg = EngineConfig(device="cuda", num_kv_pages=64, page_size=16, max_model_len=256,
                       max_num_seqs=8, num_gpu_experts=3)  # fmt: skip
    eng = LLMEngine(cfg, model=load_tiny("int4", dtype=torch.bfloat16, device="cuda"))
    gr = eng.runner.graph_runner
    assert gr is not None and gr.num_pieces[8] == 1 + 2 * len(eng.model.config.moe_layers)
    graphed = _greedy_tokens(eng, prompts)
    eager_eng = LLMEngine(cfg.replace(enforce_eager=True),
                          model=load_tiny("int4", dtype=torch.bfloat16, device="cuda"))  # fmt: skip
    assert eager_eng.runner.graph_runner is None
    assert graphed == _greedy_tokens(eager_eng, prompts)


def test_captured_pieces_follow_a_dynamic_re_placement():
    """Experts moved between the GPU and CPU sets after capture: the graphs read the id maps
    and weights updated in place, so replays still give the eager logits."""
    from k2serve.moe.dynamic import replace_layer

    torch.manual_seed(1)
    eager, graphed = _model(3), _model(3)
    kv_e, kv_g = _caches(eager, 3), _caches(graphed, 3)
    runner = DecodeGraphRunner(graphed, kv_g, PAGES, buckets=(4,),
                               graph_factory=TapeGraphFactory())  # fmt: skip
    runner.capture()
    for i in graphed.config.moe_layers:  # the hottest by these scores: 5, 6, 7
        assert replace_layer(graphed.model.layers[i].mlp, torch.arange(8.0)) == 3
        assert sorted(graphed.model.layers[i].mlp.expert_backend.gpu_expert_ids) == [5, 6, 7]
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    for _ in range(3):
        pos, md = _decode_md(lens)
        ref = eager.compute_logits(eager(ids, pos, md, kv_e))
        got = graphed.compute_logits(runner.run(ids, pos, md))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        ids, lens = ref.argmax(-1), [n + 1 for n in lens]


@pytest.mark.parametrize("n_gpu", [8, 4])
def test_routing_is_counted_in_graph_replays_without_the_padding_rows(n_gpu):
    from k2serve.moe.placement import RoutingRecorder

    model = _model(n_gpu)
    rec = RoutingRecorder(model, max_tokens=8)  # before the capture: replays count
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(4,),
                               graph_factory=TapeGraphFactory())  # fmt: skip
    runner.capture()
    for c in rec.counts.values():
        c.zero_()  # the warm-up and capture passes counted 4 padded rows
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    for _ in range(5):
        pos, md = _decode_md(lens)
        runner.run(ids, pos, md)
        lens = [n + 1 for n in lens]
    k = model.config.num_experts_per_tok
    assert all(int(c.sum()) == 5 * 3 * k for c in rec.counts.values())  # 3 real rows of 4
    assert int(rec.valid.sum()) == rec.valid.numel()  # restored after each replay


def test_the_capture_warm_up_skips_the_cpu_experts():
    """Warming up a bucket needs the GPU pieces only: no CPU expert work at start-up."""
    model = _model(4)
    calls = []
    for i in model.config.moe_layers:
        cpu = model.model.layers[i].mlp.expert_backend.cpu_backend
        cpu.submit = lambda *a, _c=calls: _c.append(1)
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=(1, 4),
                               graph_factory=TapeGraphFactory())  # fmt: skip
    runner.capture()
    assert calls == []
    assert all(not model.model.layers[i].mlp.expert_backend.dry_run for i in (1, 2))


def _stream_runner(n_gpu, buckets=(1, 4)):
    from .fake_graphs import StreamTapeGraphFactory

    model = _model(n_gpu)
    factory = StreamTapeGraphFactory()
    runner = DecodeGraphRunner(model, _caches(model, 3), PAGES, buckets=buckets,
                               graph_factory=factory, device_wait=True)  # fmt: skip
    runner.capture()
    return model, runner, factory


@pytest.mark.parametrize("n_gpu", [4, 0])
def test_device_wait_graphs_equal_the_eager_model(n_gpu):
    """Device wait: one piece more per hybrid layer (not two), every piece launched before the
    CPU parts run on the host, the "device" waiting for each layer's CPU result inside its
    piece: the eager logits, step after step."""
    torch.manual_seed(0)
    eager = _model(n_gpu)
    kv_e = _caches(eager, 3)
    graphed, runner, factory = _stream_runner(n_gpu)
    hybrid = [graphed.model.layers[i].mlp.expert_backend for i in graphed.config.moe_layers]
    assert runner.num_pieces == {1: 1 + len(hybrid), 4: 1 + len(hybrid)}
    assert all(be.signal is not None and not be.device_wait for be in hybrid)
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    for step in range(4):
        pos, md = _decode_md(lens)
        ref = eager.compute_logits(eager(ids, pos, md, kv_e))
        out = runner.run(ids, pos, md)
        factory.synchronize()
        torch.testing.assert_close(graphed.compute_logits(out), ref, rtol=1e-4, atol=1e-4)
        assert all(be.signal.waits == step + 1 and not be.deferred for be in hybrid)
        ids, lens = ref.argmax(-1), [n + 1 for n in lens]


@pytest.mark.parametrize("n_gpu", [4, 0])
def test_device_wait_and_host_wait_graphs_give_the_same_bits(n_gpu):
    """The two ways of waiting run the same ops on the same buffers: identical logits (float32;
    the eager model differs from both by rounding only, the padding row changing the blocking
    of its matmuls)."""
    torch.manual_seed(2)
    host = _model(n_gpu)
    r_host = DecodeGraphRunner(host, _caches(host, 3), PAGES, buckets=(4,),
                               graph_factory=TapeGraphFactory(), device_wait=True)  # fmt: skip
    r_host.capture()  # a factory without host signals: the host wait, whatever is asked
    assert not r_host.waits_in_graph
    dev, r_dev, factory = _stream_runner(n_gpu, buckets=(4,))
    assert r_dev.waits_in_graph
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    for _ in range(3):
        pos, md = _decode_md(lens)
        want = host.compute_logits(r_host.run(ids, pos, md))
        got = r_dev.run(ids, pos, md)
        factory.synchronize()
        torch.testing.assert_close(dev.compute_logits(got), want, rtol=0, atol=0)
        ids, lens = want.argmax(-1), [n + 1 for n in lens]


def test_device_wait_the_gpu_part_runs_while_the_cpu_computes():
    """Each layer's CPU part is computed while the "device" runs that layer's GPU part (the
    shared expert, the GPU experts) up to its wait: the CPU part holds until the device is
    waiting on it, which would time out if the device waited for the host first."""
    import threading

    graphed, runner, factory = _stream_runner(4, buckets=(4,))
    order = []
    for i in graphed.config.moe_layers:
        be = graphed.model.layers[i].mlp.expert_backend
        at_wait = threading.Event()
        wait = be.signal._device_wait
        be.signal._device_wait = lambda _w=wait, _e=at_wait, _i=i: (_e.set(), _w())[1]
        submit = be.cpu_backend.submit

        def spy(*a, _s=submit, _e=at_wait, _i=i, **k):
            order.append(("cpu", _i, len(factory.launched)))
            assert _e.wait(10), "the device did not run the GPU part during the CPU part"
            _e.clear()
            return _s(*a, **k)

        be.cpu_backend.submit = spy
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    pos, md = _decode_md(lens)
    runner.run(ids, pos, md)
    factory.synchronize()
    n_moe = len(graphed.config.moe_layers)
    # layer k's CPU part began once its record and the piece after it (the GPU part that
    # waits for it) were launched, and no later piece: pieces 0..k+1 and records 0..k
    assert [o[:2] for o in order] == [("cpu", i) for i in graphed.config.moe_layers]
    assert [o[2] for o in order] == [2 * k + 3 for k in range(n_moe)]


def test_device_wait_an_error_in_the_cpu_part_releases_the_device():
    """A CPU part that raises: the step raises, the device is not left waiting, no flag is left
    set, and the step run again gives the eager logits."""
    eager = _model(0)
    kv_e = _caches(eager, 3)
    graphed, runner, factory = _stream_runner(0, buckets=(4,))
    cpu = graphed.model.layers[1].mlp.expert_backend.cpu_backend
    submit, fail = cpu.submit, [True]

    def flaky(*a, **k):
        if fail[0]:
            raise ValueError("boom")
        return submit(*a, **k)

    cpu.submit = flaky
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,))
    pos, md = _decode_md(lens)
    with pytest.raises(ValueError, match="boom"):
        runner.run(ids, pos, md)
    assert all(not s.released.is_set() for s in factory.signals)
    fail[0] = False  # the same step again (it rewrites the KV rows the failed one wrote)
    ref = eager.compute_logits(eager(ids, pos, md, kv_e))
    out = runner.run(ids, pos, md)
    factory.synchronize()
    torch.testing.assert_close(graphed.compute_logits(out), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("spin", [False, True])
def test_cuda_host_signal_holds_a_graph_until_the_host_writes(spin):
    """The wait inside a captured graph (the stream's wait, or with `spin` a spinning kernel):
    the copy after it reads what the host wrote before releasing, replay after replay (the GPU
    re-arms the flag)."""
    import time

    from k2serve.kernels.stream_wait import CudaHostSignal, cuda_host_signal_supported

    assert cuda_host_signal_supported(torch.cuda.current_device(), spin)
    sig = CudaHostSignal(spin=spin)
    host = torch.zeros(4, pin_memory=True)
    dev = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        sig.gpu_wait()
        dev.copy_(host, non_blocking=True)
        dev.mul_(2)
    for step in range(1, 4):
        g.replay()
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.01)
        assert not done.query()  # held
        host.fill_(float(step))
        sig.release()
        done.synchronize()
        assert dev.tolist() == [2.0 * step] * 4 and int(sig.flag.item()) == 0


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_wait_equals_host_wait_and_eager():
    """bf16 on CUDA: the device-wait graphs give the host-wait graphs' logits (same kernels on
    the same buffers, the same CPU part; 1e-3 leaves room for GPU kernels that add in any
    order) and the eager model's greedy tokens."""
    cfg = load_tiny("int4").config
    kw = dict(dtype=torch.bfloat16, device="cuda", expert_placement=make_placement(cfg, 3))
    models = [load_tiny("int4", **kw) for _ in range(3)]  # eager, host wait, device wait
    dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    caches = [[torch.zeros(3 * PAGES, PS, dim, dtype=torch.bfloat16, device="cuda")
               for _ in models[0].model.layers] for _ in models]  # fmt: skip
    runners = [DecodeGraphRunner(m, c, PAGES, buckets=(4,), device_wait=dw, one_graph=False,
                                 spin_wait=False)
               for m, c, dw in zip(models[1:], caches[1:], (False, True), strict=True)]  # fmt: skip
    for r in runners:
        r.capture()
    n_moe = len(cfg.moe_layers)
    assert [r.num_pieces[4] for r in runners] == [1 + 2 * n_moe, 1 + n_moe]
    assert [r.waits_in_graph for r in runners] == [False, True]
    lens, ids = [3, 6, 9], torch.randint(0, 500, (3,), device="cuda")
    for _ in range(4):
        pos, md = _cuda_decode_md(lens)
        ref = models[0].compute_logits(models[0](ids, pos, md, caches[0]))
        host, dev = (m.compute_logits(r.run(ids, pos, md))
                     for m, r in zip(models[1:], runners, strict=True))  # fmt: skip
        torch.testing.assert_close(dev, host, rtol=1e-3, atol=1e-3)
        assert torch.equal(dev.argmax(-1), host.argmax(-1))
        torch.testing.assert_close(dev, ref, rtol=2e-2, atol=2e-2)
        ids, lens = ref.argmax(-1), [n + 1 for n in lens]
