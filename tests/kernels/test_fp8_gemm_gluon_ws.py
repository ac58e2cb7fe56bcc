"""The warp-specialized Gluon FP8-block GEMM (fp8_gemm_gluon_ws.py, config WS=1 / 2): its config
checks and launch on CPU; on an sm_90 GPU with Triton 3.6 (skipped elsewhere) its output against
the shipped kernel's with the same tile: bit-identical (the same conversion, the same per-K-block
promotion order per output), through fp8_moe_gluon (padding rows, an expert without pairs, the
SILU launch, the routing weights) and one launch at a time (partial N blocks, SILU's masked
halves, the routing-weight store), and near the fp32 reference."""

import pytest
import torch

from k2serve.kernels import fp8_gemm_gluon as fg
from k2serve.kernels import fused_moe as fm
from k2serve.kernels.fp8_gemm_gluon_ws import fp8_ws_smem_bytes
from k2serve.kernels.int4_gemm_gluon_ws import ws_regs, ws_split

BIG = dict(BLOCK_M=128, BLOCK_N=128, KS=64, num_warps=8, PROMOTE=True, CVT32=True)
WS_CFGS = [
    dict(BIG, STAGES=6, WS=2),
    dict(BIG, STAGES=6, WS=2, RELEASE=2),
    dict(BIG, STAGES=6, WS=1),
    dict(BIG, BLOCK_M=64, BLOCK_N=256, STAGES=6, WS=2),
    dict(BIG, BLOCK_M=32, num_warps=4, KS=32, STAGES=8, WS=1, RELEASE=0, FENCE=True),
    dict(BIG, KS=128, STAGES=4, WS=2, RELEASE=2),  # the table's (wave 13)
    dict(BIG, BLOCK_M=64, KS=128, STAGES=4, WS=2, RELEASE=2),
    dict(BIG, BLOCK_M=32, KS=128, STAGES=4, WS=2, RELEASE=2),
]
WS_KEYS = ("WS", "PW", "RELEASE", "FENCE")


def _shipped(cfg: dict) -> dict:
    """The shipped kernel's config with the same tile (KS=128, WS only: its KS=64, the same
    per-128-column-block promotion, so the same sums in the same order)."""
    return {**{k: v for k, v in cfg.items() if k not in WS_KEYS}, "KS": min(cfg["KS"], 64)}


def test_ws_config_checks():
    for cfg in WS_CFGS:
        fg.check_config(cfg)
        fg.check_config(_shipped(cfg))
    # 6 stages of [128, 64] bf16 activations + [128, 64] fp8 weights, 2 mbarriers each
    assert fp8_ws_smem_bytes(dict(BIG, STAGES=6)) == 6 * (64 * (256 + 128) + 16)
    assert ws_split(dict(BIG, WS=1)) == (1, 8) and ws_split(dict(BIG, WS=2)) == (2, 4)
    # one CTA an SM, 3 warpgroups: 168 registers at launch, 224 a consumer, 56 the producer
    assert ws_regs(WS_CFGS[0], fp8_ws_smem_bytes(WS_CFGS[0])) == (168, 224, 56)
    ok = WS_CFGS[0]
    for bad in (
        dict(STAGES=10),  # 10 * 24 KiB of shared memory
        dict(TAIL=True),  # no TAIL units
        dict(PROMOTE=False),  # the shipped mode only (exact weights, Triton's conversion)
        dict(CVT32=False),
        dict(PW=2),  # producer warps: 1 or 4
        dict(RELEASE=3),
        dict(KS=256),  # a sub-step is at most one 128-column K block
        dict(BLOCK_N=64),  # 32 rows a warpgroup
        dict(num_warps=16),
    ):
        with pytest.raises(ValueError):
            fg.check_config({**ok, **bad})


def test_gemm_fp8_gluon_launches_the_ws_kernel(monkeypatch):
    """gemm_fp8_gluon with WS: the WS kernel, the shipped grid, the default partition's warps,
    the register split and only the keys it takes (CPU: the launch is recorded)."""
    from k2serve.kernels import fp8_gemm_gluon_ws as gw

    seen = {}

    class Fake:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.update(grid=grid, nargs=len(args), **kw)

            return launch

    monkeypatch.setattr(gw, "_fp8_gemm_gluon_ws_kernel", Fake(), raising=False)
    monkeypatch.setattr(fg, "gluon_available", lambda: True)
    E, N, K, M, nblk = 4, 1536, 512, 48, 9
    a = torch.zeros(M, K, dtype=torch.bfloat16)
    w = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    s = torch.zeros(E, N // 128, K // 128)
    c = torch.zeros(M, N // 2, dtype=torch.bfloat16)
    ids = torch.zeros(nblk * 128, dtype=torch.int32)
    eids = torch.zeros(nblk, dtype=torch.int32)
    cfg = dict(WS_CFGS[1], max_pairs=None, what="x")
    fg.gemm_fp8_gluon(a, w, s, c, torch.zeros(M), ids, eids, eids[:1], N, K, M, 8, False, True,
                      cfg)  # fmt: skip
    assert seen["grid"] == (nblk * 12,)  # 1536 outputs in 128-row tiles
    assert (seen["num_warps"], seen["NC"], seen["CW"], seen["maxnreg"]) == (4, 2, 4, 168)
    assert (seen["CREG"], seen["PREG"], seen["PW"], seen["RELEASE"]) == (224, 56, 4, 2)
    assert seen["SILU"] and seen["STAGES"] == 6 and seen["nargs"] == 17 and seen["A_DIV"] == 8
    assert not {"TAIL", "WS", "PROMOTE", "CVT32", "max_pairs", "what"} & set(seen)
    with pytest.raises(ValueError, match="WS"):
        fg.gemm_fp8_gluon(a, w, s, c, torch.zeros(M), ids, eids, eids[:1], N, K, M, 8, False,
                          True, {**cfg, "TAIL": True})  # fmt: skip
    seen.clear()  # WS=0: the shipped kernel (its table entries take no WS keys)
    monkeypatch.setattr(fg, "_fp8_gemm_gluon_kernel", Fake(), raising=False)
    fg.gemm_fp8_gluon(a, w, s, c, torch.zeros(M), ids, eids, eids[:1], N, K, M, 8, False, True,
                      _shipped(cfg))  # fmt: skip
    assert seen["num_warps"] == 8 and not set(WS_KEYS) & set(seen)


def test_device_script_ws_names():
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench)
    try:
        import fp8_gluon_device as dev
        import wsfp8_device as wd
    finally:
        sys.path.remove(bench)
    assert dev.cfg_of("128x128k64s6w8pfxxe2") == dict(WS_CFGS[1], SILU=True, TAIL=False, PW=4,
                                                      FENCE=False)  # fmt: skip
    assert dev.cfg_of("128x128k64s6w8pfx")["WS"] == 1 and "WS" not in dev.cfg_of("128x128k64s4w8pf")
    for name in wd.VARIANTS:
        fg.check_config(dev.cfg_of(name))


def gluon_gpu() -> bool:
    from k2serve.kernels.int4_gemm_gluon import gluon_usable

    return torch.cuda.is_available() and gluon_usable("cuda")


gpu = pytest.mark.skipif(not gluon_gpu(), reason="needs an sm_90 GPU and Triton 3.6 Gluon")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _experts(E, D, I, up_rows=None):  # noqa: E741
    """N(0, 1) weights rounded to e4m3, scales in [0.005, 0.015) (w13's: gate then up blocks,
    cdiv(I, 128) each, as fp8_moe reads them)."""

    def w(n, k):
        return torch.randn(E, n, k, device="cuda").to(torch.float8_e4m3fn)

    def s(nb, k):
        return torch.rand(E, nb, -(-k // 128), device="cuda") * 0.01 + 0.005

    return fm.ExpertWeights("fp8", w(2 * I, D), w(D, I), s(2 * -(-I // 128), D),
                            s(-(-D // 128), I))  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [5, 300])
@pytest.mark.parametrize("cfg", WS_CFGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_ws_matches_shipped_moe(T, cfg):
    """One MoE layer through fp8_moe_gluon: WS == the shipped kernel, bit for bit (E - 1
    experts used: one without pairs; T=5: mostly padding rows; D=640: a partial 256-row N tile
    in the down GEMM), and near the fp32 reference (as near as fp8_moe)."""
    from k2serve.kernels.fp8_moe import fp8_moe

    torch.manual_seed(T)
    E, D, I, k = 8, 640, 256, 4  # noqa: E741
    ew = _experts(E, D, I)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(T, k, device="cuda")
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int().cuda()
    ws = fg.fp8_moe_gluon(x, ew, w, ids, cfg)
    ref = fg.fp8_moe_gluon(x, ew, w, ids, _shipped(cfg))
    assert torch.isfinite(ws.float()).all()
    assert torch.equal(ws, ref), (ws.float() - ref.float()).abs().max().item()
    f32 = fm.fused_moe_ref(x, ew, w, ids)
    assert _rel(ws, f32) <= 1.25 * _rel(fp8_moe(x, ew, w, ids), f32) + 2e-4


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize(
    "cfg",
    WS_CFGS[:3] + WS_CFGS[4:],
    ids=["ws2", "ws2e2", "ws1", "ws1-32", "ws2e2-ks128", "ws2e2-ks128-64", "ws2e2-ks128-32"],
)
def test_ws_matches_shipped_launch(cfg, silu):
    """One launch with N=704 (a partial N tile) and the routing-weight store into fp32, or the
    SILU launch with I=288 (masked halves in the last tile: 288 outputs in tiles of 64 or 32
    gate and up rows): WS == shipped, bit for bit, every pair's row written."""
    from k2serve.kernels.moe_align import moe_align_block_size

    torch.manual_seed(1)
    E, K, T, k = 6, 512, 200, 4  # (k: fp8_moe_gluon's A_DIV for the SILU launch)
    N = 576 if silu else 704
    ew = _experts(E, K, N // 2)  # w13 [E, N, K], its scales [E, 2 cdiv(N / 2, 128), K / 128]
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int().cuda()
    M = T * k
    a = torch.randn(T if silu else M, K, device="cuda", dtype=torch.bfloat16)
    tw = torch.rand(M, device="cuda")
    sid, eids, npost = moe_align_block_size(ids, E, cfg["BLOCK_M"])
    outs = []
    for c in (cfg, _shipped(cfg)):
        dt = torch.bfloat16 if silu else torch.float32
        out = torch.full((M, N // 2 if silu else N), 7.0, device="cuda", dtype=dt)
        fg.gemm_fp8_gluon(a, ew.w13, ew.w13_scale, out, tw, sid, eids, npost, N, K, M,
                          k if silu else 1, not silu, silu, c)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), (outs[0].float() - outs[1].float()).abs().max().item()
    assert (outs[0] != 7.0).float().mean().item() > 0.99  # every pair's row was written


def test_device_script_dry_run_on_cpu(monkeypatch, capsys):
    """benchmarks/wsfp8_device.py's layer checks, time part and table on CPU with small shapes
    and stand-in kernels (the fp32 reference for the shipped table and the WS configs, one WS
    config 1% off): the verdicts and the table's rows come out."""
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, bench)
    try:
        import model_speed as ms
        import prefill_device as pd
        import wsfp8_device as wd
    finally:
        sys.path.remove(bench)
    from k2serve.kernels import fp8_moe as f8

    monkeypatch.setattr(wd, "DEV", "cpu")
    monkeypatch.setattr(wd, "LAYER_TS", (16, 32))
    for k, v in dict(E=16, D=256, I=128).items():
        monkeypatch.setattr(pd, k, v)
    ref = lambda x, ew, tw, ids, *a, **k: fm.fused_moe_ref(x, ew, tw, ids)  # noqa: E731

    def gluon(x, ew, tw, ids, cfg):  # the 64x256 stand-in: 1% off
        off = isinstance(cfg, dict) and cfg["BLOCK_M"] == 64
        return ref(x, ew, tw, ids) * (1.01 if off else 1.0)

    monkeypatch.setattr(f8, "fp8_moe", ref)
    monkeypatch.setattr(fg, "fp8_moe_gluon", gluon)
    monkeypatch.setattr(ms, "timed", lambda fn, iters=1, warmup=0: fn() is None or 2.0)
    names = ["128x128k64s6w8pfxx", "64x256k64s6w8pfxx"]
    wd.part_layers(names)
    wd.part_time(16, "uniform", names[:1])
    out = capsys.readouterr().out
    assert out.count("(bit-identical)") == 2 + 2  # 128x128 at both T; table and 128x128 timed
    assert out.count(": ok") == 2 and out.count(": FAILED") == 2
    res = [__import__("json").loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    lines = wd.summary(res, {"mm": 700.0}, True, "3 passed in 1s", ["64x256k64s6w8pfxx"], 5.0)
    text = "\n".join(lines)
    assert (
        "| 16 | uniform | table | 2.000 |" in text
        and "| 16 | uniform | 128x128k64s6w8pfxx |" in text
    )
    assert "K2 layer checks 2/4 passed (FAILED: 64x256k64s6w8pfxx)" in text
