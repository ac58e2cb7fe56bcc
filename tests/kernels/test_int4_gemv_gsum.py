"""The grouped decode GEMV with f16 group sums: GSUM (kernels/int4_gemv_gsum.py, config key
GSUM of int4_moe_decode_grouped) and F16SUM 2 of the grouped kernel (kernels/int4_gemv.py):
against the float32 reference with the grouped GEMV tests' tolerance,
and the f16 overflow bound (every weight -8, every activation at its row's largest magnitude).
On CPU the interpreter runs the plain path, which sums each group in fp16 as the inline PTX
does, so an activation range too wide for the 32-product sum shows up as inf here too."""

import pytest
import torch
from test_kernels import DEVICE, _int4_experts, ragged_decode_case, rel

from k2serve.kernels import fused_moe as fm

TOL = 2e-2  # tests/kernels/test_kernels.py's grouped GEMV tolerance


def _worst_case(D, I):  # noqa: E741
    """Every nibble 0 (weight -8), unit-ish scales; rows of one value each, right under a power
    of two, both signs (the negative rows give silu(gate) * up > 0, so the down launch sees
    its worst case too)."""
    w13 = torch.zeros(2, 2 * I, D // 8, dtype=torch.int32, device=DEVICE)
    w2 = torch.zeros(2, D, I // 8, dtype=torch.int32, device=DEVICE)
    s13 = torch.full((2, 2 * I, D // 32), 2.0**-12, dtype=torch.bfloat16, device=DEVICE)
    s2 = torch.full((2, D, I // 32), 2.0**-8, dtype=torch.bfloat16, device=DEVICE)
    ew = fm.ExpertWeights("int4", w13, w2, s13, s2, 32)
    x = torch.empty(4, D, dtype=torch.bfloat16, device=DEVICE)
    x[0::2] = 255.0
    x[1::2] = -127.5
    ids = torch.tensor([[0, 1]] * 4, device=DEVICE)
    return ew, x, torch.ones(4, 2, device=DEVICE), ids


# the shipped grouped kernel (_int4_gemv_h2_grouped_kernel) at the tables' tile, no f16 sums
SHIPPED = dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4, GS=1)


@pytest.fixture(scope="module")
def ragged():
    """Ragged routing (expert 0 in every token, expert 3 in none, padding rows), rows far from
    unit scale; its float32 reference and the shipped grouped kernel's output, computed once
    for every config below."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(4, 256, 128)
    x, w, ids = ragged_decode_case(ew)
    ref = fm.fused_moe_ref(x, ew, w, ids)
    ship = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, SHIPPED)
    assert rel(ship, ref) < TOL
    return ew, x, w, ids, ref, ship


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4, GSUM=1),
        dict(BLOCK_M=2, BLOCK_N=32, W=8, num_warps=4, GSUM=1, SKIP=0, PREFETCH=1),
        dict(BLOCK_M=8, BLOCK_N=64, W=16, num_warps=4, GSUM=1, w2=dict(BLOCK_N=16, W=8)),
        dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4, GS=1, F16SUM=2),
        dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, GSUM=1, KT=1, CHAINS=4, CG=1),
    ],
)
def test_gsum_matches_reference_and_shipped(ragged, cfg):
    """Within the tolerance of the float32 reference, and close to the shipped grouped kernel
    (the grouped kernel's other tiles against the reference: test_kernels.py)."""
    from k2serve.kernels import int4_gemv

    ew, x, w, ids, ref, ship = ragged
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert rel(out, ref) < TOL
    assert rel(out, ship) < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, GSUM=1),
        dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, GS=1, F16SUM=2),
    ],
)
def test_group_f16_sums_cannot_overflow_and_the_bound_is_needed(monkeypatch, cfg):
    """Worst case: finite and equal to the reference with the range [64, 128) (GSUM, and the
    grouped kernel's F16SUM 2); packed into the per-word kernel's [256, 512) the 32-product
    fp16 sums overflow (so this test would catch a range too wide)."""
    from k2serve.kernels import int4_gemv, int4_gemv_gsum

    ew, x, w, ids = _worst_case(128, 128)  # the bound is a group's: hidden 128 takes W=16
    ref = fm.fused_moe_ref(x, ew, w, ids)
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL
    monkeypatch.setattr(int4_gemv_gsum, "GSUM_TOP", 8)
    bad = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert not torch.isfinite(bad).all()


def test_gsum_with_another_group_size_runs_the_grouped_kernel():
    """GSUM needs group 32 (4 words a group); other group sizes take the grouped kernel (with
    the GSUM config's narrower activation range, which is safe) and stay exact."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(2, 256, 128)
    ew = fm.ExpertWeights("int4", ew.w13, ew.w2, ew.w13_scale[..., ::2].contiguous(),
                          ew.w2_scale[..., ::2].contiguous(), 64)  # fmt: skip
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    w, ids = torch.rand(3, 2, device=DEVICE), torch.tensor([[0, 1], [1, 0], [0, 1]], device=DEVICE)
    cfg = dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4, GSUM=1, KT=1, maxnreg=128)
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the inline-PTX chain)")
@pytest.mark.parametrize(
    "extra",
    [dict(GSUM=1), dict(GSUM=1, CHAINS=4, PREFETCH=1), dict(GSUM=1, KT=1, CG=1), dict(F16SUM=2)],
)
def test_group_f16_sums_k2_sizes_on_the_gpu(extra):
    """K2 sizes (7168 x 2048, 32 experts for memory), T=128 tokens, the inline-PTX path:
    against the reference and the shipped config, and the worst case."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(32, 7168, 2048)
    T = 128
    x = torch.randn(T, 7168, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, 8, device=DEVICE)
    ids = torch.rand(T, 32, device=DEVICE).argsort(-1)[:, :8].int()
    cfg = dict(BLOCK_M=4, BLOCK_N=16, W=64, num_warps=4, **extra)
    ref = fm.fused_moe_ref(x, ew, w, ids)
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    ship = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, dict(BLOCK_M=4, BLOCK_N=16, W=64,
                                                                 num_warps=4, GS=1))  # fmt: skip
    assert rel(out, ref) < TOL and rel(out, ship) < TOL
    ewo, xo, wo, ido = _worst_case(7168, 2048)
    out = int4_gemv.int4_moe_decode_grouped(xo, ewo, wo, ido, cfg)
    assert torch.isfinite(out).all() and rel(out, fm.fused_moe_ref(xo, ewo, wo, ido)) < TOL
