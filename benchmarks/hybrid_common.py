# ruff: noqa: E501
"""What benchmarks/hybrid_moe.py and benchmarks/hybrid_decode.py share: the results table
(ROWS, FAILS), timing, the k2-slice models and their inputs, the stand-ins for the CPU experts
and the expert GEMVs, the decode graph runner. Needs CUDA to run (not to import)."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

ROWS: list[tuple[str, str, str]] = []
FAILS: list[str] = []


def log(*a):
    print(*a, flush=True)


def wall_ms(fn, iters=10, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def check(name, out, ref, tol):
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(out).all()) and err < tol
    log(f"  check {name:48s} rel_err={err:.2e} (< {tol:g}) {'ok' if ok else 'FAIL'}")
    ROWS.append(("check", name, f"rel_err {err:.1e} {'ok' if ok else 'FAIL'}"))
    if not ok:
        FAILS.append(name)


def load(layers, placement=None):
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config("k2-slice", "int4", layers=layers))
    t = time.time()
    m = load_model(None, load_format="dummy", config=cfg, device="cuda", progress=False,
                   expert_placement=placement, seed=0)  # fmt: skip
    log(
        f"loaded k2-slice int4 {layers} layers ({placement.describe() if placement else 'all on the GPU'}) in {time.time() - t:.0f}s"
    )
    return m


def kv_for(model, tokens, ps=64):
    from k2serve.attention import allocate_kv_caches

    return allocate_kv_caches(model.config, -(-tokens // ps) + 8, ps, torch.bfloat16, "cuda")


def prefill_inputs(T, ps=64):
    from k2serve.attention.base import AttentionMetadata

    pages = -(-T // ps)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([T], device="cuda", dtype=torch.int32),
        context_lens=torch.zeros(1, device="cuda", dtype=torch.int32),
        block_table=torch.arange(pages, device="cuda", dtype=torch.int32)[None],
        slot_mapping=torch.arange(T, device="cuda"), max_query_len=T, max_seq_len=T,
        page_size=ps, num_decodes=0,
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.randint(0, 2000, (T,), device="cuda", generator=g)
    return ids, torch.arange(T, device="cuda"), md


def decode_inputs(B, ctx, ps=64):
    from k2serve.attention.base import AttentionMetadata

    ppseq = -(-(ctx + 1) // ps)
    bt = torch.arange(B * ppseq, device="cuda", dtype=torch.int32).view(B, ppseq)
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((B,), ctx + 1, device="cuda", dtype=torch.int32),
        context_lens=torch.full((B,), ctx, device="cuda", dtype=torch.int32),
        block_table=bt, slot_mapping=(bt[:, ctx // ps].long() * ps + ctx % ps),
        max_query_len=1, max_seq_len=ctx + 1, page_size=ps, num_decodes=B,
    )  # fmt: skip
    # seeded: the same tokens in every run (an unseeded draw can route a token through a
    # near-tie that bf16 rounding flips between two paths, failing every way's check at once)
    g = torch.Generator(device="cuda").manual_seed(1000 * B + ctx)
    ids = torch.randint(0, 2000, (B,), device="cuda", generator=g)
    return ids, torch.full((B,), ctx, device="cuda", dtype=torch.long), md, B * ppseq, ppseq


def hybrid_backends(model):
    return [ly.mlp.expert_backend for ly in model.model.layers
            if getattr(getattr(ly.mlp, "expert_backend", None), "name", None) == "hybrid"]  # fmt: skip


class StubCpu:
    """Stands in for a layer's CPU experts: answers at once with zeros (the GPU part alone).
    Like the real backend (moe.cpu_experts) it writes the given `out` in place and returns
    it, so the step's path after the CPU part is the engine's (HostJob._collect finds its own
    buffer: no copy); without `out`, a new zero tensor of x's shape and dtype."""

    def __init__(self, real):
        self.real, self.shape = real, None

    def submit(self, x, ids, w, *, out=None, **kw):
        self.shape = x.shape
        self._out = torch.zeros(x.shape, dtype=x.dtype) if out is None else out.zero_()

    def wait(self):
        return self._out

    def prewake(self, usec: int = 0) -> None:  # nothing to wake
        pass


def set_stub(model, on: bool):
    for be in hybrid_backends(model):
        if on and not isinstance(be.cpu_backend, StubCpu):
            be.cpu_backend = StubCpu(be.cpu_backend)
        elif not on and isinstance(be.cpu_backend, StubCpu):
            be.cpu_backend = be.cpu_backend.real


@contextlib.contextmanager
def slow_cpu(model, seconds: float):
    """Every CPU part starts `seconds` late (a sleep before the CPU experts), as on a slow or
    busy host, its `out` first filled with NaN: a GPU that read `out` before the CPU wrote it
    would show NaN in the output (the same step's `out` of the step before would not show)."""
    saved = []
    for be in hybrid_backends(model):
        cpu = be.cpu_backend
        saved.append((cpu, cpu.submit))

        def late(*a, _submit=cpu.submit, **k):
            if k.get("out") is not None:
                k["out"].fill_(float("nan"))
            time.sleep(seconds)
            return _submit(*a, **k)

        cpu.submit = late
    try:
        yield
    finally:
        for cpu, submit in saved:
            cpu.submit = submit


class ZeroExperts:
    name = "zero"

    def __call__(self, hidden, topk_ids, topk_weights):
        return torch.zeros_like(hidden)


def graph_runner(model, kv, max_pages, B, device_wait=None, one_graph=False, spin_wait=False,
                 zero_copy=None, fused_wait=None):  # fmt: skip
    """zero_copy / fused_wait None: K2SERVE_HYBRID_ZERO_COPY / K2SERVE_HYBRID_FUSED_WAIT (on by
    default where their probes pass)."""
    from k2serve.model.cuda_graph import DecodeGraphRunner

    r = DecodeGraphRunner(model, kv, max_pages, buckets=(B,), device_wait=device_wait,
                          one_graph=one_graph, spin_wait=spin_wait, zero_copy=zero_copy,
                          fused_wait=fused_wait)  # fmt: skip
    r.capture()
    return r


# the ways a hybrid decode graph waits for the CPU experts (model.cuda_graph): (name, device
# wait, one graph, spin wait): before = a host round trip between graph pieces, after = a
# stream wait inside the graph (1 + n pieces, an event per layer); one graph = the same with
# the whole step one graph, which writes a ready word per layer for the host (no event, no
# piece); spin = its waits spinning kernels on the host-mapped flag, not stream waits
WAITS = (("host wait (before)", False, False, False), ("device wait (after)", True, False, False),
         ("device wait, one graph", True, True, False),
         ("device wait, one graph, spin kernel", True, True, True))  # fmt: skip


# the ways also measured with the memcpys (zero_copy=False) beside zero-copy, in the same run
# (hybrid_decode.zero_copy_ab): before / after of kernels.zero_copy (a few s a way; measured
# for all four ways in w11, now the default way and the one graph with spinning waits); the
# one-graph ways also get the fused-wait A/B (fused_wait=False beside the default)
ZERO_COPY_AB = (WAITS[0][0], WAITS[3][0])


def soft(name, fn):
    """Run one part; on an error print it, count it as a failure and go on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log(f"  {name}: ERROR {type(e).__name__}: {e}")
        FAILS.append(name)
        return None
