"""The warp-specialized Gluon INT4 GEMM (int4_gemm_gluon_ws.py, config WS=1 / 2): its config
checks on CPU; on an sm_90 GPU with Triton 3.6 (skipped elsewhere) its output against the
shipped kernel's with the same tile: bit-identical (the same dequant, the same K order per
output), through int4_moe_gemm (padding rows, experts without pairs) and one launch at a time
(partial N blocks, SILU and the routing-weight store)."""

import pytest
import torch

from k2serve.kernels import int4_gemm, int4_gemm_gluon
from k2serve.kernels.int4_gemm_gluon import check_config, gluon_usable, smem_bytes
from k2serve.kernels.int4_gemm_gluon_ws import ws_regs, ws_split

BIG = dict(BLOCK_M=128, BLOCK_N=256, W2=16, num_warps=8, BF16X2=True, L1=True, SILU=True)
# WS configs (the shipped kernel's counterpart: the same keys without WS, STAGES=3)
WS_CFGS = [
    dict(BIG, STAGES=4, WS=1),
    dict(BIG, STAGES=4, WS=2),
    dict(BIG, STAGES=4, WS=2, RELEASE=2),
    dict(BIG, STAGES=4, WS=1, INFLIGHT=2, BF16X2=False, L1=False),
    dict(BLOCK_M=16, BLOCK_N=128, W2=16, STAGES=6, num_warps=4, BF16X2=True, WS=1),
    dict(BLOCK_M=32, BLOCK_N=128, W2=32, STAGES=3, num_warps=4, SILU=True, WS=1, FENCE=True),
    dict(BIG, BLOCK_M=64, STAGES=4, WS=2, RELEASE=2),  # the table's to 32767 pairs (wave 13)
]


def _shipped(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("WS", "PW", "PREG", "CREG", "RELEASE")} | {
        "STAGES": 3
    }


def test_ws_config_checks():
    for cfg in WS_CFGS:
        check_config(cfg)
        check_config(_shipped(cfg))
    # the ring: 4 stages of 32 KiB planes + 16 KiB words + 4 KiB scales, 2 mbarriers each
    assert smem_bytes(dict(BIG, STAGES=4, WS=1)) == 4 * (32768 + 16384 + 4096 + 16)
    assert ws_split(dict(BIG, WS=1)) == (1, 8) and ws_split(dict(BIG, WS=2)) == (2, 4)
    # 3 warpgroups: 168 registers a thread at launch; the workers' share and the producer's
    assert ws_regs(dict(BIG, STAGES=4, WS=2)) == (168, 224, 56)
    # small tiles: two CTAs an SM (the shared memory holds them), 128 registers at launch
    assert ws_regs(WS_CFGS[4]) == (128, 200, 56)
    ok = dict(BIG, STAGES=4, WS=1)
    for bad in (
        dict(STAGES=5),  # 5 * 52 KiB of shared memory
        dict(TAIL=True),  # the WS kernel takes no TAIL units
        dict(KW=1),
        dict(PW=2),  # producer warps: 1 or 4
        dict(BLOCK_N=128, WS=2),  # SILU: each warpgroup's gate and up rows in its own threads
        dict(num_warps=16),
    ):
        with pytest.raises(ValueError):
            check_config({**ok, **bad})


def _experts(E, D, I, dev):  # noqa: E741
    from k2serve.kernels import fused_moe as fm

    pk = lambda n, kk: torch.randint(-(2**31), 2**31 - 1, (E, n, kk // 8), dtype=torch.int32,
                                     device=dev)  # fmt: skip  # noqa: E731
    sc = lambda n, kk: (torch.rand(E, n, kk // 32, device=dev) * 0.004 + 0.002).bfloat16()  # noqa: E731
    return fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)


gpu = pytest.mark.skipif(not gluon_usable("cuda"), reason="needs an sm_90 GPU and Triton 3.6 Gluon")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [5, 300])
@pytest.mark.parametrize("cfg", WS_CFGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_ws_matches_shipped_moe(T, cfg):
    """One MoE layer through int4_moe_gemm: WS == the shipped kernel, bit for bit (E - 1
    experts used: one without pairs; T=5: mostly padding rows), and near the fp32 reference."""
    from k2serve.kernels import fused_moe as fm

    torch.manual_seed(T)
    E, D, I, k = 8, 768, 512, 4  # noqa: E741
    ew = _experts(E, D, I, "cuda")
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(T, k, device="cuda")
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int().cuda()
    ws = int4_gemm.int4_moe_gemm(x, ew, w, ids, cfg, backend="gluon")
    ref = int4_gemm.int4_moe_gemm(x, ew, w, ids, _shipped(cfg), backend="gluon")
    assert torch.isfinite(ws.float()).all()
    assert torch.equal(ws, ref), (ws.float() - ref.float()).abs().max().item()
    f32 = fm.fused_moe_ref(x, ew, w, ids).float()
    assert ((ws.float() - f32).norm() / f32.norm()).item() < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("cfg", WS_CFGS[:2] + WS_CFGS[4:5], ids=["ws1", "ws2", "ws1-16x128"])
def test_ws_matches_shipped_launch(cfg, silu):
    """One launch with N not a multiple of BLOCK_N and the routing-weight store, or the SILU
    launch over several N tiles (its gemm-order output needs N / 2 a multiple of 16 W2: no
    partial tile; N=640's store would write past each row, gemm_gluon refuses it): WS ==
    shipped, bit for bit."""
    from k2serve.kernels.moe_align import moe_align_block_size

    torch.manual_seed(1)
    E, K, N, T, k = 6, 512, 704 if not silu else 1536, 200, 4  # (k: int4_moe_gemm's A_DIV)
    ew = _experts(E, K, N // 2, "cuda")  # w13 [E, N, K / 8]
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int().cuda()
    M = T * k
    a = torch.randn(M if not silu else T, K, device="cuda", dtype=torch.bfloat16)
    a = int4_gemm.to_gemm_order(a, cfg["W2"])
    tw = torch.rand(M, device="cuda")
    sid, eids, npost = moe_align_block_size(ids, E, cfg["BLOCK_M"])
    outs = []
    for c in (cfg, _shipped(cfg)):
        c = {**c, "SILU": silu}
        out = torch.full((M, N // 2 if silu else N), 7.0, device="cuda", dtype=torch.bfloat16)
        int4_gemm_gluon.gemm_gluon(a, ew.w13, ew.w13_scale, out, tw, sid, eids, npost, N, K, M,
                                   k if silu else 1, not silu, silu, c)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), (outs[0].float() - outs[1].float()).abs().max().item()
    assert (outs[0] != 7.0).float().mean().item() > 0.99  # every pair's row was written


def test_gemm_gluon_launches_the_ws_kernel(monkeypatch):
    """gemm_gluon with WS: the WS kernel, the shipped grid, the default partition's warps, the
    register split and only the keys the kernel takes (CPU: the launch is recorded)."""
    from k2serve.kernels import int4_gemm_gluon_ws as gw

    seen = {}

    class Fake:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.update(grid=grid, nargs=len(args), **kw)

            return launch

    monkeypatch.setattr(gw, "_int4_gemm_gluon_ws_kernel", Fake(), raising=False)
    monkeypatch.setattr(int4_gemm_gluon, "gluon_available", lambda: True)
    E, N, K, M, nblk = 4, 1536, 512, 48, 9
    a = torch.zeros(M, K, dtype=torch.bfloat16)
    w = torch.zeros(E, N, K // 8, dtype=torch.int32)
    s = torch.zeros(E, N, K // 32, dtype=torch.bfloat16)
    c = torch.zeros(M, N // 2, dtype=torch.bfloat16)
    ids = torch.zeros(nblk * 128, dtype=torch.int32)
    eids = torch.zeros(nblk, dtype=torch.int32)
    cfg = dict(BIG, STAGES=4, WS=2, TAIL=False, max_pairs=None, what="x")
    int4_gemm_gluon.gemm_gluon(a, w, s, c, torch.zeros(M), ids, eids, eids[:1], N, K, M, 8, False,
                               True, cfg)  # fmt: skip
    assert seen["grid"] == (nblk * 6,)  # 1536 outputs in 256-row tiles
    assert (seen["num_warps"], seen["NC"], seen["CW"], seen["maxnreg"]) == (4, 2, 4, 168)
    assert (seen["CREG"], seen["PREG"], seen["PW"], seen["RELEASE"]) == (224, 56, 4, 1)
    assert seen["SILU"] and seen["L1"] and seen["STAGES"] == 4 and seen["nargs"] == 19
    assert not {"TAIL", "KW", "WS", "MAXNREG", "CARVE", "max_pairs", "what"} & set(seen)
    with pytest.raises(ValueError, match="WS"):
        int4_gemm_gluon.gemm_gluon(a, w, s, c, torch.zeros(M), ids, eids, eids[:1], N, K, M, 8,
                                   False, True, {**cfg, "TAIL": True})  # fmt: skip
    # gemm order by whole blocks of 256 columns: SILU's 320 (N=640) or a plain 704 would put
    # a partial block's columns past the row (into the next pair's), with either kernel
    for n, silu in ((640, True), (704, False)):
        for c_ in (cfg, {**cfg, "WS": False}):
            seen.clear()
            with pytest.raises(ValueError, match="gemm-order"):
                int4_gemm_gluon.gemm_gluon(a, w[:, :n], s[:, :n], c, torch.zeros(M), ids, eids,
                                           eids[:1], n, K, M, 8, False, True,
                                           {**c_, "SILU": silu})  # fmt: skip
            assert not seen
