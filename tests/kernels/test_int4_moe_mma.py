"""The tensor-core INT4 decode MoE (kernels/int4_moe_mma.py) against the torch reference on
ragged routings (small shapes through Triton's interpreter on CPU; the same code on CUDA), and
at K2 sizes against the per-pair GEMV on a GPU."""

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


CFGS = [
    dict(
        BLOCK_M=16, BLOCK_N=64, KW=16, SWAP=1, ATOMIC=0, ETAB=1, SPLIT=1, num_warps=4, num_stages=2
    ),  # fmt: skip
    dict(
        BLOCK_M=8,
        BLOCK_N=32,
        KW=32,
        SWAP=0,
        ATOMIC=1,
        ETAB=0,
        num_warps=4,
        num_stages=3,
        w2=dict(BLOCK_N=64, KW=16, SWAP=1, ATOMIC=0, ETAB=1),
    ),  # fmt: skip
    dict(BLOCK_M=16, BLOCK_N=128, KW=16, SWAP=1, ATOMIC=1, ETAB=2, num_warps=8, num_stages=2),
]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("T, k", [(1, 2), (20, 4)])  # 20 x 4 also has 5 x 4's partial blocks
def test_int4_moe_mma_matches_reference(cfg, T, k):
    """Blocks with one real row, blocks split over an expert's 20 rows, an expert without rows,
    a partial N block (BLOCK_N 128 over hidden 512 and intermediate 256 is whole; 64 over 256
    also), K steps of 16 KW with KW shrunk where the K does not take it."""
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    E, D, I = 12, 512, 256  # noqa: E741
    ew = experts(E, D, I)
    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE)
    ids = ragged_ids(T, E, k)
    out = int4_moe_mma(x, ew, w, ids, cfg)
    assert out.shape == (T, D) and out.dtype == torch.bfloat16
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < TOL


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
    out = int4_moe_mma(x, ew, w, ids, dict(BLOCK_M=16, BLOCK_N=32, num_warps=4))
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
    cfg = dict(BLOCK_M=8, BLOCK_N=64, ATOMIC=1)
    on = torch.ones(1, dtype=torch.int32, device=DEVICE)
    base = int4_moe_mma(x, ew, w, ids, cfg)
    assert rel(int4_moe_mma(x, ew, w, ids, cfg, active=on), base) < 1e-6
    off = int4_moe_mma(x, ew, w, ids, cfg, active=on * 0)
    assert torch.count_nonzero(off) == 0


def test_plane_order_is_the_gemm_order():
    """The activation layout is int4_gemm's (one permutation for both kernels)."""
    from k2serve.kernels.int4_gemm import to_gemm_order
    from k2serve.kernels.int4_moe_mma import to_plane_order

    x = torch.arange(2 * 1024, dtype=torch.float32).view(2, 1024)
    for kw in (16, 32):
        assert torch.equal(to_plane_order(x, kw), to_gemm_order(x, kw))


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
    small = experts(4, 128, 256)  # hidden 128: no K step of 16 KW = 256 columns
    with pytest.raises(ValueError, match="multiple of 16 KW"):
        int4_moe_mma(torch.randn(2, 128, device=DEVICE, dtype=torch.bfloat16), small, w, ids)
    g64 = fm.ExpertWeights("int4", ew.w13, ew.w2, ew.w13_scale[..., ::2], ew.w2_scale[..., ::2],
                           64)  # fmt: skip
    with pytest.raises(ValueError, match="group 32"):
        int4_moe_mma(x, g64, w, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [32, 128, 256])
def test_int4_moe_mma_k2_sizes_against_the_decode_gemv(T):
    """One K2 MoE layer (384 experts of 7168 x 2048, top-8, uniform routing): two configs
    against the per-pair GEMV within 4e-3 (3.6-3.8e-3 in the H100 sweeps: bf16 weights and
    activations against the GEMV's exact weights and fp16 activations)."""
    from k2serve.kernels.int4_gemv import int4_moe_decode
    from k2serve.kernels.int4_moe_mma import int4_moe_mma
    from k2serve.kernels.policy import load_tables

    torch.manual_seed(T)
    E, D, I, k = 384, 7168, 2048, 8  # noqa: E741
    ew = experts(E, D, I, "cuda")
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, device="cuda"), -1)
    ids = torch.rand(T, E, device="cuda").argsort(-1)[:, :k].int()
    ref = int4_moe_decode(x, ew, w, ids, dict(load_tables().int4_decode))
    wide = dict(BLOCK_N=64, SWAP=1, ETAB=2, ATOMIC=1, num_warps=4, num_stages=2)
    for cfg in (None, wide):  # the default (16x32 mma.sync) and the 16x64 wgmma tile
        assert rel(int4_moe_mma(x, ew, w, ids, cfg), ref) < 4e-3
