"""The f16 tensor-core INT4 decode MoE (kernels/int4_moe_mma16.py, config F16=1 of
int4_moe_mma): each launch against a float32 reference of the same quantized math (exact
weights, bf16 activations, fp32 sums: agreement to fp32 rounding), the whole MoE against the
torch reference on ragged routings (padding rows, partial blocks, experts without pairs), the
activation packing (exact, the f16 overflow bound) and, on a GPU, K2 sizes against the
per-pair GEMV."""

import pytest
import torch
from test_int4_moe_mma import DEVICE, TOL, experts, ragged_ids, rel

from k2serve.kernels import fused_moe as fm

CFGS = [  # weights as the MMA's M (SWAP=1) or N, blocks of 8 / 16 pairs, 2 / 4 groups a step
    dict(F16=1),
    dict(
        F16=1,
        BLOCK_M=16,
        BLOCK_N=32,
        G=4,
        SWAP=0,
        ATOMIC=1,
        num_warps=4,
        w2=dict(BLOCK_N=64, G=2, SWAP=1, ATOMIC=1, num_warps=2),
    ),  # fmt: skip
]


def unpack(a, rs):
    """pack_f16's inverse: [M, K] in the original column order, float32."""
    M, K = a.shape
    v = a.float().view(M, K // 32, 2, 4, 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(M, K)
    return v * rs[:, None]


def test_pack_f16_is_exact_and_bounded():
    """bf16 rows of any range come back exactly; each row's largest |value| in [256, 512) (so
    f16 cannot overflow), zero rows stay zero, entries below ~2^-34 of their row's largest
    flush to zero (f16's subnormal floor; the rest of that row exact); the k order is the
    kernel's (nibble 4c + 2a + b of word t at 16a + 4t + 2b + c)."""
    from k2serve.kernels.int4_moe_mma16 import pack_f16

    x = torch.randn(6, 64, device=DEVICE).bfloat16()
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3] = 0
    x[4, 5] = 3.0e38  # near bf16's largest
    a, rs = pack_f16(x)
    assert a.dtype == torch.float16 and torch.isfinite(a).all()
    back = unpack(a, rs)
    assert torch.equal(back[[0, 1, 2, 3, 5]], x.float()[[0, 1, 2, 3, 5]])
    assert back[4, 5] == x[4, 5].float() and torch.count_nonzero(back[4]) == 1
    amax = a.float().abs().amax(1)
    live = amax > 0
    assert ((amax[live] >= 256) & (amax[live] < 512)).all() and not live[3]
    col = torch.arange(32.0, device=DEVICE)[None].repeat(1, 2)  # one row of column numbers
    p = pack_f16(col)[0][0, :32].float() * pack_f16(col)[1][0]
    t, j = p // 8, p % 8
    k = torch.arange(32.0, device=DEVICE)
    assert torch.equal(16 * (j % 4 // 2) + 4 * t + 2 * (j % 2) + j // 4, k)


@pytest.mark.parametrize("swap", [0, 1])
def test_f16_launches_match_fp32_reference(swap):
    """gate_up into float32 (silu(gate) * up not rounded) and down (top-k weight, float32
    out) against the same quantized math in float32: equal to fp32 rounding (< 1e-5), with an
    expert without pairs, padding rows and a partial N block."""
    from k2serve.kernels.int4_moe_mma16 import _launch, pack_f16
    from k2serve.kernels.moe_align import moe_align_block_size

    E, D, I, T, k = 6, 256, 192, 5, 2  # noqa: E741 - I = 192: a partial 128-row block, G=8
    # does not divide it: the down launch runs G=2
    ew = experts(E, D, I)
    x = torch.randn(T, D, device=DEVICE).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [0, 3], [1, 4], [0, 2]], device=DEVICE)  # 5: no pairs
    tw = torch.rand(T * k, device=DEVICE)
    cfg = dict(BLOCK_M=8, BLOCK_N=128, G=8 if swap else 2, SWAP=swap, num_warps=2 if swap else 4,
               num_stages=2)  # fmt: skip
    sid, eids, npost = moe_align_block_size(ids, E, 8)
    a, rs = pack_f16(x)
    h = torch.full((T * k, I), float("nan"), device=DEVICE)
    _launch(a, rs, ew.w13, ew.w13_scale, h, tw, sid, eids, npost, I, D, T * k, k, True, False,
            1, False, cfg)  # fmt: skip
    out = torch.zeros(T * k, D, device=DEVICE)
    a2, rs2 = pack_f16(h.bfloat16())
    _launch(a2, rs2, ew.w2, ew.w2_scale, out, tw, sid, eids, npost, D, I, T * k, 1, False, True,
            1, False, dict(cfg, G=2))  # fmt: skip
    for p in range(T * k):
        w13, w2 = fm.expert_dense(ew, int(ids.view(-1)[p]))
        g = x[p // k].float() @ w13.float().t()
        want = torch.nn.functional.silu(g[:I]) * g[I:]
        assert rel(h[p], want) < 1e-5, p
        want2 = (h[p].bfloat16().float() @ w2.float().t()) * tw[p]
        assert rel(out[p], want2) < 1e-5, p


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("T, k", [(1, 2), (20, 4)])
def test_int4_moe_mma_f16_matches_reference(cfg, T, k):
    """One-row blocks, an expert over several blocks (20 rows), an expert without rows."""
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    E, D, I = 12, 256, 128  # noqa: E741 - 2 K steps a launch (G=4 gate_up, G=2 down of cfg 1)
    ew = experts(E, D, I)
    x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE)
    ids = ragged_ids(T, E, k)
    out = int4_moe_mma(x, ew, w, ids, cfg)
    assert out.shape == (T, D) and out.dtype == torch.bfloat16
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < TOL


def test_f16_config_errors():
    from k2serve.kernels.int4_moe_mma import int4_moe_mma

    ew = experts(4, 256, 256)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(2, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    with pytest.raises(ValueError, match="G=3"):
        int4_moe_mma(x, ew, w, ids, dict(F16=1, G=3))
    with pytest.raises(ValueError, match="bf16 tensor-core design .* removed"):
        int4_moe_mma(x, ew, w, ids, dict(F16=1, w2=dict(F16=0)))
    with pytest.raises(ValueError, match="BLOCK_M >= 8"):
        int4_moe_mma(x, ew, w, ids, dict(F16=1, BLOCK_N=8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [32, 128, 256])
def test_int4_moe_mma_f16_k2_sizes(T):
    """One K2 MoE layer (384 experts of 7168 x 2048, top-8, uniform routing) against the
    per-pair GEMV within 4e-3 (exact weights, activations rounded only where the GEMV rounds
    them too: the bf16 intermediate)."""
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
    for cfg in CFGS:
        assert rel(int4_moe_mma(x, ew, w, ids, cfg), ref) < 4e-3


def test_dispatch_hook_band_and_config():
    """The tables' int4_decode_mma band (measured on the H100: T=128..256 x top-8) plans "mma"
    inside it only; a given config and band run int4_moe_mma with it; experts of another
    group size never plan it (the kernel reads group-32 scales)."""
    from k2serve.kernels.policy import load_tables
    from k2serve.moe.fused_moe import FusedMoEBackend

    t = load_tables()
    lo, hi = t.int4_decode_mma_min_pairs, t.int4_decode_mma_max_pairs
    ew = experts(6, 256, 256)
    be = FusedMoEBackend(ew)
    assert be.mma_config == dict(t.int4_decode_mma) and be.mma_config["F16"] == 1
    assert be.plan(lo // 8, 8)[0] == ("mma",) and be.plan(hi // 8, 8)[0] == ("mma",)
    assert be.plan(lo // 8 - 1, 8)[0] != ("mma",) and be.plan(hi // 8 + 1, 8)[0] != ("mma",)
    g64 = fm.ExpertWeights("int4", ew.w13, ew.w2, ew.w13_scale[..., ::2], ew.w2_scale[..., ::2],
                           64)  # fmt: skip
    assert all(FusedMoEBackend(g64).plan(T, 8)[0] != ("mma",) for T in (lo // 8, hi // 8))
    # nor as a candidate of a routing band (the tables' bands it cannot run are dropped)
    g = FusedMoEBackend(g64)
    assert not any("mma" in g.plan(T, 8)[0] for T in range(1, 2 * hi // 8))
    assert any("mma" in be.plan(T, 8)[0] for T in range(1, lo // 8))  # the band below lo
    be = FusedMoEBackend(ew, mma_config=dict(F16=1), mma_min_pairs=8, mma_max_pairs=16)
    assert be.plan(2, 4)[0] == ("mma",) and be.plan(4, 4)[0] == ("mma",)
    assert be.plan(1, 4)[0] != ("mma",) and be.plan(5, 4)[0] != ("mma",)
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(3, 4, device=DEVICE)
    ids = torch.stack([torch.randperm(6)[:4] for _ in range(3)]).to(DEVICE)
    assert rel(be(x, ids, w), fm.fused_moe_ref(x, ew, w, ids)) < TOL


def test_warmup_covers_the_mma_band():
    """engine.warmup's token counts reach the tables' "mma" path (each entry of a table of
    mma configs by pair count: its own key)."""
    from k2serve.engine.warmup import config_key, warmup_token_counts
    from k2serve.moe.fused_moe import FusedMoEBackend

    be = FusedMoEBackend(experts(6, 256, 256))
    keys = {config_key([be], n, 8) for n in warmup_token_counts([be], 8, 512)}
    assert ("mma", 0) in {p for k in keys for p in k[0][0]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_moe_backend_runs_mma_in_a_cuda_graph():
    """At T=128 x top-8 (one K2 layer) the default tables plan "mma"; the backend's output in a
    captured CUDA graph equals the eager one and the per-pair GEMV's within 4e-3."""
    from k2serve.kernels.int4_gemv import int4_moe_decode
    from k2serve.kernels.policy import load_tables
    from k2serve.moe.fused_moe import FusedMoEBackend

    torch.manual_seed(0)
    E, D, I, k, T = 384, 7168, 2048, 8, 128  # noqa: E741
    ew = experts(E, D, I, "cuda")
    be = FusedMoEBackend(ew)
    assert be.plan(T, k)[0] == ("mma",)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, device="cuda"), -1)
    ids = torch.rand(T, E, device="cuda").argsort(-1)[:, :k].int()
    eager = be(x, ids, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = be(x, ids, w)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ref = int4_moe_decode(x, ew, w, ids, dict(load_tables().int4_decode))
    assert rel(eager, ref) < 4e-3
