"""The Triton MLA kernels over a float8_e4m3fn latent cache: the store writes the torch
backend's bytes, the attention reads the same values as the torch reference (CPU through
Triton's interpreter, tiny shapes; the same code runs on CUDA, where the PTX widening is used)."""

import pytest
import torch

from k2serve.attention import TorchMLABackend, make_attention_backend
from k2serve.attention.base import AttentionMetadata
from k2serve.attention.triton_mla import TritonMLABackend
from k2serve.kernels import kv_store, mla_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fp8_paged(ctx, qlens, kv_scale, H=4, L=32, R=16, ps=16, seed=0):
    """A random fp8 cache written by the torch backend (as the engine would), its metadata and
    bf16 queries."""
    g = torch.Generator().manual_seed(seed)
    seq = [c + q for c, q in zip(ctx, qlens, strict=True)]
    maxp = max(-(-s // ps) for s in seq)
    P = len(ctx) * maxp + 2
    kv = torch.zeros(P, ps, L + R, dtype=FP8)
    x = torch.randn(P * ps, L + R, generator=g) * 2 * kv_scale
    TorchMLABackend(kv_scale=kv_scale).store(kv, x[:, :L], x[:, L:], torch.arange(P * ps))
    bt = torch.randperm(P, generator=g)[: len(ctx) * maxp].view(len(ctx), maxp).int()
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(qlens)
    q = torch.randn(T, H, L, generator=g).bfloat16()
    qp = torch.randn(T, H, R, generator=g).bfloat16()
    c = torch.tensor(ctx, dtype=torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl.to(DEVICE), seq_lens=torch.tensor(seq, dtype=torch.int32).to(DEVICE),
        context_lens=c.to(DEVICE), block_table=bt.to(DEVICE),
        slot_mapping=torch.zeros(T, dtype=torch.long, device=DEVICE), max_query_len=max(qlens),
        max_seq_len=max(seq), page_size=ps,
    )  # fmt: skip
    return [t.to(DEVICE) for t in (q, qp, kv)], md


@pytest.mark.parametrize(
    "ctx,qlens,splits,kv_scale",
    [
        ([5, 40, 0], [1, 1, 1], None, 1.0),  # decode, lengths not multiples of the page size
        ([70], [1], 4, 0.25),  # split-KV, 71 keys over 4 splits, a scale
        ([33, 100], [1, 1], 8, 3.0),  # more splits than some sequences have tiles
        ([0, 17], [20, 9], None, 1.0),  # prefill, one with a cached prefix of 17
        ([45], [6], None, 0.5),  # cached prefix + a chunk crossing a page boundary
    ],  # fmt: skip
)
def test_fp8_cache_matches_the_torch_reference_on_the_same_cache(ctx, qlens, splits, kv_scale):
    (q, qp, kv), md = fp8_paged(ctx, qlens, kv_scale)
    out = torch.full_like(q, float("nan"))  # poisoned: every row must be written
    mla_attention.mla_attention(
        q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.3, md.max_query_len,
        md.max_seq_len, out=out, num_splits=splits, kv_scale=kv_scale,
    )  # fmt: skip
    assert torch.isfinite(out).all()
    ref = TorchMLABackend(kv_scale=kv_scale).forward(q, qp, kv, md, 0.3)  # the oracle backend
    # Both read the same fp8 values exactly (e4m3 -> bf16/fp32 is exact); what differs is the
    # summation order and the bf16 rounding of the output (2^-9 relative per element)
    assert rel(out, ref) < 1e-2
    ref2 = mla_attention.mla_attention_ref(
        q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.3, kv_scale=kv_scale
    )
    assert rel(out, ref2) < 1e-2
    # and the cache's content matters: a bf16 copy of the stored values (times the scale)
    # gives the same attention through the bf16 path of the kernel
    kv_bf16 = (kv.float() * kv_scale).bfloat16()
    alt = mla_attention.mla_attention(
        q, qp, kv_bf16, md.query_start_loc, md.context_lens, md.block_table, 0.3,
        md.max_query_len, md.max_seq_len, num_splits=splits,
    )  # fmt: skip
    assert rel(out, alt) < 1e-2


def test_fp8_backend_store_then_forward_equals_the_torch_backend():
    """TritonMLABackend end to end (store + forward) against TorchMLABackend, each with its own
    cache: the stored bytes are equal and the outputs agree."""
    L, R, ps, H, scale = 32, 16, 8, 4, 0.5
    g = torch.Generator().manual_seed(1)
    T = 11
    lat = torch.randn(T, L, generator=g).bfloat16().to(DEVICE)
    pe = torch.randn(T, R, generator=g).bfloat16().to(DEVICE)
    q = torch.randn(T, H, L, generator=g).bfloat16().to(DEVICE)
    qp = torch.randn(T, H, R, generator=g).bfloat16().to(DEVICE)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([4, 7], dtype=torch.int32, device=DEVICE),
        context_lens=torch.zeros(2, dtype=torch.int32, device=DEVICE),
        block_table=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor([16, 17, 18, 19, 8, 9, 10, 11, 12, 13, 14], device=DEVICE),
        max_query_len=7, max_seq_len=7, page_size=ps,
    )  # fmt: skip
    caches = []
    outs = []
    for be in (TritonMLABackend(kv_scale=scale), TorchMLABackend(kv_scale=scale)):
        kv = torch.zeros(4, ps, L + R, dtype=FP8, device=DEVICE)
        be.store(kv, lat, pe, md.slot_mapping)
        caches.append(kv)
        outs.append(be.forward(q, qp, kv, md, 0.2))
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert rel(outs[0], outs[1]) < 1e-2


def _edge_values():
    return torch.tensor([
        447.0, 449.0, 464.0, 470.0, 480.0, 1000.0, -1000.0, float("inf"), float("-inf"),
        1e-3, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 5 * 2.0**-11, 2.0**-6, 2.0**-6 * (1 - 2**-5),
        0.0, -0.0, 1e-30, 1.9585, 1.0625, 1.1875, -1.3125, 2.0**-7 * 1.5,
    ])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_scale", [1.0, 0.37, 4.0])
def test_fp8_store_kernel_writes_the_torch_backends_bytes(dtype, kv_scale):
    L, R = 32, 32
    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, L + R, generator=g) * torch.exp(torch.randn(24, L + R, generator=g) * 3)
    x.view(-1)[:24] = _edge_values()  # saturation, ties, sub-normals, the normal boundary
    x = x.to(dtype).to(DEVICE)
    slots = torch.randperm(96, generator=g)[:24].to(DEVICE)
    slots[::7] = -1  # padding tokens: not stored
    ours = torch.zeros(6, 16, L + R, dtype=FP8, device=DEVICE)
    theirs = ours.clone()
    kv_store.store_latent_kv(ours, x[:, :L], x[:, L:], slots, kv_scale=kv_scale)
    TorchMLABackend(kv_scale=kv_scale).store(theirs, x[:, :L], x[:, L:], slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    ref = torch.zeros_like(ours)
    kv_store.store_latent_kv_ref(ref, x[:, :L], x[:, L:], slots, kv_scale=kv_scale)
    assert torch.equal(ref.view(torch.uint8), theirs.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN / scale (numpy)
def test_fp8_store_kernel_is_exact_on_every_bf16_value():
    """Round to nearest even and saturation over all 65k bf16 bit patterns (NaNs included)."""
    allb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = allb.view(-1, 128).to(DEVICE)  # 512 tokens of L = R = 64
    ours = torch.zeros(512, 1, 128, dtype=FP8, device=DEVICE)
    theirs = ours.clone()
    slots = torch.arange(512, device=DEVICE)
    kv_store.store_latent_kv(ours, x[:, :64], x[:, 64:], slots)
    TorchMLABackend().store(theirs, x[:, :64], x[:, 64:], slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


def test_fp8_options_are_checked():
    (q, qp, kv), md = fp8_paged([5], [1], 1.0)
    args = (q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.3, 1, 6)
    with pytest.raises(ValueError, match="fp8_convert"):
        mla_attention.mla_attention(*args, fp8_convert="fast")
    with pytest.raises(ValueError, match="kv_scale"):
        mla_attention.mla_attention(*args, kv_scale=0.0)
    with pytest.raises(ValueError, match="unknown MLA config"):
        mla_attention.mla_attention(*args, config={"BLOCK_M": 32})
    with pytest.raises(ValueError, match="kv_scale"):
        TritonMLABackend(kv_scale=-1.0)
    if DEVICE == "cpu":  # the PTX widening cannot run in the interpreter: a clear error
        with pytest.raises(ValueError, match="ptx"):
            mla_attention.mla_attention(*args, fp8_convert="ptx")


def test_decode_tiles_hold_all_heads_of_a_sequence():
    for fp8 in (True, False):  # one program per (sequence, split): the key tile is read once
        assert mla_attention.default_config(True, 64, fp8=fp8)["block_m"] == 64
    assert mla_attention.default_config(True, 8, fp8=True)["block_m"] == 16  # a TP=8 shard
    assert mla_attention.default_config(False, 64, fp8=True)["block_m"] == 64


@pytest.mark.parametrize(
    "seqs,max_len,sms,waves,expect",
    [
        (1, 131072, 132, 1.0, 132),  # B=1 at 128K fills the 132 SMs of an H100
        (1, 32768, 132, 1.0, 128),  # ... capped by 256 keys per split
        (8, 32768, 132, 1.0, 16),  # 128 programs: rounded down, no straggler wave
        (8, 32768, 132, 2.0, 33),
        (64, 32768, 132, 1.0, 2),
        (256, 4096, 132, 1.0, 1),
        (1, 100, 132, 1.0, 1),  # short: one split, the output written directly
        (1, 1 << 20, 132, 4.0, 256),  # max_splits
    ],
)
def test_split_count_fills_the_gpu(seqs, max_len, sms, waves, expect):
    n = mla_attention._pick_splits(seqs, 1, max_len, sms, waves, 256, 256)
    assert n == expect


@pytest.mark.parametrize(
    "splits,block_n,split_qk", [(3, 16, True), (5, 32, False), (7, 64, True), (None, 32, True)]
)
def test_split_counts_that_are_not_powers_of_two(splits, block_n, split_qk):
    """Any split count; key tiles narrower than, as wide as and wider than a page (32); the
    QK dots split between warpgroups or not (the same math)."""
    (q, qp, kv), md = fp8_paged([300, 77], [1, 1], 0.5, ps=32)
    args = (q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.3, 1, 301)
    cfg = {"block_n": block_n, "min_split_keys": 64, "split_qk": split_qk}
    out = mla_attention.mla_attention(*args, num_splits=splits, kv_scale=0.5, config=cfg)
    ref = TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, 0.3)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("block_n", [8, 24])
def test_key_tiles_below_the_mma_minimum_are_refused(block_n):
    """A key tile is the K of the P @ V MMA (>= 16 on a GPU, a power of two for tl.arange): a
    config outside that is a clear error, not a compile failure inside Triton."""
    (q, qp, kv), md = fp8_paged([40], [1], 0.5)
    args = (q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.3, 1, 41)
    with pytest.raises(ValueError, match="block_n"):
        mla_attention.mla_attention(*args, kv_scale=0.5, config={"block_n": block_n})


def test_expanded_prefill_reads_an_fp8_prefix():
    """The non-absorbed prefill (kv_b_proj + SDPA) over a cached fp8 prefix reads the stored
    values times kv_scale: it agrees with the absorbed path on the same fp8 cache and with the
    cache-free model to the fp8 rounding."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(preset_config("tiny", "bf16", layers=2))
    model = load_model(None, load_format="dummy", config=cfg, device="cpu", dtype=torch.float32)
    ps, n0, n1 = 8, 13, 7
    ids = torch.randint(0, cfg.vocab_size, (n0 + n1,))

    def md(ctx, q):
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            seq_lens=torch.tensor([ctx + q], dtype=torch.int32),
            context_lens=torch.tensor([ctx], dtype=torch.int32),
            block_table=torch.arange(4, dtype=torch.int32)[None],
            slot_mapping=torch.arange(ctx, ctx + q), max_query_len=q, max_seq_len=ctx + q,
            page_size=ps,
        )  # fmt: skip

    outs = {}
    for mode in ("absorbed", "expand"):
        be = TorchMLABackend(kv_scale=0.5)
        be.prefill = mode
        model.set_attn_backend(be)
        kv = allocate_kv_caches(cfg, 4, ps, FP8, "cpu")
        model(ids[:n0], torch.arange(n0), md(0, n0), kv)
        outs[mode] = model(ids[n0:], torch.arange(n0, n0 + n1), md(n0, n1), kv)
    full = model(ids, torch.arange(n0 + n1))[n0:]  # naive MLA, no cache
    # e4m3 keeps 3 mantissa bits: each cached value is within 2^-4 of itself
    assert rel(outs["expand"], full) < 2**-4
    assert rel(outs["expand"], outs["absorbed"]) < 2**-4


@pytest.mark.gpu
@needs_cuda
def test_fp8_cache_picks_the_triton_backend_on_cuda():
    from k2serve.model.backends import resolve_backends

    choice = resolve_backends("cuda", kv_cache_dtype=FP8)
    be = make_attention_backend(choice.attention, FP8, choice.policy)
    assert be.name == "triton" and be.graph_safe
    assert resolve_backends("cuda", attention="triton", kv_cache_dtype=FP8).attention == "triton"


@pytest.mark.gpu
@needs_cuda
def test_fp8_ptx_and_cast_widening_agree_and_a_decode_graph_replays():
    (q, qp, kv), md = fp8_paged([300, 77, 1000], [1, 1, 1], 0.5, H=64, L=512, R=64, ps=64)
    args = (q, qp, kv, md.query_start_loc, md.context_lens, md.block_table, 0.1, 1, 1001)
    ptx = mla_attention.mla_attention(*args, kv_scale=0.5, fp8_convert="ptx")
    cast = mla_attention.mla_attention(*args, kv_scale=0.5, fp8_convert="cast")
    assert rel(ptx, cast) < 1e-3  # both widen exactly; the same dots follow
    ref = TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, 0.1)
    assert rel(ptx, ref) < 1e-2
    out = torch.empty_like(q)
    g = torch.cuda.CUDAGraph()
    mla_attention.mla_attention(*args, out=out, kv_scale=0.5)  # compile outside the capture
    with torch.cuda.graph(g):
        mla_attention.mla_attention(*args, out=out, kv_scale=0.5)
    md.context_lens.copy_(torch.tensor([900, 5, 999], dtype=torch.int32))  # lengths change
    g.replay()
    ref = TorchMLABackend(kv_scale=0.5).forward(
        q, qp, kv, AttentionMetadata(**{**md.__dict__, "seq_lens": md.context_lens + 1}), 0.1
    )
    assert rel(out, ref) < 1e-2


def test_model_with_the_triton_backend_on_an_fp8_cache_matches_the_torch_backend():
    """The tiny model (2 layers, H=4, L=128, R=64) through prefill, a chunk over a cached
    prefix and decodes: the Triton backend and the torch backend, each on its own fp8 cache, write
    the same first-layer bytes and give the same logits (float32 model; on a GPU the Triton
    kernel's dots are bf16, hence the looser bound there)."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config("tiny", "bf16", layers=2))
    model = load_model(None, load_format="dummy", config=cfg, device=DEVICE, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(3))
    ps = 8
    steps = [(0, 9), (9, 14), (14, 15), (15, 16), (16, 17)]  # prefill, cached-prefix chunk, decodes
    logits, caches = {}, {}
    for name, be in (("triton", TritonMLABackend(kv_scale=0.5)), ("torch", TorchMLABackend(0.5))):
        model.set_attn_backend(be)
        kv = allocate_kv_caches(cfg, 3, ps, FP8, DEVICE)
        rows = []
        for s, e in steps:
            md = AttentionMetadata(
                query_start_loc=torch.tensor([0, e - s], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([e], dtype=torch.int32, device=DEVICE),
                context_lens=torch.tensor([s], dtype=torch.int32, device=DEVICE),
                block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32, device=DEVICE),
                slot_mapping=torch.tensor([[2, 0, 1][p // ps] * ps + p % ps for p in range(s, e)],
                                          device=DEVICE),
                max_query_len=e - s, max_seq_len=e, page_size=ps, num_decodes=int(e - s == 1),
            )  # fmt: skip
            h = model(ids[s:e].to(DEVICE), torch.arange(s, e, device=DEVICE), md, kv)
            rows.append(model.compute_logits(h))
        logits[name], caches[name] = torch.cat(rows), kv
    assert caches["triton"][0].float().abs().sum() > 0
    assert torch.equal(caches["triton"][0].view(torch.uint8), caches["torch"][0].view(torch.uint8))
    assert rel(logits["triton"], logits["torch"]) < (1e-3 if DEVICE == "cpu" else 2e-2)


def test_kv_scale_only_touches_fp8_caches():
    """A backend built with a kv_scale reads a bf16 cache as stored (as the torch backend)."""
    (q, qp, kv), md = fp8_paged([40], [1], 1.0)
    kv = kv.float().bfloat16()
    ours = TritonMLABackend(kv_scale=0.5).forward(q, qp, kv, md, 0.3)
    assert rel(ours, TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, 0.3)) < 1e-2


def test_backend_decode_uses_the_tables_config():
    """TritonMLABackend's decode step takes the policy table's config for its cache dtype (a
    bad key there is an error, so the config does reach the kernel) and matches the torch
    backend."""
    from k2serve.kernels.policy import KernelPolicy

    (q, qp, kv), md = fp8_paged([300, 77], [1, 1], 0.5)
    cfgs = {f: KernelPolicy.reference().mla_decode_config(f) for f in (False, True)}
    out = TritonMLABackend(kv_scale=0.5, decode_configs=cfgs).forward(q, qp, kv, md, 0.3)
    ref = TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, 0.3)
    assert rel(out, ref) < 1e-2
    bad = TritonMLABackend(kv_scale=0.5, decode_configs={True: {"BLOCK": 1}})
    with pytest.raises(ValueError, match="unknown MLA config"):
        bad.forward(q, qp, kv, md, 0.3)
    bad.forward(q, qp, kv.float(), md, 0.3)  # a bf16/fp32 cache: its own (absent) entry
