"""The MLA prompt flash kernel (kernels/mla_prefill.py) against its float32 reference, and its
wiring in the expanded prompt path (attention/triton_mla.py) against the SDPA path. CPU: Triton's
interpreter at small shapes (the real 128 / 64 / 128 head dims, few heads, small blocks so
several blocks and the diagonal are crossed); the GPU tests run K2's 64 heads at 8K tokens.

Tolerance: inputs are bf16, the reference computes in float32 from the same bf16 values. The
kernel's only roundings are the bf16 output (the interpreter's cast truncates: < 1 ulp = 2^-7
relative; a GPU rounds to nearest: 2^-8) and, on a GPU, the probabilities rounded to bf16 for
the P @ V MMA (2^-9 relative each, averaging out over the keys): |out - ref| <= 2^-7 |ref| +
4e-3 holds with margin for both and fails for any masking or softmax error (those are O(1))."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from k2serve.kernels import mla_prefill as mp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, R, V, L = 128, 64, 128, 64  # K2's head dims; a small latent (kv_lora_rank) for the CPU


def close(out, ref, rtol=2**-7, atol=4e-3) -> bool:
    err = (out.float() - ref.float()).abs()
    return bool((err <= rtol * ref.float().abs() + atol).all())


def varlen(q_lens, ctx, H, seed=0):
    """q [T, H, N + R] and kv [S_total, H, N + V] (their halves are the kernel's strided
    inputs), k_pe [S_total, R], cu_seqlens; a sequence's keys are its ctx cached + new ones."""
    g = torch.Generator().manual_seed(seed)
    k_lens = [c + q if q else 0 for c, q in zip(ctx, q_lens, strict=True)]
    T, S = sum(q_lens), sum(k_lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).bfloat16().to(DEVICE)

    cu = lambda x: torch.tensor(np.cumsum([0, *x]), dtype=torch.int32, device=DEVICE)  # noqa: E731
    return rnd(T, H, N + R), rnd(S, H, N + V), rnd(S, R), cu(q_lens), cu(k_lens)


@pytest.mark.parametrize(
    "q_lens,ctx,H,cfg",
    [
        ([150], [0], 2, dict(block_m=32, block_n=16)),  # plain causal, 5 row blocks
        ([150, 40], [0, 70], 2, dict(block_m=32, block_n=16, pipe=True)),  # QK one block ahead
        ([37, 1, 70, 19], [0, 5, 20, 0], 3, dict(block_m=16, block_n=16)),  # varlen + prefix
        ([23, 64], [41, 0], 2, dict(block_m=16, block_n=32)),  # block_n > block_m
        ([23, 64], [41, 0], 2, dict(block_m=16, block_n=32, one_loop=True)),  # all masked
        ([9, 0, 33], [0, 12, 100], 2, dict(block_m=32, block_n=32)),  # an empty sequence
    ],  # fmt: skip
)
def test_kernel_matches_reference(q_lens, ctx, H, cfg):
    q, kv, k_pe, cu_q, cu_k = varlen(q_lens, ctx, H)
    args = (q[..., :N], q[..., N:], kv[..., :N], k_pe, kv[..., N:], cu_q, cu_k)
    out = torch.full((q.shape[0], H, V), float("nan"), dtype=q.dtype, device=DEVICE)
    mp.mla_prefill_attention(*args, max(q_lens), 0.07, out=out, config=cfg)
    assert torch.isfinite(out).all()  # poisoned: every row was written
    assert close(out, mp.mla_prefill_ref(*args, 0.07))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU interpreter: its float32 dots are exact (a GPU's are tf32)",
)
def test_kernel_is_exact_in_float32():
    """fp32 inputs run fp32 dots: the kernel equals the reference to float32 rounding (no
    output cast), so the bf16 tolerance above hides no masking error."""
    q, kv, k_pe, cu_q, cu_k = varlen([40, 17], [0, 30], 2, seed=1)
    q, kv, k_pe = q.float(), kv.float(), k_pe.float()
    args = (q[..., :N], q[..., N:], kv[..., :N], k_pe, kv[..., N:], cu_q, cu_k)
    out = mp.mla_prefill_attention(*args, 40, 0.05, config=dict(block_m=16, block_n=16))
    ref = mp.mla_prefill_ref(*args, 0.05)
    assert (out - ref).abs().max().item() < 1e-4


def test_bad_inputs_are_refused():
    q, kv, k_pe, cu_q, cu_k = varlen([5], [0], 2)
    args = (q[..., :N], q[..., N:], kv[..., :N], k_pe, kv[..., N:], cu_q, cu_k)
    with pytest.raises(ValueError, match="unknown MLA prefill config"):
        mp.mla_prefill_attention(*args, 5, 0.1, config=dict(tile=3))
    with pytest.raises(ValueError, match="block_n=24"):
        mp.mla_prefill_attention(*args, 5, 0.1, config=dict(block_n=24))
    with pytest.raises(ValueError, match="k_pe"):
        mp.mla_prefill_attention(*args[:3], k_pe[:2], *args[4:], 5, 0.1)


def test_pick_config_by_query_length():
    table = (
        {"max_len": 2048, "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
        {"max_len": None, "block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    )
    assert mp.pick_config(table, 100)["block_m"] == 64
    assert mp.pick_config(table, 2049)["block_n"] == 128
    assert mp.pick_config((), 100) == mp.default_config()
    assert mp.prefill_flops([4], [6], 1, 1, 0, 1) == 2 * (4 * 2 + 10) * 2


# ------------------------------------------------------------------------ the expanded path


def step(plan, H, kv_dtype=torch.bfloat16, seed=0, ps=16, lora=L):
    """An attention layer's stand-in (the fields mla_prefill_expanded reads, a bf16 kv_b_proj),
    a paged cache holding each sequence's cached prefix, and one prompt step over `plan`
    [(cached, new)] with the host copies of the lengths; -> (layer, inputs, md, cache)."""
    from k2serve.attention.base import AttentionMetadata
    from k2serve.attention.triton_mla import TritonMLABackend

    L = lora  # noqa: N806 - the latent width (kv_lora_rank)
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.nn.Linear(L, H * (N + V), bias=False).to(torch.bfloat16)
    with torch.no_grad():
        kv_b.weight.copy_(torch.randn(H * (N + V), L, generator=g) * L**-0.5)
    layer = types.SimpleNamespace(
        num_heads=H, qk_nope_head_dim=N, v_head_dim=V, kv_lora_rank=L, qk_rope_head_dim=R,
        scaling=(N + R) ** -0.5, kv_b_proj=kv_b.to(DEVICE), backend=TritonMLABackend("expand"),
    )  # fmt: skip
    per = max(-(-(c + q) // ps) for c, q in plan)
    table = torch.arange(len(plan) * per, dtype=torch.int32).view(len(plan), per)
    cache = torch.zeros(len(plan) * per, ps, L + R, dtype=kv_dtype, device=DEVICE)
    for b, (c, _) in enumerate(plan):  # the cached prefixes, written by the backend's store
        if c:
            lat, pe = torch.randn(c, L, generator=g), torch.randn(c, R, generator=g)
            slots = (table[b][torch.arange(c) // ps] * ps + torch.arange(c) % ps).long()
            layer.backend.store(cache, lat.bfloat16().to(DEVICE), pe.bfloat16().to(DEVICE),
                                slots.to(DEVICE))  # fmt: skip
    T = sum(q for _, q in plan)
    pos = [torch.arange(c, c + q) for c, q in plan]
    slots = torch.cat([table[b][p // ps] * ps + p % ps for b, p in enumerate(pos)]).long()
    qsl = np.cumsum([0] + [q for _, q in plan]).astype(np.int32)
    ctx = np.array([c for c, _ in plan], dtype=np.int32)
    md = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.tensor([c + q for c, q in plan], dtype=torch.int32, device=DEVICE),
        context_lens=torch.from_numpy(ctx).to(DEVICE), block_table=table.to(DEVICE),
        slot_mapping=slots.to(DEVICE), max_query_len=max(q for _, q in plan),
        max_seq_len=max(c + q for c, q in plan), page_size=ps,
        query_start_loc_host=qsl, context_lens_host=ctx,
    )  # fmt: skip
    q = torch.randn(T, H, N + R, generator=g).bfloat16().to(DEVICE)
    lat = torch.randn(T, L, generator=g).bfloat16().to(DEVICE)
    pe = torch.randn(T, R, generator=g).bfloat16().to(DEVICE)
    return layer, (q[..., :N], q[..., N:], lat, pe), md, cache


def run_path(layer, inputs, md, cache, attn: str, configs=()):
    from k2serve.attention.triton_mla import TritonMLABackend, mla_prefill_expanded

    layer.backend = TritonMLABackend("expand", prefill_attn=attn, prefill_configs=configs)
    return mla_prefill_expanded(layer, *inputs, md, cache.clone())


SMALL = ({"max_len": None, "block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2},)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_expanded_path_kernel_equals_sdpa(monkeypatch, kv_dtype):
    """One step with a cached prefix and two fresh prompts: the kernel path (one kv_b_proj,
    one launch) equals the SDPA path row for row; an fp8 cache's prefix is read back the same
    way by both."""
    layer, inputs, md, cache = step([(21, 13), (0, 30), (0, 1)], H=2, kv_dtype=kv_dtype)
    launches = []
    orig = mp.mla_prefill_attention
    monkeypatch.setattr(mp, "mla_prefill_attention", lambda *a, **k: launches.append(1)
                        or orig(*a, **k))  # fmt: skip
    ours = run_path(layer, inputs, md, cache, "triton", SMALL)
    assert launches == [1]
    ref = run_path(layer, inputs, md, cache, "sdpa")
    assert close(ours, ref, rtol=2**-6, atol=8e-3)  # both round to bf16 once


def test_expanded_path_all_fresh_needs_no_key_copy(monkeypatch):
    """Fresh prompts only: the kernel reads the step's latent rows as they are (no cat) and the
    keys' offsets are the queries' own device tensor."""
    layer, inputs, md, cache = step([(0, 20), (0, 7)], H=2)
    seen = {}
    orig = mp.mla_prefill_attention

    def spy(*a, **k):
        seen["cu_k"] = a[6]
        return orig(*a, **k)

    monkeypatch.setattr(mp, "mla_prefill_attention", spy)
    ours = run_path(layer, inputs, md, cache, "triton", SMALL)
    assert seen["cu_k"].data_ptr() == md.query_start_loc.data_ptr()
    assert close(ours, run_path(layer, inputs, md, cache, "sdpa"), rtol=2**-6, atol=8e-3)


def test_policy_threads_the_choice_to_the_backend():
    from dataclasses import replace

    from k2serve.attention import make_attention_backend
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.model.backends import restrict_policy

    assert KernelPolicy.for_device("cpu").mla_prefill_attn == "sdpa"
    want = replace(KernelPolicy(), mla_prefill_attn="triton")
    be = make_attention_backend("triton", policy=want)
    assert be.prefill_attn == "triton" and be.prefill_configs == want.tables.mla_prefill
    assert restrict_policy(want, "cpu").mla_prefill_attn == "sdpa"  # no CUDA: torch's SDPA
    with pytest.raises(ValueError, match="prefill_attn"):
        type(be)("expand", prefill_attn="flash")


# ------------------------------------------------------------------------------ K2 sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan", [[(0, 8192)], [(1024, 2048), (0, 2048), (1024, 2048), (0, 2048)]])
def test_k2_sizes_match_the_sdpa_path(plan):
    """K2's 64 heads and 512-wide latent at an 8K prompt and a varlen batch with cached
    prefixes: the kernel path (default config and the policy table's) against the SDPA path
    (both bf16)."""
    from k2serve.kernels.policy import device_kind, load_tables

    layer, inputs, md, cache = step(plan, H=64, lora=512)
    ref = run_path(layer, inputs, md, cache, "sdpa")
    table = load_tables(device_kind(DEVICE)).mla_prefill  # the engine's configs
    for configs in ((), table):  # the kernel's default, the table's pick
        ours = run_path(layer, inputs, md, cache, "triton", configs)
        assert layer.backend.prefill_attn == "triton"  # ran, not fallen back to SDPA
        assert close(ours, ref, rtol=2**-6, atol=8e-3)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU interpreter: its float32 dots are exact (a GPU's are tf32)",
)
def test_model_step_with_the_kernel_equals_sdpa(monkeypatch):
    """Through the model: a mixed step (a decode, a prompt chunk over a cached prefix, a fresh
    prompt) on TritonMLABackend(prefill="expand") gives the same hidden states with the kernel
    as with SDPA (float32 model: the kernel's dots are float32 here)."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.attention.base import AttentionMetadata
    from k2serve.attention.triton_mla import TritonMLABackend
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf(preset_config("tiny", "bf16", layers=2))
    model = load_model(None, load_format="dummy", config=cfg, device="cpu", dtype=torch.float32)
    ps, per = 8, 3
    plan = [(9, 1), (5, 6), (0, 11)]
    seqs = [torch.randint(0, cfg.vocab_size, (c + q,)) for c, q in plan]

    def meta(lens, rows):
        qsl = np.cumsum([0] + [q for _, q in lens]).astype(np.int32)
        ctx = np.array([c for c, _ in lens], dtype=np.int32)
        table = torch.tensor([[r * per + j for j in range(per)] for r in rows], dtype=torch.int32)
        pos = [torch.arange(c, c + q) for c, q in lens]
        slots = torch.cat([table[b][p // ps] * ps + p % ps for b, p in enumerate(pos)])
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.tensor([c + q for c, q in lens], dtype=torch.int32),
            context_lens=torch.from_numpy(ctx), block_table=table, slot_mapping=slots.long(),
            max_query_len=max(q for _, q in lens), max_seq_len=max(c + q for c, q in lens),
            page_size=ps, num_decodes=sum(q == 1 for _, q in lens),
            query_start_loc_host=qsl, context_lens_host=ctx,
        )  # fmt: skip

    launches = []
    orig = mp.mla_prefill_attention
    monkeypatch.setattr(mp, "mla_prefill_attention", lambda *a, **k: launches.append(a[5].shape[0])
                        or orig(*a, **k))  # fmt: skip
    outs = {}
    for attn in ("sdpa", "triton"):
        model.set_attn_backend(TritonMLABackend("expand", prefill_attn=attn,
                                                prefill_configs=SMALL))  # fmt: skip
        kv = allocate_kv_caches(cfg, per * len(plan), ps, torch.float32, "cpu")
        for b, (c, _) in enumerate(plan):
            if c:
                model(seqs[b][:c], torch.arange(c), meta([(0, c)], [b]), kv)
        ids = torch.cat([s[c:] for s, (c, _) in zip(seqs, plan, strict=True)])
        pos = torch.cat([torch.arange(c, c + q) for c, q in plan])
        outs[attn] = model(ids, pos, meta(plan, range(len(plan))), kv)
    assert launches == [2, 2, 2, 2, 3, 3]  # B + 1 per launch: 2 prefixes, then 2 prompts at once
    err = (outs["triton"] - outs["sdpa"]).norm() / outs["sdpa"].norm()
    assert err.item() < 1e-4


def test_a_config_that_does_not_fit_falls_back_to_sdpa(monkeypatch):
    """A table config the device cannot hold (Triton's OutOfResources at launch): the step runs
    SDPA, and the backend stays on SDPA (no failing launch per layer)."""
    layer, inputs, md, cache = step([(0, 12)], H=2)

    def too_big(*a, **k):
        raise mp.LAUNCH_ERRORS[0](237568, 232448, "shared memory")

    monkeypatch.setattr(mp, "mla_prefill_attention", too_big)
    from k2serve.attention.triton_mla import TritonMLABackend, mla_prefill_expanded

    layer.backend = TritonMLABackend("expand", prefill_attn="triton")
    out = mla_prefill_expanded(layer, *inputs, md, cache.clone())
    assert layer.backend.prefill_attn == "sdpa"
    assert torch.equal(out, run_path(layer, inputs, md, cache, "sdpa"))
