"""The FP8-block grouped GEMMs (kernels/fp8_moe.py) against fused_moe_ref: ragged expert counts,
padding rows, partial tiles and partial 128x128 scale blocks, top-k weights; the backend's
dispatch and the config table's checks."""

import pytest
import torch

from k2serve.kernels import fp8_moe
from k2serve.kernels import fused_moe as fm
from k2serve.quant.fp8 import quantize_fp8_block

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _experts(E, D, I):  # noqa: E741
    """Stacked fp8 experts quantized per projection (gate and up each own cdiv(I, 128) scale
    rows), as stack_experts builds them."""

    def proj(n, k):
        pairs = [quantize_fp8_block(torch.randn(n, k) * 0.05) for _ in range(E)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    (g, gs), (u, us), (d, ds) = proj(I, D), proj(I, D), proj(D, I)
    return fm.ExpertWeights(
        "fp8",
        torch.cat([g, u], 1).to(DEVICE),
        d.to(DEVICE),
        torch.cat([gs, us], 1).to(DEVICE),
        ds.to(DEVICE),
    )


def _ragged_routing(T, k, E):
    """Expert 0 in every token (a block of many rows), the others spread unevenly, expert E-1
    never hit; distinct experts per token; random positive weights."""
    ids = torch.stack(
        [
            torch.tensor([0] + [1 + (t * j + t // 2) % (E - 2) for j in range(1, k)])
            for t in range(T)
        ]
    )
    for t in range(T):  # keep the slots of a token distinct
        seen = set()
        for j in range(k):
            while int(ids[t, j]) in seen:
                ids[t, j] = (ids[t, j] + 1) % (E - 1)
            seen.add(int(ids[t, j]))
    return ids.int().to(DEVICE), torch.rand(T, k, device=DEVICE)


def _cfg(bm, bn, bk, gm=1, bn2=None, bk2=None, warps=4):
    t = dict(BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=warps, num_stages=2)
    return {"BLOCK_M": bm, "w13": t, "w2": dict(t, BLOCK_N=bn2 or bn, BLOCK_K=bk2 or bk)}


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(16, 32, 128),  # the decode shape: many N tiles, 16-row blocks mostly padding
        _cfg(16, 16, 64, bn2=64, bk2=32),  # several K steps per scale block
        _cfg(32, 64, 32, gm=2),  # grouped launch order, several blocks of expert 0
    ],
)
def test_fp8_moe_matches_reference(cfg):
    ew = _experts(4, 256, 128)
    T, k = 40, 3  # expert 0: 40 rows = several row blocks
    ids, w = _ragged_routing(T, k, 4)
    x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
    out = fp8_moe.fp8_moe(x, ew, w, ids, cfg)
    assert out.shape == (T, 256) and out.dtype == torch.bfloat16
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


@pytest.mark.parametrize("T", [1, 6])
def test_fp8_moe_partial_tiles_and_scale_blocks(T):
    """I = 80 and D = 200: N is no multiple of BLOCK_N, K no multiple of BLOCK_K or 128, gate
    and up each have one partial scale block (up's rows start at scale row 1, not 0)."""
    ew = _experts(5, 200, 80)
    assert ew.w13_scale.shape[1:] == (2, 2) and ew.w2_scale.shape[1:] == (2, 1)
    ids, w = _ragged_routing(T, 2, 5)
    x = torch.randn(T, 200, device=DEVICE, dtype=torch.bfloat16)
    out = fp8_moe.fp8_moe(x, ew, w, ids, _cfg(16, 32, 64, bn2=64, bk2=32))
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


def test_fp8_moe_default_table_and_generic_kernel_agree():
    """The default table's pick (decode entry) against the generic kernel it replaces."""
    ew = _experts(4, 256, 128)
    ids, w = _ragged_routing(2, 2, 4)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    assert rel(fp8_moe.fp8_moe(x, ew, w, ids), fm.fused_moe(x, ew, w, ids)) < 2e-2


def test_pick_config_by_pair_count():
    table = [
        {"max_pairs": 8, "BLOCK_M": 16, "w13": {"BLOCK_N": 32}},
        {"max_pairs": None, "BLOCK_M": 64, "w13": {"BLOCK_N": 128}, "w2": {"BLOCK_N": 64}},
    ]
    assert fp8_moe.pick_config(8, table) == {
        "BLOCK_M": 16,
        "w13": {"BLOCK_N": 32},
        "w2": {"BLOCK_N": 32},
    }
    assert fp8_moe.pick_config(9, table)["w2"] == {"BLOCK_N": 64}
    assert fp8_moe.pick_config(1)["BLOCK_M"] == 16  # the default table
    assert fp8_moe.pick_config(10**6)["BLOCK_M"] >= 32
    with pytest.raises(ValueError, match="no config covers"):
        fp8_moe.pick_config(9, table[:1])


@pytest.mark.parametrize(
    "bad, match",
    [
        (_cfg(16, 256, 128), "BLOCK_N=256"),  # a tile spanning two scale blocks
        (_cfg(16, 32, 96), "BLOCK_K=96"),
        (_cfg(8, 32, 128), "BLOCK_M=8"),
        (_cfg(16, 32, 128, gm=0), "GROUP_M=0"),
    ],
)
def test_bad_configs_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        fp8_moe.check_config(bad)


def test_fp8_moe_rejects_other_formats_and_shapes():
    ew = _experts(2, 128, 128)
    x = torch.randn(1, 128, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    w = torch.ones(1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden size"):
        fp8_moe.fp8_moe(x[:, :64], ew, w, ids)
    with pytest.raises(ValueError, match="top_k"):
        fp8_moe.fp8_moe(x, ew, w, ids.repeat(1, 2))
    bf = fm.ExpertWeights("bf16", ew.w13.bfloat16(), ew.w2.bfloat16())
    with pytest.raises(ValueError, match="not 'fp8'"):
        fp8_moe.fp8_moe(x, bf, w, ids)


@pytest.mark.parametrize(
    ("impl", "T", "ran"),
    [
        ("auto", 5, "generic"),  # 15 pairs <= fp8_generic_max_pairs=15
        ("auto", 6, "gemm"),  # 18 pairs > 15
        ("gemm", 1, "gemm"),
        ("kernel", 6, "generic"),
    ],
)
def test_fused_moe_backend_fp8_routing(impl, T, ran, monkeypatch):
    """FusedMoEBackend on fp8 experts: "auto" runs the generic kernel up to the table's
    fp8_generic_max_pairs (token, expert) pairs and the grouped GEMMs above; "gemm" / "kernel"
    force one; every path gives the reference result."""
    import k2serve.moe.fused_moe as backend_mod
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    calls = []
    for name, tag in (("fp8_moe", "gemm"), ("fused_moe", "generic")):
        real = getattr(backend_mod, name)
        monkeypatch.setattr(
            backend_mod, name, lambda *a, _r=real, _t=tag, **k: calls.append(_t) or _r(*a, **k)
        )
    ew = _experts(4, 256, 128)
    kw = KernelPolicy.reference().moe_kwargs()
    assert kw["fp8_impl"] == "auto" and kw["fp8_table"] and kw["fp8_generic_max_pairs"] > 0
    be = FusedMoEBackend(ew, **dict(kw, fp8_impl=impl, fp8_generic_max_pairs=15))
    ids, w = _ragged_routing(T, 3, 4)
    x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
    assert be.fp8_uses_gemm(T * 3) is (ran == "gemm")
    out = be(x, ids, w)
    assert calls == [ran]
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


def test_fused_moe_backend_fp8_limit_from_the_policy():
    """The shipped limit reaches the backend: decode-sized batches (<= T=256 x top-8 on K2) run
    the generic kernel, larger ones the grouped GEMMs; non-fp8 experts ignore fp8_impl."""
    from k2serve.kernels.policy import KernelPolicy, load_tables
    from k2serve.moe.fused_moe import FusedMoEBackend

    n = load_tables().fp8_moe_generic_max_pairs
    assert n == 2048
    be = FusedMoEBackend(_experts(2, 128, 128), **KernelPolicy.reference().moe_kwargs())
    assert be.fp8_generic_max_pairs == n
    assert not be.fp8_uses_gemm(8) and not be.fp8_uses_gemm(n) and be.fp8_uses_gemm(n + 1)
    ew = _experts(2, 128, 128)
    bf = fm.ExpertWeights("bf16", ew.w13.bfloat16(), ew.w2.bfloat16())
    assert FusedMoEBackend(bf, fp8_impl="gemm").fp8_impl is None


def test_fused_moe_backend_rejects_bad_fp8_settings():
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _experts(2, 128, 128)
    with pytest.raises(ValueError, match="fp8_impl"):
        FusedMoEBackend(ew, fp8_impl="fast")
    with pytest.raises(ValueError, match="max_pairs null"):
        FusedMoEBackend(ew, fp8_table=[{"max_pairs": 4, **_cfg(16, 32, 128)}])
    with pytest.raises(ValueError, match="BLOCK_N=48"):
        FusedMoEBackend(ew, fp8_table=[{"max_pairs": None, **_cfg(16, 48, 128)}])
    with pytest.raises(ValueError, match="fp8_generic_max_pairs"):
        FusedMoEBackend(ew, fp8_generic_max_pairs=-1)
