"""The tensor-core INT4 decode MoE's entry point (kernels/int4_moe_mma.py: configs, the
`active` flag, rows far from unit) through Triton's interpreter on CPU (the same code on CUDA),
and the helpers test_int4_moe_mma16.py (the f16 kernel itself) shares: `experts`,
`ragged_ids`, `rel`."""

import pytest
import torch

from k2serve.kernels import fused_moe as fm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-2 if DEVICE == "cuda" else 2e-2  # the interpreter rounds fp32 -> bf16 toward zero


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def experts(E, D, I, dev=DEVICE):  # noqa: E741
    def pk(n, k):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=dev)

    def sc(n, k):
        return (torch.rand(E, n, k // 32, device=dev) * 0.004 + 0.002).bfloat16()

    return fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)


def ragged_ids(T, E, k, hot=0):
    """[T, k] distinct experts per token: expert `hot` in every token (its rows span several
    aligned blocks once T > BLOCK_M), expert E - 1 in none, expert E - 2 in exactly one."""
    ids = torch.empty(T, k, dtype=torch.int32)
    for t in range(T):
        rest = torch.randperm(E - 3)[: k - 1] + 1  # experts 1..E-3
        ids[t, 0] = hot
        ids[t, 1:] = rest
    if T > 1:
        ids[T // 2, k - 1] = E - 2
    return ids.to(DEVICE)


def test_int4_moe_mma_agrees_with_the_decode_gemv_and_rows_far_from_unit():
    """The same result as the per-pair GEMV (the reference path of the device sweep) on a
    routing with int64 ids, rows scaled far from unit (bf16 activations keep their range)."""
    from k2serve.kernels.int4_gemv import int4_moe_decode
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    ew = experts(8, 256, 256)
    T, k = 6, 3
    x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
    x[1] *= 1e-4
    x[4] *= 300.0
    w = torch.rand(T, k, device=DEVICE)
    ids = torch.stack([torch.randperm(8)[:k] for _ in range(T)]).to(DEVICE)
    ref = int4_moe_decode(x, ew, w, ids, dict(BLOCK_N=64, W=16, num_warps=4))
    out = int4_moe_mma(x, ew, w, ids, dict(BLOCK_M=16, BLOCK_N=32, num_warps=4))  # F16 default
    assert rel(out, ref) < TOL
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < TOL


def test_int4_moe_mma_active_flag():
    """active 1: the same output; active 0: every program returns at once (the atomic
    down launch's zeroed output stays zero)."""
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    ew = experts(4, 256, 256)
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(3, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2]], device=DEVICE)
    cfg = dict(BLOCK_M=8, BLOCK_N=64, G=2, ATOMIC=1)
    on = torch.ones(1, dtype=torch.int32, device=DEVICE)
    base = int4_moe_mma(x, ew, w, ids, cfg)
    assert rel(int4_moe_mma(x, ew, w, ids, cfg, active=on), base) < 1e-6
    off = int4_moe_mma(x, ew, w, ids, cfg, active=on * 0)
    assert torch.count_nonzero(off) == 0


def test_int4_moe_mma_rejects_bad_configs_and_weights():
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    ew = experts(4, 256, 256)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(2, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    with pytest.raises(ValueError, match="unknown config keys"):
        int4_moe_mma(x, ew, w, ids, dict(BLOCK_K=64))
    with pytest.raises(ValueError, match="one BLOCK_M"):
        int4_moe_mma(x, ew, w, ids, dict(BLOCK_M=16, w2=dict(BLOCK_M=8)))
    with pytest.raises(ValueError, match="powers of two"):
        int4_moe_mma(x, ew, w, ids, dict(BLOCK_N=48))
    small = experts(4, 64, 256)  # hidden 64: no K step of 32 G = 128 columns (G=4)
    with pytest.raises(ValueError, match="multiple of 32 G"):
        int4_moe_mma(torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16), small, w, ids)
    # wave 9's bf16 design is gone: its configs are refused, naming the f16 design
    for old in (dict(F16=0), dict(w2=dict(F16=0)), dict(KW=16, ETAB=2), dict(SPLIT=1)):
        with pytest.raises(ValueError, match="bf16 tensor-core design .* removed.*F16=1"):
            int4_moe_mma(x, ew, w, ids, old)
    g64 = fm.ExpertWeights("int4", ew.w13, ew.w2, ew.w13_scale[..., ::2], ew.w2_scale[..., ::2],
                           64)  # fmt: skip
    with pytest.raises(ValueError, match="group 32"):
        int4_moe_mma(x, g64, w, ids)
