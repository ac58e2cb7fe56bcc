"""The grouped INT4 decode GEMV's variants for large decode batches (issue 28's B=128 target):
STAGES (the K loop software-pipelined), X2 (word pairs, kernels/int4_x2.py), NPB (N-blocks per
program) and their mixes with the existing options, against the torch reference on ragged
routing. On CPU they run under Triton's interpreter (plain-Triton arithmetic); on a GPU the
inline-PTX paths run, and `test_b128_x2_word_pair_arithmetic` checks them against exact math.
Run alone: `pytest tests/kernels -k b128`."""

import pytest
import torch

from k2serve.kernels import fused_moe as fm

triton = pytest.importorskip("triton")
tl = triton.language
from k2serve.kernels.int4_x2 import dot_x2, dq_x2  # noqa: E402 - needs Triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _x2_kernel(p_ptr, a_ptr, o_ptr, N: tl.constexpr, USE_ASM: tl.constexpr):
    """o[i] = dot_x2(dq_x2(p[i]), a[:, i]) (a: 4 activation planes of N int64)."""
    i = tl.arange(0, N)
    q0, q1, q2, q3 = dq_x2(tl.load(p_ptr + i), USE_ASM)
    a0 = tl.load(a_ptr + i)
    a1 = tl.load(a_ptr + N + i)
    a2 = tl.load(a_ptr + 2 * N + i)
    a3 = tl.load(a_ptr + 3 * N + i)
    tl.store(o_ptr + i, dot_x2(q0, q1, q2, q3, a0, a1, a2, a3, USE_ASM))


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _experts(E, D, I, group=32):  # noqa: E741
    def pk(n, k):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=DEVICE)

    def sc(n, k):
        return (torch.rand(E, n, k // group, device=DEVICE) * 0.004 + 0.002).bfloat16()

    return fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), group)


def _ragged(T=7, E=6, D=128):
    """Uneven pairs per expert: expert 0 in every token (7 rows: two blocks of 4), expert 1 in
    three, expert 2 in two, expert 4 in one, experts 3 and 5 in none; rows far from unit."""
    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    x[1] *= 1e-4
    x[3] *= 300.0
    w = torch.rand(T, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 0], [0, 1], [0, 2], [1, 0], [0, 4], [0, 4]][:T],
                       device=DEVICE)  # fmt: skip
    return x, w, ids


def test_b128_x2_word_pair_arithmetic():
    """dq_x2 + dot_x2 on random word pairs and fp16 activations (as pack_h2 lays them out)
    against exact float64 math: the plain path here; on a GPU also the inline PTX, whose fp16
    chain must agree to its rounding (8 products per half) and never overflow at the bound."""
    from k2serve.kernels.int4_dequant import use_asm

    N = 64
    p = torch.randint(-(2**62), 2**62, (N,), dtype=torch.int64)
    xs = (torch.rand(N, 16) * 1022 - 511).half()  # |x| < 512, as pack_h2 scales
    p[0] = 0  # every nibble 0: weights -8, the largest products, one sign: the bound
    xs[0] = 511.0

    def pair(lo, hi):
        return (lo.view(torch.int16).long() & 0xFFFF) | (
            (hi.view(torch.int16).long() & 0xFFFF) << 16
        )

    # plane j: (x_j, x_j+4) of word 2i in the low half, (x_8+j, x_12+j) of word 2i+1 high
    a = torch.stack([pair(xs[:, j], xs[:, j + 4]) | (pair(xs[:, 8 + j], xs[:, 12 + j]) << 32)
                     for j in range(4)])  # fmt: skip
    nib = torch.stack([(p >> (4 * c)) & 0xF for c in range(16)], 1).double() - 8
    exact = (nib * xs.double()).sum(1)
    for asm in sorted({False, use_asm(True)}):
        o = torch.empty(N, device=DEVICE)
        _x2_kernel[(1,)](p.to(DEVICE), a.to(DEVICE).contiguous(), o, N=N, USE_ASM=asm)
        o = o.double().cpu()
        assert torch.isfinite(o).all()
        # fp32 sums: ulp(65408) = 2^-8; the fp16 chain: |partial sums| < 32768, ulp <= 16
        tol = 0.05 if not asm else 8 * 16.0
        assert (o - exact).abs().max().item() <= tol, (asm, (o - exact).abs().max().item())
    assert exact[0].item() == -8 * 511.0 * 16


def test_b128_policy_table_variant_keys_load():
    """The shipped table's grouped entry carries the variant switches (today: off) and runs."""
    from k2serve.kernels import int4_gemv
    from k2serve.kernels.policy import load_tables

    cfg = dict(load_tables().int4_decode_grouped)
    assert {"STAGES", "X2"} <= set(cfg) and not cfg["X2"] and not cfg["STAGES"]
    ew = _experts(6, 128, 128)
    x, w, ids = _ragged(T=4)
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


VARIANTS = [
    dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, STAGES=2),
    dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, STAGES=3, w2=dict(STAGES=0)),
    dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, X2=1),
    dict(BLOCK_M=2, BLOCK_N=16, W=16, num_warps=4, X2=1, STAGES=3, GS=0),
    dict(
        BLOCK_M=8,
        BLOCK_N=32,
        W=32,
        num_warps=4,
        X2=1,
        STAGES=3,
        w2=dict(BLOCK_N=64, W=16, X2=0, F16SUM=1),
    ),  # fmt: skip
    dict(BLOCK_M=1, BLOCK_N=32, W=16, num_warps=2, X2=1, STAGES=2, SKIP=0),
    dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4, F16SUM=1, STAGES=3),
    dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, STAGES=3, NPB=3),  # 4 / 8 N-blocks: a tail
    dict(BLOCK_M=2, BLOCK_N=32, W=16, num_warps=4, X2=1, STAGES=2, w2=dict(NPB=4)),
    dict(
        BLOCK_M=4, BLOCK_N=16, W=32, num_warps=4, X2=1, STAGES=3, NPB=4, maxnreg=128, w2=dict(W=32)
    ),  # fmt: skip
]


@pytest.mark.parametrize("cfg", VARIANTS)
def test_b128_grouped_variants_match_reference(cfg):
    """Each variant equals the reference (X2: and the current kernel, to the rounding of its
    fp16 sums); the output is bf16 of the input's shape."""
    from k2serve.kernels import int4_gemv

    ew = _experts(6, 128, 128)
    x, w, ids = _ragged()
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    ref = fm.fused_moe_ref(x, ew, w, ids)
    assert rel(out, ref) < 2e-2
    if cfg.get("X2"):  # the same sums as the current kernel, in another order
        base = {k: v for k, v in cfg.items() if k not in ("STAGES", "X2", "w2")}
        cur = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, base)
        assert rel(out, cur) < 1e-2


@pytest.mark.parametrize("x2", [0, 1])
def test_b128_one_token_and_a_single_expert(x2):
    """T=1 (one block per expert, 3 padding rows each) and every token on the same two
    experts (one expert's rows over many blocks), pipelined."""
    from k2serve.kernels import int4_gemv

    ew = _experts(4, 256, 128)
    cfg = dict(BLOCK_M=4, BLOCK_N=32, W=16, num_warps=4, X2=x2, STAGES=3)
    for T, ids in ((1, [[3, 1]]), (9, [[2, 0]] * 9)):
        x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
        w = torch.rand(T, 2, device=DEVICE)
        idt = torch.tensor(ids, device=DEVICE)
        out = int4_gemv.int4_moe_decode_grouped(x, ew, w, idt, cfg)
        assert rel(out, fm.fused_moe_ref(x, ew, w, idt)) < 2e-2


def test_b128_grouped_variants_reject_bad_configs():
    from k2serve.kernels import int4_gemv

    ew = _experts(2, 256, 128)
    x, w = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16), torch.rand(1, 1, device=DEVICE)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    base = dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4)
    with pytest.raises(ValueError, match="not both"):
        int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, {**base, "STAGES": 2, "PREFETCH": 1})
    with pytest.raises(ValueError, match="not both"):
        int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, {**base, "NPB": 2, "PREFETCH": 1})
    with pytest.raises(ValueError, match="not both"):
        int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, {**base, "X2": 1, "F16SUM": 1})
    ew8 = _experts(2, 256, 128, group=8)  # one word per group: no word pairs
    with pytest.raises(ValueError, match="X2"):
        int4_gemv.int4_moe_decode_grouped(x, ew8, w, ids, {**base, "X2": 1})
    buf = torch.randint(0, 2**31 - 1, (2, 256, 33), dtype=torch.int32, device=DEVICE)
    odd = fm.ExpertWeights("int4", buf[:, :, 1:], ew.w2, ew.w13_scale, ew.w2_scale, 32)
    with pytest.raises(ValueError, match="int64"):  # odd word offset: no int64 view
        int4_gemv.int4_moe_decode_grouped(x, odd, w, ids, {**base, "X2": 1})
