"""Each Triton kernel against its torch reference on fresh random inputs (small shapes on CPU
through the interpreter; the same code runs on CUDA). Real K2 sizes run in
benchmarks/model_speed.py."""

import pytest
import torch

from k2serve.kernels import fused_moe as fm
from k2serve.kernels import kv_store, mla_attention, moe_align, rmsnorm, router

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def paged(ctx, qlens, H=4, L=32, R=16, ps=16):
    seq = [c + q for c, q in zip(ctx, qlens, strict=True)]
    maxp = max(-(-s // ps) for s in seq)
    P = len(ctx) * maxp + 2
    kv = torch.randn(P, ps, L + R, dtype=torch.bfloat16, device=DEVICE)
    bt = torch.randperm(P)[: len(ctx) * maxp].view(len(ctx), maxp).int().to(DEVICE)
    qsl = torch.tensor(
        [0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE
    )
    T = sum(qlens)
    q = torch.randn(T, H, L, dtype=torch.bfloat16, device=DEVICE)
    qp = torch.randn(T, H, R, dtype=torch.bfloat16, device=DEVICE)
    c = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    return (q, qp, kv, qsl, c, bt), max(qlens), max(seq)


@pytest.mark.parametrize(
    "ctx,qlens,splits",
    [
        ([5, 40, 0], [1, 1, 1], None),
        ([33], [1], 4),
        ([0, 17], [20, 9], None),
        ([3], [2], 2),
        ([300], [1], None),
        ([70], [1], 16),
    ],  # fmt: skip
)
def test_mla_attention_matches_reference(ctx, qlens, splits):
    args, mq, ms = paged(ctx, qlens)
    out = torch.full_like(args[0], float("nan"))  # poisoned: every row must be written
    mla_attention.mla_attention(*args, 0.3, mq, ms, out=out, num_splits=splits)
    assert torch.isfinite(out).all()
    assert rel(out, mla_attention.mla_attention_ref(*args, 0.3)) < 1e-2


def test_mla_rejects_bad_cache_width():
    args, mq, ms = paged([4], [1])
    with pytest.raises(ValueError, match="kv_cache last dim"):
        mla_attention.mla_attention(args[0], args[1], args[2][..., :40], *args[3:], 0.3, mq, ms)


def test_store_latent_kv_matches_reference():
    c1 = torch.randn(6, 16, 48, dtype=torch.bfloat16, device=DEVICE)
    c2 = c1.clone()
    lat = torch.randn(20, 32, device=DEVICE, dtype=torch.bfloat16)
    pe = torch.randn(20, 16, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(96)[:20].to(DEVICE)
    slots[::5] = -1
    kv_store.store_latent_kv(c1, lat, pe, slots)
    kv_store.store_latent_kv_ref(c2, lat, pe, slots)
    assert torch.equal(c1, c2)


@pytest.mark.parametrize("with_res", [False, True])
def test_rms_norm_matches_reference(with_res):
    x = torch.randn(5, 300, dtype=torch.bfloat16, device=DEVICE)
    w = torch.rand(300, device=DEVICE) + 0.5
    r1 = torch.randn_like(x) if with_res else None
    r2 = r1.clone() if with_res else None
    out = rmsnorm.rms_norm(x, w, 1e-6, r1)
    assert rel(out, rmsnorm.rms_norm_ref(x, w, 1e-6, r2)) < 1e-2
    if with_res:
        assert rel(r1, r2) < 1e-2  # exact on GPU; the CPU interpreter rounds fp32->bf16 differently


@pytest.mark.parametrize("E,T,k,BM", [(10, 7, 3, 4), (40, 700, 6, 16)])  # one / many programs
def test_moe_align_invariants(E, T, k, BM):
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int().to(DEVICE)
    s, e, n = moe_align.moe_align_block_size(ids, E, BM)
    s2, e2, n2 = moe_align.moe_align_block_size_ref(ids, E, BM)
    assert int(n) == int(n2) and torch.equal(e, e2)
    M = ids.numel()
    used = s[: int(n)]
    assert sorted(used[used < M].tolist()) == list(range(M))  # each pair exactly once
    for i, p in enumerate(used.tolist()):
        if p < M:  # each pair sits in a block of its own expert
            assert ids.view(-1)[p] == e[i // BM]


def _experts(quant, E=6, D=512, I=256):  # noqa: E741
    if quant == "int4":

        def pk(n, k):  # noqa: E306
            return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32)

        def sc(n, k):  # noqa: E306
            return (torch.rand(E, n, k // 32) * 0.05 + 0.01).bfloat16()

        ew = fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I))
    elif quant == "fp8":
        w = lambda n, k: torch.randn(E, n, k).to(torch.float8_e4m3fn)  # noqa: E731
        s = lambda n, k: torch.rand(E, n // 128, k // 128) * 0.05  # noqa: E731
        ew = fm.ExpertWeights("fp8", w(2 * I, D), w(D, I), s(2 * I, D), s(D, I))
    else:
        w = lambda n, k: (torch.randn(E, n, k) * 0.05).bfloat16()  # noqa: E731
        ew = fm.ExpertWeights("bf16", w(2 * I, D), w(D, I))
    for f in ("w13", "w2", "w13_scale", "w2_scale"):
        if getattr(ew, f) is not None:
            setattr(ew, f, getattr(ew, f).to(DEVICE))
    return ew


@pytest.mark.parametrize("quant", ["int4", "bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 9])  # 9 tokens * 3 > 4 * 6 experts: the prefill config
def test_fused_moe_matches_reference(quant, T):
    ew = _experts(quant)
    x = torch.randn(T, 512, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(T)]).int().to(DEVICE)
    w = torch.rand(T, 3, device=DEVICE)
    assert rel(fm.fused_moe(x, ew, w, ids), fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


@pytest.mark.parametrize("T", [1, 9])
def test_fused_moe_fp8_with_partial_scale_blocks(T):
    """moe_intermediate not a multiple of 128 (the tiny test models: 64): gate and up each have
    their own 128-row scale block, so up's scales start at row cdiv(I, 128) of the stacked
    w13_scale, not at row I // 128 (which is gate's block again)."""
    from k2serve.quant.fp8 import quantize_fp8_block

    E, D, I = 4, 256, 64  # noqa: E741

    def proj(n, k):
        pairs = [quantize_fp8_block(torch.randn(n, k) * 0.05) for _ in range(E)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    (g, gs), (u, us), (d, ds) = proj(I, D), proj(I, D), proj(D, I)
    ew = fm.ExpertWeights("fp8", torch.cat([g, u], 1).to(DEVICE), d.to(DEVICE),
                          torch.cat([gs, us], 1).to(DEVICE), ds.to(DEVICE))  # fmt: skip
    x = torch.randn(T, D, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int().to(DEVICE)
    w = torch.rand(T, 2, device=DEVICE)
    # the reference from the per-projection dequantized weights, independent of the stacking
    from k2serve.quant.fp8 import dequantize_fp8_block

    def deq(q, s, e):
        return dequantize_fp8_block(q[e], s[e], (128, 128), torch.float32)

    want = torch.zeros(T, D)
    for t in range(T):
        for j in range(2):
            e = int(ids[t, j])
            xt = x[t].float().cpu()
            h = torch.nn.functional.silu(deq(g, gs, e) @ xt) * (deq(u, us, e) @ xt)
            want[t] += float(w[t, j]) * (deq(d, ds, e) @ h.bfloat16().float())
    assert rel(fm.fused_moe(x, ew, w, ids).float().cpu(), want) < 2e-2
    assert rel(fm.fused_moe_ref(x, ew, w, ids).float().cpu(), want) < 2e-2


def test_int4_dequant_ref_matches_packing():
    from k2serve.quant.int4 import quantize_int4

    w = torch.randn(16, 64)
    packed, scale, _ = quantize_int4(w, 32)
    deq = fm.dequant_int4_ref(packed, scale)
    assert (deq - w).abs().max() <= scale.float().max() * 0.5 + 1e-6


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_grouped_topk_matches_spec_loop(n_group, topk_group):
    lg, bias = torch.randn(12, 32), torch.randn(32) * 0.1
    w, ids = router.grouped_topk(lg, bias, 4, n_group, topk_group, True, 2.5)
    wr, ir = router.grouped_topk_ref(lg, bias, 4, n_group, topk_group, True, 2.5)
    for a, b, wa, wb in zip(ids.tolist(), ir.tolist(), w, wr, strict=True):
        assert set(a) == set(b)
        order = [b.index(e) for e in a]
        assert torch.allclose(wa.double(), wb[order], atol=1e-5)


def _int4_experts(E, D, I):  # noqa: E741
    def pk(n, k):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=DEVICE)

    def sc(n, k):
        return (torch.rand(E, n, k // 32, device=DEVICE) * 0.004 + 0.002).bfloat16()

    return fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)


def ragged_decode_case(ew):
    """Ragged routing over 4 experts for the grouped decode GEMVs: expert 0 in every token (its
    rows span several blocks), expert 3 in none, blocks with padding rows; rows scaled far
    from unit. (x [5, hidden] bf16, top-2 weights [5, 2], ids [5, 2])"""
    x = torch.randn(5, ew.hidden, device=DEVICE, dtype=torch.bfloat16)
    x[1] *= 1e-4
    x[3] *= 300.0
    w = torch.rand(5, 2, device=DEVICE)
    ids = torch.tensor([[0, 1], [2, 0], [0, 1], [0, 2], [1, 0]], device=DEVICE)
    return x, w, ids


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BLOCK_N=8, W=16, num_warps=4, GS=1, w2=dict(BLOCK_N=4, W=8, num_warps=2, GS=0)),
        dict(BLOCK_N=4, W=8, num_warps=2),
    ],
)
def test_int4_decode_gemv_matches_reference(cfg):
    """Hidden = inter = 128: 2 K blocks a row in each launch of W=8; the W=16 launch (cfg 0's
    gate_up, the tables' config) runs 2 in test_int4_decode_gemv_with_the_policy_tables."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(4, 128, 128)
    T, k = 3, 2
    x = torch.randn(T, 128, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE)
    ids = torch.stack([torch.randperm(4)[:k] for _ in range(T)]).int().to(DEVICE)
    ids[1] = ids[0]  # two tokens on the same experts
    if "w2" in cfg:  # rows far from unit scale (each row is scaled on its own): one launch
        x = x * torch.tensor([1.0, 1e-5, 1e3], device=DEVICE)[:, None]
    out = int4_gemv.int4_moe_decode(x, ew, w, ids, cfg)
    ref = fm.fused_moe_ref(x, ew, w, ids)
    for t in range(T):  # row by row: the 1e3 row would hide the others in one norm
        assert rel(out[t], ref[t]) < 2e-2, t


def test_int4_decode_gemv_with_the_policy_tables():
    """The shipped decode config (W shrunk to fit a small model) against the reference."""
    from k2serve.kernels import int4_gemv
    from k2serve.kernels.policy import load_tables

    ew = _int4_experts(4, 256, 128)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(2, 2, device=DEVICE)
    ids = torch.tensor([[0, 3], [2, 1]], device=DEVICE)
    out = int4_gemv.int4_moe_decode(x, ew, w, ids, load_tables().int4_decode)
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


@pytest.mark.parametrize(
    "cfg, asm",
    [
        (dict(BLOCK_M=2, BLOCK_N=32, W=16, num_warps=4, w2=dict(BLOCK_N=64, W=8, GS=0)), True),
        (dict(BLOCK_M=8, BLOCK_N=64, W=16, num_warps=4, SKIP=0), False),
        (dict(BLOCK_M=4, BLOCK_N=64, W=16, num_warps=4, PREFETCH=1), True),
    ],
)
def test_int4_decode_grouped_matches_reference(cfg, asm):
    """The grouped decode GEMV on ragged routing: expert 0 in every token (its rows span
    several blocks), expert 3 in none, blocks with padding rows; rows scaled far from unit."""
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(4, 256, 128)
    x, w, ids = ragged_decode_case(ew)
    out = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg, asm)
    assert out.shape == (5, 256) and out.dtype == torch.bfloat16
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


def test_int4_decode_grouped_rejects_bad_configs():
    from k2serve.kernels import int4_gemv

    ew = _int4_experts(2, 256, 128)
    x = torch.randn(1, 256, device=DEVICE, dtype=torch.bfloat16)
    w, ids = torch.rand(1, 1, device=DEVICE), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    base = dict(BLOCK_M=4, BLOCK_N=16, W=16, num_warps=4)
    with pytest.raises(ValueError, match="BLOCK_M"):
        int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, {**base, "BLOCK_M": 3})
    with pytest.raises(ValueError, match="one BLOCK_M"):
        int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, {**base, "w2": {"BLOCK_M": 2}})


def test_fused_moe_backend_runs_the_grouped_gemv_in_its_range(monkeypatch):
    """Pairs in [grouped_min_pairs, grouped_max_pairs] run the grouped GEMV, fewer the
    per-pair one, more the generic kernel here; the result is the reference either way."""
    from k2serve.kernels import int4_gemv
    from k2serve.moe import fused_moe as be_mod
    from k2serve.moe.fused_moe import FusedMoEBackend

    calls = []
    real = int4_gemv.int4_moe_decode_grouped

    def spy(*a, **kw):
        calls.append(a[3].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(be_mod, "int4_moe_decode_grouped", spy)
    ew = _int4_experts(4, 256, 256)  # sizes of 256: the planes / GEMV paths
    cfg = dict(BLOCK_M=4, BLOCK_N=64, W=16, num_warps=4)
    be = FusedMoEBackend(ew, "auto", "kernel", grouped_config=cfg, grouped_min_pairs=6,
                         grouped_max_pairs=8, decode_max_pairs=4,
                         decode_config=dict(BLOCK_N=64, W=16, num_warps=4))  # fmt: skip
    for T in (2, 3, 5):
        x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
        w = torch.rand(T, 2, device=DEVICE)
        ids = torch.stack([torch.randperm(4)[:2] for _ in range(T)]).int().to(DEVICE)
        assert rel(be(x, ids, w), fm.fused_moe_ref(x, ew, w, ids)) < 2e-2
    assert calls == [3]  # 4 pairs: the per-pair GEMV; 6: the grouped one; 10: the generic kernel
    assert FusedMoEBackend(ew, grouped_config={}).grouped_min_pairs is None  # no config: off


def test_pack_h2_layout_and_scale():
    """pack_h2: f16x2 pairs (x[8w+j], x[8w+j+4]) in planes of W words, row scale 2^e with
    max |x| / 2^e in [256, 512)."""
    from k2serve.kernels import int4_gemv

    W = 4
    x = torch.randn(3, 64, device=DEVICE) * torch.tensor([[1e-3], [1.0], [700.0]], device=DEVICE)
    x[1, 5] = 3.0  # row 1's largest magnitude: 2^e = 2^(1 - 8)
    a, rs = int4_gemv.pack_h2(x, W)
    assert a.shape == (3, 32) and a.dtype == torch.int32
    assert rs[1].item() == 2.0**-7
    amax = x.abs().amax(1)
    assert bool(((amax / rs >= 256) & (amax / rs < 512)).all())
    halves = a.view(torch.int16).view(torch.float16).float().view(3, 2, 4, W, 2)  # [r, b, j, w, h]
    for b, j, w, h in ((0, 0, 0, 0), (1, 3, 2, 1), (0, 2, 3, 1), (1, 1, 0, 0)):
        col = b * 8 * W + 8 * w + j + 4 * h
        want = (x[:, col] / rs).half().float()
        assert torch.equal(halves[:, b, j, w, h], want), (b, j, w, h)
    a2, rs2 = int4_gemv.pack_h2(x.t().contiguous().t(), W)  # column-major: same packing
    assert torch.equal(a2, a) and torch.equal(rs2, rs)


def test_int4_planes_dequant_and_grouped_mm():
    from k2serve.kernels import int4_dequant, int4_gemm

    ew = _int4_experts(3, 256, 128)
    d = int4_dequant.dequant_int4_planes(ew.w2, ew.w2_scale, 128)  # [3, 256, 128] plane order
    want = int4_dequant.permute_planes(fm.dequant_int4_ref(ew.w2[2], ew.w2_scale[2]), 128)
    assert rel(d[2], want) < 1e-2
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing in this torch")
    x = torch.randn(5, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(5, 2, device=DEVICE)
    ids = torch.stack([torch.randperm(3)[:2] for _ in range(5)]).to(DEVICE)
    out = int4_gemm.int4_moe_grouped_mm(x, ew, w, ids, chunk=2)
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


def test_permute_planes_is_a_column_permutation():
    from k2serve.kernels.int4_dequant import permute_planes

    x = torch.randn(2, 256)
    y = permute_planes(x, 128)
    assert y[0, 1 * 16 + 3].item() == x[0, 8 * 3 + 1].item()  # plane 1, word 3 = column 25
    assert torch.equal(y.sort(1).values, x.sort(1).values)
    with pytest.raises(ValueError, match="multiple of the plane block"):
        permute_planes(torch.randn(2, 100), 128)


def test_expanded_prefill_matches_absorbed_with_cached_prefix(monkeypatch):
    """A backend with prefill="expand": a prompt step over a cached prefix in the non-absorbed
    form (kv_b_proj + SDPA) equals the absorbed torch-reference path and the cache-free model."""
    from k2serve.attention import TorchMLABackend, allocate_kv_caches, triton_mla
    from k2serve.attention.base import AttentionMetadata
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(preset_config("tiny", "bf16", layers=2))
    model = load_model(None, load_format="dummy", config=cfg, device="cpu", dtype=torch.float32)
    ps, n0, n1 = 8, 13, 7
    ids = torch.randint(0, cfg.vocab_size, (n0 + n1,))

    def md(ctx, q):
        pages = torch.arange(4, dtype=torch.int32)[None]
        slots = torch.arange(ctx, ctx + q)
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            seq_lens=torch.tensor([ctx + q], dtype=torch.int32),
            context_lens=torch.tensor([ctx], dtype=torch.int32),
            block_table=pages, slot_mapping=slots, max_query_len=q, max_seq_len=ctx + q,
            page_size=ps,
        )  # fmt: skip

    calls = []
    orig = triton_mla.mla_prefill_expanded
    monkeypatch.setattr(triton_mla, "mla_prefill_expanded",
                        lambda *a: calls.append(1) or orig(*a))  # fmt: skip
    outs = {}
    for mode in ("absorbed", "expand"):
        be = TorchMLABackend()
        be.prefill = mode
        model.set_attn_backend(be)
        kv = allocate_kv_caches(cfg, 4, ps, torch.float32, "cpu")
        model(ids[:n0], torch.arange(n0), md(0, n0), kv)
        outs[mode] = model(ids[n0:], torch.arange(n0, n0 + n1), md(n0, n1), kv)
    assert len(calls) == 4  # 2 layers x 2 steps took the expanded path, only in "expand" mode
    full = model(ids, torch.arange(n0 + n1))[n0:]  # naive MLA, no cache
    assert rel(outs["expand"], outs["absorbed"]) < 1e-4
    assert rel(outs["expand"], full) < 1e-4


@pytest.mark.parametrize("fmt,host_lens", [("bf16", True), ("bf16", False), ("fp8", True)])
def test_expanded_prefill_in_a_mixed_step(monkeypatch, fmt, host_lens):
    """A step of two decodes, a prompt chunk over a cached prefix and a fresh prompt: with
    prefill="expand" the decodes stay absorbed (split_decodes) and the two prompts run expanded;
    every row equals the all-absorbed step and the cache-free model, with or without the
    metadata's host copies of the lengths (without them: one device read, same result); FP8
    block weights (kv_b_proj quantized, as in the FP8 checkpoints) too."""
    import numpy as np

    from k2serve.attention import TorchMLABackend, allocate_kv_caches, triton_mla
    from k2serve.attention.base import AttentionMetadata
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(preset_config("tiny", fmt, layers=2))
    model = load_model(None, load_format="dummy", config=cfg, device="cpu", dtype=torch.float32)
    ps, pages_per = 8, 4
    # per sequence: tokens cached by a first step, tokens of the mixed step
    plan = [(9, 1), (16, 1), (5, 6), (0, 11)]
    seqs = [torch.randint(0, cfg.vocab_size, (c + q,)) for c, q in plan]

    def meta(lens, rows):  # lens: (ctx, q) per sequence; rows: page-table rows
        qsl = np.concatenate([[0], np.cumsum([q for _, q in lens])]).astype(np.int32)
        ctx = np.array([c for c, _ in lens], dtype=np.int64)
        table = torch.tensor([[r * pages_per + j for j in range(pages_per)] for r in rows],
                             dtype=torch.int32)  # fmt: skip
        pos = [torch.arange(c, c + q) for c, q in lens]  # each new token's position
        slots = torch.cat([table[b][p // ps] * ps + p % ps for b, p in enumerate(pos)])
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl), seq_lens=torch.tensor(
                [c + q for c, q in lens], dtype=torch.int32),
            context_lens=torch.from_numpy(ctx.astype(np.int32)), block_table=table,
            slot_mapping=slots.long(), max_query_len=max(q for _, q in lens),
            max_seq_len=max(c + q for c, q in lens), page_size=ps,
            num_decodes=sum(q == 1 for _, q in lens),
            query_start_loc_host=qsl if host_lens else None,
            context_lens_host=ctx if host_lens else None,
        )  # fmt: skip

    calls = []
    orig = triton_mla.mla_prefill_expanded
    monkeypatch.setattr(triton_mla, "mla_prefill_expanded",
                        lambda *a: calls.append(a[5].num_seqs) or orig(*a))  # fmt: skip
    outs = {}
    for mode in ("absorbed", "expand"):
        be = TorchMLABackend()
        be.prefill = mode
        model.set_attn_backend(be)
        kv = allocate_kv_caches(cfg, pages_per * len(plan), ps, torch.float32, "cpu")
        first = [(b, c) for b, (c, _) in enumerate(plan) if c]  # the cached prefixes
        for b, c in first:  # one prompt step each (a pure prefill)
            model(seqs[b][:c], torch.arange(c), meta([(0, c)], [b]), kv)
        calls.clear()
        ids = torch.cat([s[c:] for s, (c, _) in zip(seqs, plan, strict=True)])
        pos = torch.cat([torch.arange(c, c + q) for c, q in plan])
        outs[mode] = model(ids, pos, meta(plan, range(len(plan))), kv)
        if mode == "expand":
            assert calls == [2, 2]  # per layer: the two prompts in one call, decodes apart
    assert rel(outs["expand"], outs["absorbed"]) < 1e-4
    t0 = 0
    for s, (c, q) in zip(seqs, plan, strict=True):
        full = model(s, torch.arange(c + q))[c:]  # naive MLA, no cache
        assert rel(outs["expand"][t0 : t0 + q], full) < 1e-4
        t0 += q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_qk_matches_model_rope(dtype):
    """The fused RoPE kernel writes out the torch code's roundings: both stay within that
    chain's error bound of the exact rotation (the CPU interpreter truncates instead of
    rounding: twice the bound). Inputs are strided views into wider rows, as in the model."""
    from k2serve.kernels import rope
    from k2serve.model.layers import YarnRotaryEmbedding

    T, H, N, R, L = 5, 3, 8, 16, 12
    emb = YarnRotaryEmbedding(R, 10000.0, {"type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}, 256)  # fmt: skip
    pos = torch.tensor([0, 3, 70, 200, 255], device=DEVICE)
    cos, sin = emb.cos_sin(pos)
    q = torch.randn(T, H, N + R, device=DEVICE).to(dtype)
    ckv = torch.randn(T, L + R, device=DEVICE).to(dtype)
    q_pe, k_pe = q[..., N:], ckv[:, L:]
    qo, ko = rope.rope_qk(q_pe, k_pe, cos, sin)
    qr, kr = YarnRotaryEmbedding.apply(q_pe, cos, sin), YarnRotaryEmbedding.apply(k_pe, cos, sin)
    assert qo.shape == (T, H, R) and ko.shape == (T, R) and qo.is_contiguous()
    bound = 3.3 if DEVICE == "cuda" else 6.6
    assert rope.rope_error_ratio(qr, q_pe, cos, sin) <= bound  # the bound holds for torch
    assert rope.rope_error_ratio(qo, q_pe, cos, sin) <= bound
    assert rope.rope_error_ratio(ko, k_pe, cos, sin) <= bound
    tol = 1e-2 if DEVICE == "cuda" else 3e-2  # truncation biases the interpreter's results
    assert rel(qo, qr) < tol and rel(ko, kr) < tol


@pytest.mark.parametrize("n_group,topk_group,E,k", [(1, 1, 48, 6), (4, 2, 32, 4), (8, 4, 64, 8)])
def test_fused_grouped_topk_matches_torch_and_spec(n_group, topk_group, E, k):
    lg = torch.randn(9, E, device=DEVICE)
    bias = torch.randn(E, device=DEVICE) * 0.1
    w, ids = router.fused_grouped_topk(lg, bias, k, n_group, topk_group, True, 2.5, torch.int64)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    wt, it = router.grouped_topk_torch(lg, bias, k, n_group, topk_group, True, 2.5)
    wr, ir = router.grouped_topk_ref(lg.cpu(), bias.cpu(), k, n_group, topk_group, True, 2.5)
    for a, b, c, wa, wb in zip(ids.tolist(), it.tolist(), ir.tolist(), w.cpu(), wr,
                               strict=True):  # fmt: skip
        assert set(a) == set(b) == set(c)
        order = [c.index(e) for e in a]
        assert torch.allclose(wa.double(), wb[order], atol=1e-5)


def test_gemv_matches_linear():
    """The one-row GEMV against F.linear in float32 (odd N: a masked last block)."""
    import torch.nn.functional as F

    from k2serve.kernels import gemv

    for N, K in ((10, 512), (33, 768)):
        w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        y = gemv.gemv(x, w)
        assert y.shape == (1, N) and y.dtype == torch.bfloat16
        assert rel(y, ref) < 1e-2
        assert rel(gemv.gemv(x, w, torch.float32), ref) < 1e-5
    with pytest.raises(ValueError, match="one row"):
        gemv.gemv(torch.randn(2, 512, device=DEVICE, dtype=torch.bfloat16), w[:, :512])


def test_gemv_silu_mul_matches_the_unfused_mlp_half():
    """silu(gate) * up from a fused [gate; up] weight in one launch (odd half: masked rows)
    against the model's unfused path (GEMM, rounding to bf16, SiLU, product)."""
    import torch.nn.functional as F

    from k2serve.kernels import gemv

    for ni, K in ((5, 512), (48, 768)):
        w = torch.randn(2 * ni, K, device=DEVICE, dtype=torch.bfloat16) * 0.05
        x = torch.randn(1, K, device=DEVICE, dtype=torch.bfloat16)
        g, u = F.linear(x.float(), w.float()).to(torch.bfloat16).split([ni, ni], dim=-1)
        ref = F.silu(g.float()) * u.float()
        y = gemv.gemv_silu_mul(x, w)
        assert y.shape == (1, ni) and y.dtype == torch.bfloat16
        # three bf16 roundings, which Triton's CPU interpreter does toward zero
        assert rel(y, ref) < (1e-2 if DEVICE == "cuda" else 3e-2)


@pytest.mark.parametrize(
    "cfg, hidden, inter",
    [
        (dict(BLOCK_M=16, BLOCK_N=32, W=8, num_warps=4, kernel="tile"), 256, 128),
        (dict(BLOCK_M=32, BLOCK_N=64, W=16, num_warps=4, kernel="tile"), 256, 128),
        (dict(BLOCK_M=16, BLOCK_N=32, num_warps=4), 256, 256),
        (dict(BLOCK_M=16, BLOCK_N=64, W2=16, num_warps=4), 256, 512),
        (dict(BLOCK_M=16, BLOCK_N=32, W2=32, num_warps=4), 512, 512),
    ],
)
def test_int4_prefill_gemm_matches_reference(cfg, hidden, inter):
    """The prefill grouped GEMMs (weights dequantized in registers: the tile kernel, and the
    register-operand kernel over nibble planes with its gemm-order activations and its
    gemm-order output of the first projection) on blocks with several rows of one expert,
    padding rows, and an expert with no rows."""
    from k2serve.kernels import int4_gemm

    ew = _int4_experts(4, hidden, inter)
    assert int4_gemm.gemm_supported(ew, cfg.get("W2", 16)) == (inter % 256 == 0)
    T, k = 9, 2
    x = torch.randn(T, hidden, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE)
    ids = torch.stack([torch.randperm(3)[:k] for _ in range(T)]).int().to(DEVICE)  # expert 3: none
    out = int4_gemm.int4_moe_gemm(x, ew, w, ids, cfg)
    assert out.shape == (T, hidden) and out.dtype == torch.bfloat16
    assert rel(out, fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


@pytest.mark.parametrize(
    "impl, min_tokens",
    [("auto", 4096), ("auto", 16), ("gemm", 16), ("grouped_mm", 4096), ("kernel", 16)],
)
def test_fused_moe_backend_prefill_paths_agree(impl, min_tokens):
    """Every INT4 path above the decode GEMV range (pairs > decode_max_pairs) gives the
    reference result: the grouped GEMM, dequant + grouped_mm from min_tokens, the generic
    kernel."""
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = _int4_experts(4, 256, 256)
    T, k = 20, 4  # every token on all 4 experts: 20 rows each, a full and a partial block of 16
    x = torch.randn(T, 256, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE)
    ids = torch.stack([torch.randperm(4)[:k] for _ in range(T)]).int().to(DEVICE)
    # both decode GEMVs off: 80 pairs must reach the prefill paths under test
    be = FusedMoEBackend(
        ew,
        prefill_impl=impl,
        prefill_min_tokens=min_tokens,
        decode_max_pairs=64,
        grouped_config={},
    )
    assert T * k > be.decode_max_pairs and be.grouped_min_pairs is None
    assert rel(be(x, ids, w), fm.fused_moe_ref(x, ew, w, ids)) < 2e-2


def test_fused_moe_backend_rejects_unknown_prefill_impl():
    from k2serve.moe.fused_moe import FusedMoEBackend

    with pytest.raises(ValueError, match="prefill_impl"):
        FusedMoEBackend(_int4_experts(2, 256, 256), prefill_impl="fast")


@pytest.mark.parametrize("M, N, K", [(1, 576, 384), (5, 256, 200), (33, 160, 256)])
def test_fp8_block_matmul_matches_dequantized_reference(M, N, K):
    """The FP8 block GEMM (one scale per weight tile, partial edge blocks in N and K) and the
    one-pass dequant against quant.fp8's reference dequant + matmul."""
    from k2serve.kernels import fp8_linear
    from k2serve.quant.fp8 import dequantize_fp8_block, quantize_fp8_block

    w, s = quantize_fp8_block(torch.randn(N, K, device=DEVICE) * 0.05)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
    ref = x.float() @ dequantize_fp8_block(w, s, (128, 128), torch.float32).T
    y = fp8_linear.fp8_block_matmul(x, w, s)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert rel(y, ref) < 1e-2
    cfg = dict(BLOCK_M=16, BLOCK_N=64, SPLIT_K=2, num_warps=4)  # K split: float32 atomics
    assert rel(fp8_linear.fp8_block_matmul(x, w, s, cfg), ref) < 1e-2
    dq = fp8_linear.dequant_fp8_block(w, s, torch.bfloat16)
    want = dequantize_fp8_block(w, s, (128, 128), torch.bfloat16)
    if DEVICE == "cuda":  # the same float32 product, rounded to nearest: bit-equal
        assert torch.equal(dq, want)
    else:  # Triton's interpreter rounds float32 -> bf16 toward zero
        assert rel(dq, want) < 1e-2


@pytest.mark.parametrize("T", [1, 5])
def test_mla_absorb_products_match_einsum(T):
    """The absorbed MLA's W_UK / W_UV products (kv_b_proj's weight viewed [H, N + V, L]) for a
    few tokens, q_nope a strided view as in the model, against the einsums."""
    from k2serve.kernels import mla_absorb

    H, N, V, L = 3, 32, 16, 64
    w = torch.randn(H * (N + V), L, device=DEVICE, dtype=torch.bfloat16).view(H, N + V, L)
    q = torch.randn(T, H, N + 16, device=DEVICE, dtype=torch.bfloat16)[..., :N]  # a view
    assert mla_absorb.usable(q, w)
    ref_q = torch.einsum("thn,hnl->thl", q.float(), w[:, :N].float())
    assert rel(mla_absorb.absorb_q(q, w), ref_q) < 1e-2
    o = torch.randn(T, H, L, device=DEVICE, dtype=torch.bfloat16)
    ref_o = torch.einsum("thl,hvl->thv", o.float(), w[:, N:].float())
    out = mla_absorb.absorb_o(o, w, N)
    assert out.shape == (T, H, V) and rel(out, ref_o) < 1e-2
    assert not mla_absorb.usable(torch.randn(17, H, N, device=DEVICE, dtype=torch.bfloat16), w)
    assert not mla_absorb.usable(q.float(), w.float())  # float32 models keep the einsum


def test_int4_prefill_table_picks_by_pairs():
    """The INT4 GEMM's config table: the first entry whose max_pairs holds the pair count, the
    last (max_pairs None) for the rest; a single mapping is used as it is; a table with no
    catch-all entry is a clear error."""
    from k2serve.kernels.int4_gemm import PREFILL_TABLE, pick_config

    table = [dict(max_pairs=64, BLOCK_M=16), dict(max_pairs=None, BLOCK_M=64)]
    assert pick_config(table, 64) == {"BLOCK_M": 16}
    assert pick_config(table, 65) == {"BLOCK_M": 64}
    assert pick_config({"BLOCK_M": 32}, 10**6) == {"BLOCK_M": 32}
    assert "max_pairs" not in pick_config(PREFILL_TABLE, 1)
    with pytest.raises(ValueError, match="max_pairs null"):
        pick_config([dict(max_pairs=8, BLOCK_M=16)], 9)
