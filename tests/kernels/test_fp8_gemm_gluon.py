"""The Gluon FP8-block grouped GEMM (kernels/fp8_gemm_gluon.py): its configs, table and dispatch
on CPU (the policy gives its limit only where Gluon runs; the backend picks it from that many
pairs; the warm-up reaches every config), the kernel against fp8_moe and the torch reference on
an sm_90 GPU with Triton 3.6 (skipped elsewhere)."""

import dataclasses
import os
import sys

import pytest
import torch

from k2serve.kernels import fp8_gemm_gluon as fg
from k2serve.kernels import fused_moe as fm
from k2serve.kernels.policy import KernelPolicy, load_tables

E, D, I, TOP_K = 384, 7168, 2048, 8  # noqa: E741 - K2's routed experts
BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def meta_fp8(E_=E, D_=D, I_=I):  # noqa: N803
    f8, m = torch.float8_e4m3fn, "meta"
    return fm.ExpertWeights("fp8", torch.empty(E_, 2 * I_, D_, dtype=f8, device=m),
                            torch.empty(E_, D_, I_, dtype=f8, device=m),
                            torch.empty(E_, -(-2 * I_ // 128), -(-D_ // 128), device=m),
                            torch.empty(E_, -(-D_ // 128), -(-I_ // 128), device=m))  # fmt: skip


def test_module_imports_without_gluon(run_without_gluon):
    run_without_gluon(
        "from k2serve.kernels import fp8_gemm_gluon as g\n"
        "import k2serve.moe.fused_moe\n"
        "assert not g.HAS_GLUON and not g.gluon_available()\n"
        "print('ok')\n"
    )


def test_configs_and_table():
    t = load_tables()
    # the kernel's own default is the shipped table's configs; the path ships off
    assert [dict(e) for e in fg.FP8_GLUON_TABLE] == [
        {k: v for k, v in e.items() if k != "what"} for e in t.fp8_prefill_gluon
    ]
    # T=64 x top-8: the WS Gluon GEMM measured >= the small-M generic kernel from there (wave 13)
    assert t.fp8_prefill_gluon_min_pairs == 512
    fg.check_table(t.fp8_prefill_gluon)
    assert [fg.pick(t.fp8_prefill_gluon, n)["BLOCK_M"] for n in (4096, 4097, 16385, 10**6)] == [
        32, 64, 128, 128]  # fmt: skip
    # exact weights (the block scale on an fp32 partial) only: fp8_moe's numerics
    assert all(e["PROMOTE"] for e in t.fp8_prefill_gluon)
    assert "what" not in fg.pick(t.fp8_prefill_gluon, 10**6)
    ok = dict(BLOCK_M=128, BLOCK_N=128, KS=64, STAGES=4, num_warps=8)
    fg.check_config(ok)
    assert fg.smem_bytes(ok) == 4 * 64 * (2 * 128 + 128)
    for bad in (
        dict(BLOCK_M=12),  # not a multiple of 8
        dict(BLOCK_N=64),  # two warpgroups need 128 rows
        dict(num_warps=2),  # whole warpgroups
        dict(KS=256),  # a sub-step inside one 128-column scale block
        dict(KS=48),
        dict(KS=128),  # NaN outputs on the H100 (wave 9): refused
        dict(STAGES=2),  # the ring's 2 slots of slack
        dict(BLOCK_N=512, num_warps=8),
        dict(BLOCK_M=256, BLOCK_N=256, KS=64, STAGES=8),  # 384 KiB of shared memory
        dict(BLOCK_M=24, TAIL=True),  # half tiles of 12 rows
    ):
        with pytest.raises(ValueError):
            fg.check_config({**ok, **bad})
    with pytest.raises(ValueError, match="max_pairs null"):
        fg.check_table([{"max_pairs": 64, **ok}])
    with pytest.raises(ValueError, match="malformed"):
        fg.check_table([{"max_pairs": None, "BLOCK_M": 64}])
    assert fg.supported(meta_fp8()) and not fg.supported(meta_fp8(4, 200, 256))


def test_device_script_config_names():
    """benchmarks/fp8_gluon_device.py's names (also gluon_fp8_compile.py's): every swept config
    parses to a valid config; a bad name is a clear error."""
    sys.path.insert(0, BENCH)
    try:
        import fp8_gluon_device as dev
    finally:
        sys.path.remove(BENCH)
    assert dev.cfg_of("128x256k64s3w8f") == dict(BLOCK_M=128, BLOCK_N=256, KS=64, STAGES=3,
                                                 num_warps=8, PROMOTE=False, CVT32=True,
                                                 SILU=True, TAIL=False)  # fmt: skip
    assert dev.cfg_of("64x128k32s5w4pn")["PROMOTE"] and not dev.cfg_of("64x128k32s5w4pn")["SILU"]
    assert dev.cfg_of("128x128k64s4w8pft")["TAIL"] and not dev.cfg_of("128x128k64s4w8p")["TAIL"]
    for name in dev.SWEEP:
        fg.check_config(dev.cfg_of(name))
    best = {1024: "64x128k64s4w4p", 2048: "64x128k64s4w4p", 4096: "128x128k64s4w8pf",
            8192: "128x128k64s4w8pf"}  # fmt: skip
    table = dev.table_of(best, [1024, 2048, 4096, 8192, 16384])  # 16384: not measured
    assert [(e["max_pairs"], e["BLOCK_M"], e["CVT32"]) for e in table] == [
        (16384, 64, False), (None, 128, True)]  # fmt: skip
    fg.check_table(table)
    with pytest.raises(ValueError, match="config name"):
        dev.cfg_of("128x128s4w8")


def policy_with(monkeypatch, usable: bool, min_pairs):
    import k2serve.kernels.int4_gemm_gluon as ig

    monkeypatch.setattr(ig, "gluon_usable", lambda device: usable)
    p = KernelPolicy.for_device("cpu")
    return dataclasses.replace(
        p, tables=dataclasses.replace(p.tables, fp8_prefill_gluon_min_pairs=min_pairs)
    )


@pytest.mark.parametrize("usable", [False, True])
def test_dispatch_only_where_gluon_runs_and_in_the_band(monkeypatch, usable):
    from k2serve.moe.fused_moe import FusedMoEBackend

    p = policy_with(monkeypatch, usable, 4096)
    assert p.fp8_gluon is usable
    kw = p.moe_kwargs()
    assert kw["fp8_gluon_min_pairs"] == (4096 if usable else None)
    # the shipped fp8_routing_select band (T=257..768, [kernel, fp8_gemm]): where Gluon runs
    # the Gluon GEMM from its min pairs, ahead of the band
    banded = FusedMoEBackend(meta_fp8(), **kw)
    for T in (257, 511, 512, 768):
        gluon = usable and T * TOP_K >= 4096
        assert banded.plan(T, TOP_K)[0] == (("fp8_gluon",) if gluon else ("kernel", "fp8_gemm"))
    be = FusedMoEBackend(meta_fp8(), **dict(kw, fp8_routing_select=()))  # the pair-count rule
    assert be.plan(1, TOP_K) == (("kernel",), ())  # decode: the generic kernel
    assert be.plan(511, TOP_K) == (("fp8_gemm",), ())  # below the band: fp8_moe
    assert be.plan(512, TOP_K) == ((("fp8_gluon",) if usable else ("fp8_gemm",)), ())
    assert be.plan(8192, TOP_K)[0] == (("fp8_gluon",) if usable else ("fp8_gemm",))
    # the shipped table (min_pairs null): off even where Gluon runs
    assert policy_with(monkeypatch, True, None).moe_kwargs()["fp8_gluon_min_pairs"] is None
    # "kernel" (the generic kernel always) and non-fp8 experts never take it
    assert FusedMoEBackend(meta_fp8(), **dict(kw, fp8_impl="kernel")).plan(8192, 8)[0] == (
        "kernel",
    )
    # experts whose K is not whole scale blocks keep fp8_moe
    odd = FusedMoEBackend(meta_fp8(4, 200, 256), **kw)
    assert odd.fp8_gluon_min_pairs is None and odd.plan(8192, 8)[0] == ("fp8_gemm",)


def test_dispatch_calls_the_kernel_with_its_table(monkeypatch):
    import k2serve.moe.fused_moe as backend_mod
    from k2serve.moe.fused_moe import FusedMoEBackend

    calls = []
    monkeypatch.setattr(backend_mod, "fp8_moe_gluon", lambda *a: calls.append(a) or "out")
    table = [dict(max_pairs=None, BLOCK_M=64, BLOCK_N=128, KS=32, STAGES=5, num_warps=4)]
    be = FusedMoEBackend(meta_fp8(), fp8_gluon_table=table, fp8_gluon_min_pairs=0,
                         fp8_routing_select=())  # (T=600: the shipped band's)  # fmt: skip
    x, ids, w = torch.zeros(600, 1), torch.zeros(600, 8, dtype=torch.int32), torch.zeros(600, 8)
    assert be(x, ids, w) == "out"
    assert calls[0][0] is x and calls[0][4] == tuple(table)
    assert be.config_key(600, 8)[0] == (("fp8_gluon", 0),)
    with pytest.raises(ValueError, match="fp8_gluon_min_pairs"):
        FusedMoEBackend(meta_fp8(), fp8_gluon_min_pairs=-1)
    with pytest.raises(ValueError, match="max_pairs null"):
        FusedMoEBackend(meta_fp8(), fp8_gluon_table=[dict(table[0], max_pairs=8)],
                        fp8_gluon_min_pairs=0)  # fmt: skip


def test_warmup_reaches_every_fp8_gluon_config(monkeypatch):
    from k2serve.engine.warmup import config_key, warmup_token_counts
    from k2serve.moe.fused_moe import FusedMoEBackend

    kw = policy_with(monkeypatch, True, 4096).moe_kwargs()
    be = FusedMoEBackend(meta_fp8(), **kw)
    counts = warmup_token_counts([be], TOP_K, 16384)
    keys = {config_key([be], t, TOP_K) for t in counts}
    picks = {p for k in keys for p in k[0][0]}
    n = len(be.fp8_gluon_table)
    assert {p for p in picks if p[0] == "fp8_gluon"} == {("fp8_gluon", i) for i in range(n)}
    assert keys == {config_key([be], t, TOP_K) for t in range(1, 16385)}


# ------------------------------------------------------------------------------------- GPU
def gluon_gpu() -> bool:
    from k2serve.kernels.int4_gemm_gluon import gluon_usable

    return torch.cuda.is_available() and gluon_usable("cuda")


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rand_fp8(E_, D_, I_):  # noqa: N803
    """N(0, 1) weights rounded to e4m3 with scales in [0.005, 0.015), on the GPU."""

    def w(n, k):
        out = torch.empty(E_, n, k, dtype=torch.float8_e4m3fn, device="cuda")
        for e0 in range(0, E_, 16):
            out[e0 : e0 + 16] = torch.randn(min(16, E_ - e0), n, k, device="cuda")
        return out

    def s(n, k):
        return torch.rand(E_, -(-n // 128), -(-k // 128), device="cuda") * 0.01 + 0.005

    return fm.ExpertWeights("fp8", w(2 * I_, D_), w(D_, I_), s(2 * I_, D_), s(D_, I_))


def routing(T, E_, k, skew):
    tw = torch.rand(T, k, device="cuda")
    if not skew:
        return tw, torch.rand(T, E_, device="cuda").argsort(-1)[:, :k].int()
    third = torch.randperm(E_, device="cuda")[: E_ // 3]
    return tw, third[torch.rand(T, E_ // 3, device="cuda").argsort(-1)[:, :k]].int()


CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=128, KS=64, STAGES=4, num_warps=8, PROMOTE=True),
    dict(BLOCK_M=64, BLOCK_N=128, KS=64, STAGES=4, num_warps=4, PROMOTE=True),
    dict(BLOCK_M=64, BLOCK_N=256, KS=64, STAGES=3, num_warps=8, PROMOTE=True),
    dict(BLOCK_M=64, BLOCK_N=128, KS=64, STAGES=4, num_warps=4, PROMOTE=True, CVT32=True),
    dict(BLOCK_M=32, BLOCK_N=128, KS=64, STAGES=4, num_warps=4, PROMOTE=True, TAIL=True),
    dict(
        BLOCK_M=128, BLOCK_N=256, KS=64, STAGES=3, num_warps=8, PROMOTE=False, CVT32=True, TAIL=True
    ),
    dict(BLOCK_M=32, BLOCK_N=128, KS=32, STAGES=5, num_warps=4, PROMOTE=True, SILU=False),
    dict(BLOCK_M=128, BLOCK_N=256, KS=64, STAGES=3, num_warps=8, PROMOTE=False),
    dict(BLOCK_M=128, BLOCK_N=128, KS=64, STAGES=4, num_warps=8, PROMOTE=False, CVT32=True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_gpu(), reason="needs Triton 3.6's Gluon on an sm_90 GPU")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_small_odd_shapes_against_the_reference(cfg):
    """Partial N tiles (D=384 with 256-row tiles), K of 2-3 scale blocks, T=37 x top-3, an
    expert without pairs, padding rows: against fused_moe_ref and fp8_moe."""
    from k2serve.kernels.fp8_moe import fp8_moe

    torch.manual_seed(1)
    ew = rand_fp8(9, 384, 256)
    x = torch.randn(37, 384, device="cuda", dtype=torch.bfloat16)
    tw = torch.rand(37, 3, device="cuda")
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(37)]).int().cuda()
    ref = fm.fused_moe_ref(x, ew, tw, ids)
    old = fp8_moe(x, ew, tw, ids)
    new = fg.fp8_moe_gluon(x, ew, tw, ids, cfg)
    if cfg.get("PROMOTE"):  # fp8_moe's numerics: exact weights, the scale in fp32
        assert rel(new, ref) <= 1.25 * rel(old, ref) + 2e-4
    else:  # the scaled weights' rounding (bf16 math: the scale's too)
        assert rel(new, ref) <= 2.5 * rel(old, ref) + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not gluon_gpu(), reason="needs Triton 3.6's Gluon on an sm_90 GPU")
@pytest.mark.parametrize("T", [1024, 8192])
@pytest.mark.parametrize("skew", [False, True])
def test_k2_layer_against_fp8_moe_and_the_reference(T, skew):
    from k2serve.kernels.fp8_moe import fp8_moe

    torch.manual_seed(T + skew)
    ew = rand_fp8(E, D, I)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    tw, ids = routing(T, E, TOP_K, skew)
    old = fp8_moe(x, ew, tw, ids)
    for table in (None, load_tables().fp8_prefill_gluon):
        new = fg.fp8_moe_gluon(x, ew, tw, ids, table)
        assert torch.isfinite(new).all() and rel(new, old) <= 4e-3
    if T == 1024:  # the fp32 reference (one expert at a time)
        ref = fm.fused_moe_ref(x, ew, tw, ids)
        assert rel(new, ref) <= 1.25 * rel(old, ref) + 2e-4


def test_device_script_dry_run_on_cpu(monkeypatch, capsys):
    """benchmarks/fp8_gluon_device.py's check and time parts on CPU with small shapes and
    stand-in kernels (the fp32 reference for both FP8 paths): the verdicts, the table of
    results and the JSON table come out; an inexact config is timed but not tabled."""
    sys.path.insert(0, BENCH)
    try:
        import fp8_gluon_device as dev
        import model_speed as ms
    finally:
        sys.path.remove(BENCH)
    import k2serve.kernels.fp8_gemm_gluon as g
    import k2serve.kernels.fp8_moe as f
    import k2serve.kernels.int4_gemm as i4

    monkeypatch.setattr(dev, "DEV", "cpu")
    monkeypatch.setattr(dev, "E", 6)
    monkeypatch.setattr(dev, "D", 256)
    monkeypatch.setattr(dev, "I", 128)
    ref = lambda x, ew, tw, ids, *a, **k: fm.fused_moe_ref(x, ew, tw, ids)  # noqa: E731

    def noisy(x, ew, tw, ids, cfg):  # the scaled-weights stand-in: 1% off
        off = isinstance(cfg, dict) and not cfg.get("PROMOTE")
        return ref(x, ew, tw, ids) * (1.01 if off else 1.0)

    monkeypatch.setattr(f, "fp8_moe", ref)
    monkeypatch.setattr(g, "fp8_moe_gluon", noisy)
    monkeypatch.setattr(i4, "int4_moe_gemm", lambda x, *a, **k: x)
    monkeypatch.setattr(ms, "part_ceil", lambda: ms.CEIL.update(bw=3000.0, mm=700.0))
    monkeypatch.setattr(ms, "timed", lambda fn, iters=1, warmup=0: fn() is None or 2.0)
    assert dev.part_check("128x128k64s4w8p") == 0
    assert dev.part_check("128x256k64s3w8f") == dev.INEXACT  # 1% off: timed, not tabled
    names = ["128x128k64s4w8p", "128x256k64s3w8f"]
    assert dev.part_time(names, [16, 32], {"128x128k64s4w8p"}) == 0
    out = capsys.readouterr().out
    assert "INEXACT" in out and out.count("| 16 | ") == 2 and out.count("| 32 | ") == 2
    assert "table T=" not in out  # the shipped table's column ran
    assert '"max_pairs": null, "BLOCK_M": 128' in out and 'CVT32": true' not in out
