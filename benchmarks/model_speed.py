# ruff: noqa: F821, E741, B023, B905, E501
"""GPU speed of k2serve's kernels and of a k2-slice model against the card's own ceilings.

Run (one H200, from the repo root):  PYTHONPATH=src python3 benchmarks/model_speed.py [--parts ...]
Parts: ceil (copy bandwidth, bf16 matmul rate), check (every Triton kernel vs its torch
reference at real K2 sizes, fresh random inputs), h2 (decode GEMV configs against the tuned
one; the winner is printed as the `int4_decode` entry of kernels/configs/<kind>.json), ggemv
(the grouped decode GEMV against the per-pair one at T=16..256, with a config sweep), gemv16
(the one-row bf16 GEMV against cuBLAS per K2 projection; printed as `gemv_bf16` entries), kern
(kernel timings), dprof (kernel split of eager decode B=32 / 128, uniform routing), mixed (eager mixed decode + prompt steps: GPU time vs host enqueue time), model (k2-slice INT4, 8 layers, dummy weights: decode B=1/8/32/128 at context
1k through decode CUDA graphs, prefill 1k/8k; "model-base" is the same model with the decode
fusions of the kernel policy off), overlap (the shared expert in order vs on a side stream),
warmup (engine.warmup's start-up steps on the k2-slice: their time, then the first call of
unseen prompt shapes against their steady time), peer (transformers DeepseekV3, grouped_mm experts, 3-layer bf16 slice with the same weights
dequantized, against our model on the same 3 layers).
--routing dummy,uniform[,record:FILE] (default dummy,uniform): the model and peer parts once per
routing (routing_modes.py): the dummy weights' router concentrates a batch on about a third of
the experts; uniform top-8 (or a --record-routing counts file replayed) is what a served K2 sees.
Rows of a routing other than dummy are tagged model[uniform], peer[uniform], ...
Variants are kernel policies (`k2serve.kernels.policy.KernelPolicy`) set up on the model the
way the engine does (`setup`); no module of k2serve is patched.
Bytes counted for decode = every weight read once (attention, norms, router, shared expert, the
distinct routed experts actually hit, dense MLP, lm_head) + the embedding rows + the KV read.
Timings are medians of CUDA-event timed repeats after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

ROWS: list[tuple] = []  # (section, case, ms, GB/s, %bw, TFLOP/s, %mm, note)
CEIL = {"bw": float("nan"), "mm": float("nan")}
WEIGHTS = {"format": "int4"}  # --format: the k2-slice's experts (int4 or fp8 blocks)
FAILS: list[str] = []


def log(*a):
    print(*a, flush=True)


def timed(fn, iters=20, warmup=3) -> float:
    """Median milliseconds of `fn()` over `iters` CUDA-event timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def row(section, case, ms, nbytes=0.0, flops=0.0, note=""):
    gbs = nbytes / ms / 1e6 if nbytes else float("nan")
    tfs = flops / ms / 1e9 if flops else float("nan")
    ROWS.append((section, case, ms, gbs, 100 * gbs / CEIL["bw"], tfs, 100 * tfs / CEIL["mm"], note))
    log(f"  {section:8s} {case:34s} {ms:9.3f} ms  {gbs:8.0f} GB/s  {tfs:7.1f} TFLOP/s  {note}")


def check(name, out, ref, tol=2e-2):
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(out).all()) and err < tol
    log(f"  check {name:44s} rel_err={err:.2e} {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append(name)


# ------------------------------------------------------------------------------------ ceilings
def part_ceil():
    n = 1 << 30  # 4 GiB of float32 per buffer
    a = torch.randn(n, device="cuda")
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), iters=10)
    CEIL["bw"] = 2 * a.numel() * 4 / ms / 1e6
    del a, b
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms2 = timed(lambda: x @ y, iters=10)
    CEIL["mm"] = 2 * 8192**3 / ms2 / 1e9
    log(
        f"ceilings: copy {CEIL['bw']:.0f} GB/s (read+write, 8 GiB), bf16 matmul {CEIL['mm']:.0f} TFLOP/s"
    )


# ------------------------------------------------------------------------------------ kernels
def _rand_experts(quant, E, D, I, dev, g=32):
    from k2serve.kernels.fused_moe import ExpertWeights

    if quant == "int4":

        def pk(n, k):  # fmt: skip
            return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=dev)

        def sc(n, k):  # fmt: skip
            return (torch.rand(E, n, k // g, device=dev) * 0.004 + 0.002).bfloat16()

        return ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), g)
    if quant == "fp8":
        w = lambda n, k: torch.randn(E, n, k, device=dev).to(torch.float8_e4m3fn)  # noqa: E731
        s = lambda n, k: torch.rand(E, n // 128, k // 128, device=dev) * 0.02  # noqa: E731
        return ExpertWeights("fp8", w(2 * I, D), w(D, I), s(2 * I, D), s(D, I))
    w = lambda n, k: (torch.randn(E, n, k, device=dev) * 0.02).bfloat16()  # noqa: E731
    return ExpertWeights("bf16", w(2 * I, D), w(D, I))


def _route(T, E, k, dev):
    ids = torch.rand(T, E, device=dev).argsort(-1)[:, :k].int()
    return torch.rand(T, k, device=dev), ids


def _paged(B, ctx, qlens, H=64, L=512, R=64, ps=64, dev="cuda"):
    seq = [c + q for c, q in zip(ctx, qlens)]
    maxp = max(-(-s // ps) for s in seq)
    P = B * maxp + 3
    kv = torch.randn(P, ps, L + R, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(P, device=dev)[: B * maxp].view(B, maxp).int()
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    T = sum(qlens)
    q = torch.randn(T, H, L, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(T, H, R, device=dev, dtype=torch.bfloat16)
    return (
        q,
        qp,
        kv,
        qsl,
        torch.tensor(ctx, dtype=torch.int32, device=dev),
        bt,
        max(qlens),
        max(seq),
    )


# decode GEMV configs checked at K2 sizes (the tuned one is checked through the policy tables)
H2_CFGS = [
    ("h2 8x64 w4", dict(BLOCK_N=8, W=64, num_warps=4)),
    ("h2 GS", dict(BLOCK_N=8, W=64, num_warps=4, GS=1)),
]


def part_check():
    from k2serve.kernels import fused_moe as fm
    from k2serve.kernels import kv_store, mla_attention, moe_align, rmsnorm, router

    dev = "cuda"
    x = torch.randn(64, 7168, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(7168, device=dev) + 0.5
    r1, r2 = res.clone(), res.clone()
    check(
        "rms_norm+residual", rmsnorm.rms_norm(x, w, 1e-6, r1), rmsnorm.rms_norm_ref(x, w, 1e-6, r2)
    )
    check("rms_norm residual out", r1, r2, 1e-3)
    check("rms_norm", rmsnorm.rms_norm(x, w, 1e-6), rmsnorm.rms_norm_ref(x, w, 1e-6))
    c1 = torch.randn(40, 64, 576, device=dev, dtype=torch.bfloat16)
    c2 = c1.clone()
    lat, pe = torch.randn(100, 512, device=dev), torch.randn(100, 64, device=dev)
    slots = torch.randperm(40 * 64, device=dev)[:100]
    slots[::7] = -1
    kv_store.store_latent_kv(c1, lat, pe, slots)
    kv_store.store_latent_kv_ref(c2, lat, pe, slots)
    check("store_latent_kv", c1, c2, 1e-6)
    for name, ctx, ql in [("decode B=8", [1024, 77, 3000, 1, 500, 64, 65, 2047], [1] * 8),
                          ("decode B=1 ctx1k", [1024], [1]),
                          ("prefill+prefix", [300, 0, 64], [200, 129, 1])]:  # fmt: skip
        a = _paged(len(ctx), ctx, ql)
        out = mla_attention.mla_attention(*a[:6], 0.1446, a[6], a[7])
        check(f"mla {name}", out, mla_attention.mla_attention_ref(*a[:6], 0.1446))
    ids = _route(128, 384, 8, dev)[1]
    s, e, n = moe_align.moe_align_block_size(ids, 384, 16)
    s2, e2, n2 = moe_align.moe_align_block_size_ref(ids, 384, 16)
    used = s[: int(n)]
    ok = (int(n) == int(n2)) and bool((e == e2).all())
    ok &= sorted(used[used < ids.numel()].tolist()) == list(range(ids.numel()))
    ok &= bool(
        (
            ids.view(-1)[used[used < ids.numel()].long()]
            == e[(used < ids.numel()).nonzero()[:, 0] // 16]
        ).all()
    )
    log(f"  check moe_align invariants                          {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append("moe_align")
    lg = torch.randn(16, 384, device=dev)
    bias = torch.randn(384, device=dev) * 0.1
    wt, it = router.grouped_topk(lg, bias, 8, 8, 4, True, 2.827)
    wr, ir = router.grouped_topk_ref(lg.cpu(), bias.cpu(), 8, 8, 4, True, 2.827)
    ok = all(set(a) == set(b) for a, b in zip(it.cpu().tolist(), ir.tolist()))
    log(f"  check router grouped top-k (8 groups)               {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append("router")
    from k2serve.kernels import int4_dequant, int4_gemm, int4_gemv

    tables = engine_policy().tables
    ew = _rand_experts("int4", 384, 7168, 2048, dev)
    for T in (1, 8, 64, 512):
        tw, ti = _route(T, 384, 8, dev)
        xx = torch.randn(T, 7168, device=dev, dtype=torch.bfloat16)
        ref = fm.fused_moe_ref(xx, ew, tw, ti)
        if T * 8 <= tables.int4_decode_max_pairs:
            for name, cfg in H2_CFGS + [("tuned", tables.int4_decode)]:
                check(f"int4_moe_decode {name} T={T}",
                      int4_gemv.int4_moe_decode(xx, ew, tw, ti, cfg), ref)  # fmt: skip
            for mag in (1e-4, 300.0):  # the f16x2 GEMV scales each activation row
                x2 = xx * mag
                check(f"int4_moe_decode x*{mag:g} T={T}",
                      int4_gemv.int4_moe_decode(x2, ew, tw, ti, tables.int4_decode),
                      fm.fused_moe_ref(x2, ew, tw, ti))  # fmt: skip
        else:
            check(f"int4_moe_gemm T={T}", int4_gemm.int4_moe_gemm(xx, ew, tw, ti), ref)
            check(f"int4_moe_gemm no-asm T={T}",
                  int4_gemm.int4_moe_gemm(xx, ew, tw, ti, asm=False), ref)  # fmt: skip
            check(f"int4_moe grouped_mm T={T}", int4_gemm.int4_moe_grouped_mm(xx, ew, tw, ti), ref)
    w = int4_dequant.dequant_int4_planes(ew.w13[:2], ew.w13_scale[:2], 256)
    ref_w = fm.dequant_int4_ref(ew.w13[1], ew.w13_scale[1])
    check("dequant_int4_planes", w[1].float(), int4_dequant.permute_planes(ref_w, 256), 1e-2)
    del ew, w
    for quant, E, Ts in [("int4", 384, (1, 32, 512)), ("bf16", 16, (64,)), ("fp8", 16, (64,))]:
        ew = _rand_experts(quant, E, 7168, 2048, dev)
        for T in Ts:
            tw, ti = _route(T, E, 8, dev)
            xx = torch.randn(T, 7168, device=dev, dtype=torch.bfloat16)
            check(f"fused_moe {quant} E={E} T={T}", fm.fused_moe(xx, ew, tw, ti),
                  fm.fused_moe_ref(xx, ew, tw, ti))  # fmt: skip
        del ew
    from k2serve.kernels import rope
    from k2serve.model.layers import YarnRotaryEmbedding

    emb = YarnRotaryEmbedding(64, 50000.0, {"type": "yarn", "factor": 32.0, "beta_fast": 1,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "original_max_position_embeddings": 4096}, 131072)  # fmt: skip
    for T in (1, 8, 300):
        pos = torch.randint(0, 131072, (T,), device=dev)
        cos, sin = emb.cos_sin(pos)
        q = torch.randn(T, 64, 192, device=dev, dtype=torch.bfloat16)
        ckv = torch.randn(T, 576, device=dev, dtype=torch.bfloat16)
        qo, ko = rope.rope_qk(q[..., 128:], ckv[:, 512:], cos, sin)
        qr = emb.apply(q[..., 128:], cos, sin)
        diff = (qo != qr).float().mean().item()
        ratios = [rope.rope_error_ratio(o, x, cos, sin)
                  for o, x in ((qo, q[..., 128:]), (ko, ckv[:, 512:]), (qr, q[..., 128:]))]  # fmt: skip
        ok = max(ratios) <= 3.3
        log(f"  check rope_qk T={T}: {diff:.2%} of q values differ from the torch code; error "
            f"/ rounding bound: kernel {max(ratios[:2]):.2f}, torch {ratios[2]:.2f}  "
            f"{'ok' if ok else 'FAIL'}")  # fmt: skip
        if not ok:
            FAILS.append(f"rope_qk T={T}")
    for ng, tg in ((1, 1), (8, 4)):
        lg = torch.randn(64, 384, device=dev)
        bias = torch.randn(384, device=dev) * 0.1
        wt, it = router.fused_grouped_topk(lg, bias, 8, ng, tg, True, 2.827, torch.int64)
        wr, ir = router.grouped_topk_ref(lg.cpu(), bias.cpu(), 8, ng, tg, True, 2.827)
        ok = all(set(a) == set(b) for a, b in zip(it.cpu().tolist(), ir.tolist()))
        wsort = wt.cpu().double().sort(1).values
        ok &= bool(torch.allclose(wsort, wr.double().sort(1).values, atol=1e-5))
        log(
            f"  check fused router top-k E=384 k=8 groups {ng}/{tg}        {'ok' if ok else 'FAIL'}"
        )
        if not ok:
            FAILS.append(f"fused router {ng}/{tg}")


def part_kern():
    from k2serve.kernels import fused_moe as fm
    from k2serve.kernels import mla_attention

    dev = "cuda"
    E, D, I, k = 384, 7168, 2048, 8
    ew = _rand_experts("int4", E, D, I, dev)
    per_expert = sum(
        t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale)
    )
    from k2serve.kernels import int4_gemm
    from k2serve.kernels.fused_moe import _config

    for T in (1, 8, 32, 128, 1024, 8192):  # the generic kernel (int4_impl="legacy")
        tw, ti = _route(T, E, k, dev)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        hit = int(ti.unique().numel())
        nb, fl = hit * per_expert + 2 * T * D * 2, 2 * 3 * D * I * T * k
        cfg0 = _config(T * k, E, "int4")
        ms = timed(lambda: fm.fused_moe(x, ew, tw, ti, cfg0), iters=10 if T > 1000 else 30)
        row("kern", f"generic fused_moe int4 T={T} ({hit} experts)", ms, nb, fl)
        if T >= 1024:
            for ch in (32, 64):
                ms = timed(lambda: int4_gemm.int4_moe_grouped_mm(x, ew, tw, ti, chunk=ch), iters=5)
                row("sweep", f"int4 T={T} dequant+grouped_mm chunk {ch}", ms, nb, fl)
            for asm in (True, False):
                ms = timed(lambda: int4_gemm.int4_moe_gemm(x, ew, tw, ti, asm=asm), iters=5)
                row("sweep", f"int4 T={T} grouped GEMM, inline-asm dequant {asm}", ms, nb, fl)
    from k2serve.moe.fused_moe import FusedMoEBackend

    be = FusedMoEBackend(ew, **engine_policy().moe_kwargs())
    for T in (1, 8, 32, 64, 128, 1024, 8192):
        tw, ti = _route(T, E, k, dev)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        hit = int(ti.unique().numel())
        nb, fl = hit * per_expert + 2 * T * D * 2, 2 * 3 * D * I * T * k
        ms = timed(lambda: be(x, ti, tw), iters=10 if T > 1000 else 30)
        row("kern", f"FusedMoEBackend int4 T={T} ({hit} experts)", ms, nb, fl, "tuned dispatch")
    del ew
    torch.cuda.empty_cache()
    for B in (1, 8, 32, 128):
        a = _paged(B, [1024] * B, [1] * B)
        ms = timed(lambda: mla_attention.mla_attention(*a[:6], 0.14, a[6], a[7]), iters=30)
        row("kern", f"mla decode B={B} ctx=1k", ms, B * 1025 * 576 * 2 + 2 * B * 64 * 576 * 2,
            B * 64 * 1025 * 1088 * 2)  # fmt: skip
    for T in (1024, 8192):
        a = _paged(1, [0], [T])
        ms = timed(lambda: mla_attention.mla_attention(*a[:6], 0.14, a[6], a[7]), iters=5)
        row("kern", f"mla prefill T={T}", ms, 0, 64 * 1088 * 2 * T * (T + 1) / 2)


# ------------------------------------------------------------------------------------ gemv
def graph_ms(fns, reps=20) -> float:
    """Milliseconds per call of the fns, all captured once into one CUDA graph and replayed."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return timed(g.replay, iters=reps) / len(fns)


def _time_moe(ew, x, routes, refs, cfg):
    """(graph-timed ms per decode GEMV call over the routings, largest relative difference
    from refs): the common step of the GEMV sweeps."""
    from k2serve.kernels.int4_gemv import int4_moe_decode

    outs = [int4_moe_decode(x, ew, tw, ti, cfg) for tw, ti in routes]
    err = max(((o.float() - r.float()).norm() / r.float().norm()).item()
              for o, r in zip(outs, refs))  # fmt: skip
    ms = graph_ms([lambda tw=tw, ti=ti: int4_moe_decode(x, ew, tw, ti, cfg) for tw, ti in routes])
    return ms, err


# (BLOCK_N, W, num_warps, GS) of the f16x2 GEMV, per launch (runs 12-16 and 20: next-iteration
# loads in registers, Triton loop pipelining, 8-warp 16-row tiles, per-word scales and splitting
# the down launch's top-k over 2-4 programs were slower or no faster)
H2_W13 = [(8, 64, 4, 1), (16, 64, 4, 1), (4, 128, 2, 1), (16, 128, 4, 1)]
H2_W2 = [(8, 128, 4, 1), (8, 64, 4, 1), (16, 128, 4, 1), (4, 128, 4, 1)]


def _h2(c):
    return dict(zip(("BLOCK_N", "W", "num_warps", "GS"), c))


def part_h2():
    """Decode GEMV configs against the tuned one (the policy's `int4_decode`), graph-timed over
    4 routings at T=1 and T=8: the w13 launch swept with w2 at the first config, then w2 with
    the best w13. The best pair is printed as the table entry to use when it beats the tuned one
    on T=1 + T=8 and agrees with it to 4e-3; nothing is changed in place."""
    from k2serve.kernels.int4_gemv import int4_moe_decode

    tables = engine_policy().tables

    dev = "cuda"
    E, D, I, k = 384, 7168, 2048, 8
    ew = _rand_experts("int4", E, D, I, dev)
    per_expert = sum(t[0].numel() * t.element_size()
                     for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))  # fmt: skip
    base = dict(tables.int4_decode)
    cases = {}
    for T in (1, 8):
        routes = [_route(T, E, k, dev) for _ in range(4)]
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        nb = sum(int(ti.unique().numel()) for _, ti in routes) / 4 * per_expert
        refs = [int4_moe_decode(x, ew, tw, ti, base) for tw, ti in routes]
        cases[T] = (routes, x, nb, refs)

    def measure(name, cfg):
        tot = 0.0
        for T, (routes, x, nb, refs) in cases.items():
            try:
                ms, err = _time_moe(ew, x, routes, refs, cfg)
            except Exception as e:  # noqa: BLE001 - a config that does not fit is reported
                log(f"  h2 T={T} {name}: {type(e).__name__}: {str(e)[:300]}")
                return float("inf")
            row("gemv", f"T={T} {name}", ms, nb, 0, f"vs tuned {err:.1e}")
            if err > 4e-3:
                FAILS.append(f"h2 T={T} {name} err {err:.1e}")
                return float("inf")
            tot += ms
        return tot

    t_base = measure("tuned (current)", base)
    w2_0 = _h2(H2_W2[0])
    t13 = {c: measure(f"h2 w13 {c}", dict(**_h2(c), w2=w2_0)) for c in H2_W13}
    b13 = min(t13, key=t13.get)
    t2 = {c: measure(f"h2 w13 {b13} w2 {c}", dict(**_h2(b13), w2=_h2(c)))
          for c in H2_W2[1:]}  # fmt: skip
    t2[H2_W2[0]] = t13[b13]
    b2 = min(t2, key=t2.get)
    best = dict(**_h2(b13), w2=_h2(b2)) if t2[b2] < t_base else base
    log(f"  int4_decode (T*k <= {tables.int4_decode_max_pairs}) for configs/{tables.kind}.json:"
        f" {best} (T=1 + T=8 ms: tuned {t_base:.4f}, best swept {t2[b2]:.4f})")  # fmt: skip
    # h2 against the generic fused_moe kernel (what the backend runs above the decode range) on
    # uniform random routing, which favours h2: its cost grows with the pairs, the grouped
    # kernel's with the distinct experts. The model rows show concentrated routing (run 15).
    from k2serve.kernels import fused_moe as fm

    for T in (16, 32, 64, 128):
        routes = [_route(T, E, k, dev) for _ in range(2)]
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        nb = sum(int(ti.unique().numel()) for _, ti in routes) / 2 * per_expert
        ms_g = graph_ms([lambda tw=tw, ti=ti: fm.fused_moe(x, ew, tw, ti) for tw, ti in routes])
        ms_h = graph_ms([lambda tw=tw, ti=ti: int4_moe_decode(x, ew, tw, ti, best)
                         for tw, ti in routes])  # fmt: skip
        row("gemv", f"T={T} generic fused_moe", ms_g, nb, 0, "")
        row("gemv", f"T={T} best h2", ms_h, nb, 0, f"{ms_g / ms_h:.2f}x")
    del ew
    torch.cuda.empty_cache()


# grouped decode GEMV configs: (BLOCK_M, BLOCK_N, W, num_warps) of the gate+up launch,
# (BLOCK_N, W, num_warps) of the down launch, options of both (PREFETCH: next K-block's loads
# in registers; F16SUM: a word's two halves added in fp16; SKIP=0: padding rows computed);
# each compiles for sm_90 without spills (at most 192 registers)
GG_CFGS = [((4, 16, 64, 4), (16, 64, 4), {}), ((4, 16, 64, 4), (16, 64, 4), {"PREFETCH": 1}),
           ((4, 16, 64, 4), (16, 64, 4), {"F16SUM": 1}), ((4, 16, 64, 4), (16, 64, 4), {"SKIP": 0}),
           ((4, 8, 64, 4), (8, 128, 4), {}), ((4, 32, 64, 8), (32, 128, 8), {}),
           ((8, 16, 64, 8), (16, 128, 4), {}), ((2, 16, 64, 4), (16, 128, 4), {}),
           ((4, 16, 128, 8), (16, 128, 4), {}), ((8, 16, 64, 4), (16, 64, 4), {})]  # fmt: skip


def _gg(c13, c2, opts):
    return dict(BLOCK_M=c13[0], BLOCK_N=c13[1], W=c13[2], num_warps=c13[3], GS=1, **opts,
                w2=dict(BLOCK_N=c2[0], W=c2[1], num_warps=c2[2], GS=1))  # fmt: skip


def part_ggemv():
    """The grouped decode GEMV (rows grouped by expert, each weight tile read once per block)
    against the per-pair one (`int4_decode`) and the INT4 GEMM (`int4_prefill`, what the
    backend runs above int4_decode_max_pairs) on one K2 layer at T = 16..256 tokens x top-8,
    uniform routing, and T = 64, 128 with experts drawn with weights exp(2 N(0, 1))
    (concentrated, as in the k2-slice model): relative difference from the per-pair GEMV,
    graph-timed ms over 2 routings, % of copy bandwidth counting each hit expert's weights +
    scales once; a config sweep prints the best per case and the table entries to use."""
    from k2serve.kernels.int4_gemm import int4_moe_gemm
    from k2serve.kernels.int4_gemv import int4_moe_decode, int4_moe_decode_grouped

    tables = engine_policy().tables
    dev = "cuda"
    E, D, I, k = 384, 7168, 2048, 8
    ew = _rand_experts("int4", E, D, I, dev)
    per_expert = sum(t[0].numel() * t.element_size()
                     for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))  # fmt: skip
    h2, gemm_cfg = dict(tables.int4_decode), tables.int4_prefill
    shipped = dict(tables.int4_decode_grouped) or _gg(*GG_CFGS[0])
    cands = [("shipped", shipped)]
    cands += [(f"{a}/{b}{''.join(f' {o_k}={o_v}' for o_k, o_v in o.items())}", _gg(a, b, o))
              for a, b, o in GG_CFGS]  # fmt: skip

    def route(T, skew):
        if skew == 0:
            return _route(T, E, k, dev)
        p = torch.exp(skew * torch.randn(E, device=dev))
        return torch.rand(T, k, device=dev), torch.multinomial(p.expand(T, E), k).int()

    def pct(nb, ms):
        return 100 * nb / ms / 1e6 / CEIL["bw"]

    best, summary = {}, {}
    cases = [(T, 0.0) for T in (16, 32, 64, 128, 192, 256)] + [(64, 2.0), (128, 2.0)]
    for T, skew in cases:
        tag = f"T={T}{' skew' if skew else ''}"
        routes = [route(T, skew) for _ in range(2)]
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
        hit = sum(int(ti.unique().numel()) for _, ti in routes) / 2
        nb = hit * per_expert
        refs = [int4_moe_decode(x, ew, tw, ti, h2) for tw, ti in routes]
        ms_h = graph_ms([lambda tw=tw, ti=ti: int4_moe_decode(x, ew, tw, ti, h2)
                         for tw, ti in routes])  # fmt: skip
        row("ggemv", f"{tag} per-pair GEMV ({hit:.0f} exp)", ms_h, nb)
        ms_g = graph_ms([lambda tw=tw, ti=ti: int4_moe_gemm(x, ew, tw, ti, gemm_cfg)
                         for tw, ti in routes])  # fmt: skip
        row("ggemv", f"{tag} INT4 GEMM", ms_g, nb)
        res = {}
        for name, cfg in cands:
            try:
                outs = [int4_moe_decode_grouped(x, ew, tw, ti, cfg) for tw, ti in routes]
                err = max(((o.float() - r.float()).norm() / r.float().norm()).item()
                          for o, r in zip(outs, refs))  # fmt: skip
                ms = graph_ms([lambda tw=tw, ti=ti, c=cfg: int4_moe_decode_grouped(x, ew, tw, ti, c)
                               for tw, ti in routes])  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a config that does not run is reported
                log(f"  ggemv {tag} {name}: {type(e).__name__}: {str(e)[:300]}")
                FAILS.append(f"ggemv {tag} {name}")
                continue
            row("ggemv", f"{tag} grouped {name}", ms, nb, 0,
                f"{ms_h / ms:.2f}x per-pair, {ms_g / ms:.2f}x GEMM, diff {err:.1e}")  # fmt: skip
            if err > 4e-3:
                FAILS.append(f"ggemv {tag} {name} diff {err:.1e}")
            else:
                res[name] = ms
        if res:
            b = min(res, key=res.get)
            best[(T, skew)] = b
            summary[(T, skew)] = (ms_h, ms_g, res[b], res.get("shipped", float("nan")))
            log(f"  ggemv {tag}: grouped best {b} {res[b]:.3f} ms ({pct(nb, res[b]):.0f}% of copy "
                f"bw), shipped {summary[(T, skew)][3]:.3f}; per-pair {ms_h:.3f} ms "
                f"({pct(nb, ms_h):.0f}%), GEMM {ms_g:.3f} ms ({pct(nb, ms_g):.0f}%)")  # fmt: skip
    # the table entries: the config best most often; min pairs = the smallest uniform T*k
    # from which the grouped GEMV beats the per-pair one at every larger T; max pairs = the
    # largest T*k up to which it beats the GEMM in every case (uniform and concentrated)
    names = dict(cands)
    vals = list(best.values())
    top = max(set(vals), key=vals.count, default=None)
    gmin = None
    for T in sorted((T for T, sk in summary if sk == 0), reverse=True):
        if summary[(T, 0.0)][2] >= summary[(T, 0.0)][0]:
            break
        gmin = T * k
    gmax = None
    for T in sorted({T for T, _ in summary}):
        if any(v[2] >= v[1] for (t, _), v in summary.items() if t == T):
            break
        gmax = T * k
    log(f"  best per case: {best}")
    if top is not None:
        log(f"  for configs/{tables.kind}.json: \"int4_decode_grouped\": {json.dumps(names[top], default=dict)}, "
            f"\"int4_decode_grouped_min_pairs\": {json.dumps(gmin)}, \"int4_decode_grouped_max_pairs\": "
            f"{json.dumps(gmax)} (measured T*k only: refine between them)")  # fmt: skip
    del ew
    torch.cuda.empty_cache()


# (N, K) of K2's bf16 projections at batch 1: q_a+kv_a, q_b, o_proj, shared gate+up, shared
# down, dense gate+up, dense down, router, lm_head
GEMV_SHAPES = [(2112, 7168), (12288, 1536), (7168, 8192), (4096, 7168), (7168, 2048),
               (36864, 7168), (7168, 18432), (384, 7168), (163840, 7168)]  # fmt: skip
GEMV_BF16_CANDS = [(2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (4, 512, 2), (8, 512, 4),
                   (16, 512, 8), (2, 512, 2), (1, 1024, 4)]  # fmt: skip


def part_gemv_bf16():
    """The one-row bf16 GEMV against cuBLAS (F.linear) per K2 shape, graph-timed over enough
    weight copies to defeat L2; the faster of the two (and the best config) is printed as the
    `gemv_bf16` table (None: cuBLAS); nothing is changed in place."""
    from k2serve.kernels import gemv as gv

    table = {}

    dev = "cuda"
    for N, K in GEMV_SHAPES:
        nb = N * K * 2
        copies = max(2, -(-256 * 2**20 // nb))
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), ws[0].float())
        ms_cu = graph_ms([lambda w=w: F.linear(x, w) for w in ws])
        row("gemv16", f"{N}x{K} cuBLAS", ms_cu, nb)
        best = (ms_cu, None)
        for bn, bk, nw in GEMV_BF16_CANDS:
            if K % bk:
                continue
            cand = {(N, K): dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw)}
            err = ((gv.gemv(x, ws[0], table=cand).float() - ref).norm() / ref.norm()).item()
            ms = graph_ms([lambda w=w: gv.gemv(x, w, table=cand) for w in ws])
            row("gemv16", f"{N}x{K} bn{bn} bk{bk} w{nw}", ms, nb, 0, f"err {err:.1e}")
            if err > 1e-2:
                FAILS.append(f"gemv16 {N}x{K} {bn}/{bk}/{nw} err {err:.1e}")
            elif ms < best[0]:
                best = (ms, cand[(N, K)])
        table[(N, K)] = best[1]
        log(f"  gemv16 {N}x{K}: {best[1] or 'cuBLAS'} {best[0]:.4f} ms (cuBLAS {ms_cu:.4f})")
        del ws
    log("  gemv_bf16 = " + json.dumps([dict(N=n, K=k, config=c) for (n, k), c in table.items()]))
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ model
def nbytes(mod) -> int:
    return sum(p.numel() * p.element_size() for p in mod.parameters())


# the decode fusions of the kernel policy, off (the "model-base" rows and check_pinned)
UNFUSED = dict(fused_rope=False, triton_router=False, fused_projections=False,
               decode_gemv=False, shared_stream=False)  # fmt: skip


def engine_policy(**changes):
    """The kernel policy the engine builds on this GPU, with `changes` (dataclasses.replace)."""
    from k2serve.kernels.policy import KernelPolicy

    return replace(KernelPolicy.for_device("cuda"), **changes)


def setup(model, policy=None, expand=False):
    """Set the engine's GPU backends up on `model` with `policy` (None: the engine's), as the
    engine does (`k2serve.model.backends`); expand: pure prefills take the expanded attention
    path."""
    from k2serve.model.backends import setup_backends

    policy = replace(policy or engine_policy(), mla_prefill="expand" if expand else "absorbed")
    setup_backends(model, "triton", "triton", "triton", policy=policy)
    torch.cuda.empty_cache()


def load_slice(layers, fmt=None):
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    fmt = fmt or WEIGHTS["format"]
    cfg = ModelConfig.from_hf(preset_config("k2-slice", fmt, layers=layers))
    t = time.time()
    model = load_model(None, load_format="dummy", config=cfg, device="cuda", progress=False)
    log(f"loaded k2-slice {fmt} {layers} layers in {time.time() - t:.0f}s, "
        f"{nbytes(model) / 1e9:.1f} GB")  # fmt: skip
    return model


def decode_inputs(B, ctx, ps, dev="cuda"):
    from k2serve.attention.base import AttentionMetadata

    ppseq = -(-(ctx + 1) // ps)
    bt = torch.arange(B * ppseq, device=dev, dtype=torch.int32).view(B, ppseq)
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, device=dev, dtype=torch.int32),
        seq_lens=torch.full((B,), ctx + 1, device=dev, dtype=torch.int32),
        context_lens=torch.full((B,), ctx, device=dev, dtype=torch.int32),
        block_table=bt, slot_mapping=(bt[:, ctx // ps].long() * ps + ctx % ps),
        max_query_len=1, max_seq_len=ctx + 1, page_size=ps, num_decodes=B,
    )  # fmt: skip
    ids = torch.randint(0, 2000, (B,), device=dev)
    return ids, torch.full((B,), ctx, device=dev, dtype=torch.long), md


def prefill_inputs(T, ps, dev="cuda"):
    from k2serve.attention.base import AttentionMetadata

    pages = -(-T // ps)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], device=dev, dtype=torch.int32),
        seq_lens=torch.tensor([T], device=dev, dtype=torch.int32),
        context_lens=torch.zeros(1, device=dev, dtype=torch.int32),
        block_table=torch.arange(pages, device=dev, dtype=torch.int32)[None],
        slot_mapping=torch.arange(T, device=dev), max_query_len=T, max_seq_len=T, page_size=ps,
        query_start_loc_host=np.array([0, T]), context_lens_host=np.zeros(1, dtype=np.int64),
    )  # fmt: skip
    return torch.randint(0, 2000, (T,), device=dev), torch.arange(T, device=dev), md


def experts_hit(model, ids, pos, md, kv):
    """Distinct routed experts per MoE layer for this batch (one eager pass, recorded)."""
    hits = {}
    for i, layer in enumerate(model.model.layers):
        be = getattr(layer.mlp, "expert_backend", None)
        if be is None:
            continue

        def rec(h, tid, tw, _be=be, _i=i):
            hits[_i] = int(tid.unique().numel())
            return _be(h, tid, tw)

        layer.mlp.expert_backend = rec
    model(ids, pos, md, kv)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "expert_backend") and not hasattr(
            layer.mlp.expert_backend, "weights"
        ):
            layer.mlp.expert_backend = layer.mlp.expert_backend.__defaults__[0]
    return hits


def decode_bytes(model, B, ctx, hits) -> float:
    c = model.config
    total = nbytes(model.lm_head) + nbytes(model.model.norm) + B * c.hidden_size * 2
    for i, layer in enumerate(model.model.layers):
        total += nbytes(layer.self_attn) + nbytes(layer.input_layernorm)
        total += nbytes(layer.post_attention_layernorm)
        mlp = layer.mlp
        if hasattr(mlp, "expert_backend"):
            ew = mlp.expert_backend.weights
            per = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2)
                      if t is not None)  # fmt: skip
            per += sum(t[0].numel() * t.element_size() for t in (ew.w13_scale, ew.w2_scale)
                       if t is not None)  # fmt: skip
            total += nbytes(mlp.gate) + nbytes(mlp.shared_experts) + hits[i] * per
        else:
            total += nbytes(mlp)
        total += B * (ctx + 1) * c.kv_cache_dim * 2
    return total


def prefill_flops(model, T, expanded=False) -> float:
    c = model.config
    H, L, R, N, V = (c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim,
                     c.qk_nope_head_dim, c.v_head_dim)  # fmt: skip
    per_tok = 0
    for layer in model.model.layers:
        a = layer.self_attn
        per_tok += sum(m.in_features * m.out_features for m in (a.q_a_proj, a.q_b_proj,
                       a.kv_a_proj_with_mqa, a.o_proj))  # fmt: skip
        per_tok += H * (N + V) * L  # W_UK/W_UV folded (absorbed) or kv_b_proj expansion
        if expanded:  # per-head K (N + R) and V (V) against the causal mean number of keys
            per_tok += H * (N + R + V) * (T + 1) / 2
        else:
            per_tok += H * (L + R + L) * (T + 1) / 2  # absorbed attention
        if hasattr(layer.mlp, "expert_backend"):
            per_tok += c.n_routed_experts * c.hidden_size  # router
            per_tok += (
                3
                * c.hidden_size
                * c.moe_intermediate_size
                * (c.num_experts_per_tok + c.n_shared_experts)
            )
        else:
            per_tok += 3 * c.hidden_size * c.intermediate_size
    return 2 * per_tok * T + 2 * c.hidden_size * c.vocab_size


def profile_step(model, kv, B, ctx, ps=64):
    """torch.profiler kernel split of eager decode steps (graph replay runs the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    ids, pos, md = decode_inputs(B, ctx, ps)
    with torch.inference_mode():
        for _ in range(3):
            model.compute_logits(model(ids, pos, md, kv))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model.compute_logits(model(ids, pos, md, kv))
            torch.cuda.synchronize()
    ka = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):
        try:
            log(f"== profile: eager decode B={B} ctx={ctx}, 5 steps, CUDA kernels")
            log(ka.table(sort_by=key, row_limit=22, max_name_column_width=70))
            break
        except Exception as e:  # noqa: BLE001 - the attribute name moved between versions
            log(f"  (sort by {key}: {e!r})")


PREFILL_BUCKETS = (  # kernel-name substrings -> the part of a prompt step they belong to
    ("INT4 MoE GEMM", ("int4_gemm", "gluon")),
    ("attention", ("flash", "fmha", "attention", "mla", "sdpa")),
    ("bf16 GEMM", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "matmul")),
    ("routing / align", ("moe_align", "topk", "router", "sort", "select", "scatter", "gather")),
    ("norm / rope / act", ("norm", "rope", "silu", "act_", "mul")),
)


def part_mlasweep(layers, ps=64, Ts=(256, 512, 1024, 2048, 4096, 8192)):
    """A prompt step of T tokens with the expanded and the absorbed MLA (where "expand" pays)."""
    from k2serve.attention import allocate_kv_caches

    model = load_slice(layers)
    kv = allocate_kv_caches(model.config, -(-max(Ts) // ps) + 1, ps, torch.bfloat16, "cuda")
    for T in Ts:
        ids, pos, md = prefill_inputs(T, ps)
        ms = {}
        for expand in (True, False):
            setup(model, expand=expand)
            with torch.inference_mode():
                ms[expand] = timed(lambda: model.compute_logits(model(ids, pos, md, kv)[-1:]),
                                   iters=5, warmup=2)  # fmt: skip
        fl = prefill_flops(model, T, expanded=True)
        for expand in (True, False):
            row("mla", f"T={T} MLA {'expand' if expand else 'absorbed'}", ms[expand], 0, fl,
                f"absorbed / expand = {ms[False] / ms[True]:.2f}")  # fmt: skip
    del kv, model
    torch.cuda.empty_cache()


def part_pprof(layers, T=8192, ps=64):
    """Kernel split of a T-token prompt step (issue 28: where the prefill's time goes), with
    the expanded MLA prompt path (the engine's) and the absorbed one."""
    from torch.profiler import ProfilerActivity, profile

    from k2serve.attention import allocate_kv_caches

    model = load_slice(layers)
    kv = allocate_kv_caches(model.config, -(-T // ps) + 1, ps, torch.bfloat16, "cuda")
    ids, pos, md = prefill_inputs(T, ps)
    step = lambda: model.compute_logits(model(ids, pos, md, kv)[-1:])  # noqa: E731
    for expand in (True, False):
        setup(model, expand=expand)
        mode = "expand" if expand else "absorbed"
        with torch.inference_mode():
            ms = timed(step, iters=5, warmup=2)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
        fl = prefill_flops(model, T, expanded=True)
        row("pprof", f"T={T} step, MLA {mode}", ms, 0, fl, "FLOPs of the expanded form")
        log(f"== profile: prefill T={T}, {layers} layers, MLA {mode}, {ms:.1f} ms a step")
        ka = prof.key_averages()
        log(ka.table(sort_by="device_time_total", row_limit=25, max_name_column_width=90))
        sums: dict[str, float] = {}
        for e in ka:
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            name = e.key.lower()
            part = next((b for b, keys in PREFILL_BUCKETS if any(k in name for k in keys)),
                        "other")  # fmt: skip
            sums[part] = sums.get(part, 0.0) + us / 3e3
        total = sum(sums.values())
        for part, v in sorted(sums.items(), key=lambda kv_: -kv_[1]):
            row("pprof", f"T={T} {mode}: {part}", v,
                note=f"{v / total * 100:.0f}% of {total:.1f} ms kernels")  # fmt: skip
    del kv, model
    torch.cuda.empty_cache()


def part_mixed(layers, ps=64, cases=((256, 1792), (16, 1024), (0, 2048), (256, 0), (64, 0))):
    """Eager steps of D decodes (1K context) + one P-token prompt, the served engine's mixed
    steps (they run without a CUDA graph): GPU time (CUDA events) against the host's time to
    enqueue the step (GPU idle at the start) and the kernels' own sum (profiler). A step whose
    enqueue time is near its GPU time is launch-bound: piecewise graphs would pay there."""
    from dataclasses import replace as dc_replace

    from torch.profiler import ProfilerActivity, profile

    from k2serve.attention import allocate_kv_caches
    from k2serve.testing.fidelity import Batch

    model = load_slice(layers)
    setup(model, expand=True)
    need = max(D * -(-1025 // ps) + -(-P // ps) for D, P in cases) + 2
    kv = allocate_kv_caches(model.config, need, ps, torch.bfloat16, "cuda")
    for D, P in cases:
        b = Batch(f"mixed D={D} P={P}", [1024] * D + ([0] if P else []),
                  [1] * D + ([P] if P else []), ps)  # fmt: skip
        ids, pos, md = b.tensors("cuda", 2000)
        md = dc_replace(md, num_decodes=D)
        last = torch.as_tensor(md.query_start_loc_host[1:] - 1, device="cuda")
        step = lambda: model.compute_logits(model(ids, pos, md, kv)[last])  # noqa: E731
        with torch.inference_mode():
            ms = timed(step, iters=10, warmup=3)
            hs = []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                hs.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
        ka = prof.key_averages()
        kern = sum((getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))
                   for e in ka) / 3e3  # fmt: skip
        n = sum(e.count for e in ka if (getattr(e, "device_time_total", None)
                                        or getattr(e, "cuda_time_total", 0.0))) / 3  # fmt: skip
        row("mixed", f"D={D} P={P} eager step", ms,
            note=f"host enqueue {sorted(hs)[2]:.1f} ms, kernels {kern:.1f} ms, "
                 f"{n:.0f} kernels, GPU idle {max(ms - kern, 0) / ms * 100:.0f}%")  # fmt: skip
    del kv, model
    torch.cuda.empty_cache()


def part_dprof(layers, batches=(32, 128), ctx=1024, ps=64):
    """Kernel split of eager decode steps of B sequences under uniform routing (issue 28's
    B=32 / B=128 targets: which kernels hold the time the bandwidth figure misses)."""
    from routing_modes import RoutingOverride
    from torch.profiler import ProfilerActivity, profile

    from k2serve.attention import allocate_kv_caches

    model = load_slice(layers)
    setup(model, expand=True)
    kv = allocate_kv_caches(model.config, max(batches) * -(-(ctx + 1) // ps) + 1, ps,
                            torch.bfloat16, "cuda")  # fmt: skip
    with RoutingOverride(model, "uniform", 8192):
        for B in batches:
            ids, pos, md = decode_inputs(B, ctx, ps)
            step = lambda: model.compute_logits(model(ids, pos, md, kv))  # noqa: E731
            with torch.inference_mode():
                hits = experts_hit(model, ids, pos, md, kv)
                ms = timed(step, iters=10)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
            ka = prof.key_averages()
            log(f"== profile: eager decode B={B} ctx={ctx}, uniform routing, {ms:.2f} ms a step")
            log(ka.table(sort_by="device_time_total", row_limit=18, max_name_column_width=80))
            nb = decode_bytes(model, B, ctx, hits)
            row("dprof", f"B={B} eager step (uniform)", ms, nb)
            for e in sorted(ka, key=lambda e: -(getattr(e, "device_time_total", 0.0) or 0.0))[:8]:
                us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
                row("dprof", f"B={B} {e.key[:40]}", us / 5e3, note=f"{e.count // 5} calls a step")
    del kv, model
    torch.cuda.empty_cache()


def bench_prefill(model, tag, prefills=(1024, 8192), expanded=False, ps=64):
    from k2serve.attention import allocate_kv_caches

    kv = allocate_kv_caches(model.config, -(-max(prefills) // ps) + 1, ps, torch.bfloat16, "cuda")
    res = {}
    for T in prefills:
        ids, pos, md = prefill_inputs(T, ps)
        with torch.inference_mode():
            ms = timed(
                lambda: model.compute_logits(model(ids, pos, md, kv)[-1:]), iters=5, warmup=2
            )
        fl = prefill_flops(model, T, expanded)
        row(tag, f"prefill T={T}", ms, 0, fl, f"{T / ms * 1e3:.0f} tok/s")
        res[f"prefill{T}"] = (ms, fl)
    del kv
    torch.cuda.empty_cache()
    return res


def check_expand(model):
    """Layer 0 attention: expanded prefill (with a cached prefix) vs the absorbed Triton path."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.attention.base import AttentionMetadata

    attn = model.model.layers[0].self_attn
    dev, ps = "cuda", 64
    ctx, ql = [300, 0], [200, 129]
    seq = [c + q for c, q in zip(ctx, ql)]
    maxp = max(-(-s // ps) for s in seq)
    bt = torch.arange(2 * maxp, device=dev, dtype=torch.int32).view(2, maxp)
    slots = torch.cat([bt[b, (c + torch.arange(q, device=dev)) // ps].long() * ps
                       + (c + torch.arange(q, device=dev)) % ps
                       for b, (c, q) in enumerate(zip(ctx, ql))])  # fmt: skip
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, ql[0], sum(ql)], device=dev, dtype=torch.int32),
        seq_lens=torch.tensor(seq, device=dev, dtype=torch.int32),
        context_lens=torch.tensor(ctx, device=dev, dtype=torch.int32),
        block_table=bt, slot_mapping=slots, max_query_len=max(ql), max_seq_len=max(seq),
        page_size=ps,
    )  # fmt: skip
    x = torch.randn(sum(ql), model.config.hidden_size, device=dev, dtype=torch.bfloat16)
    pos = torch.cat([c + torch.arange(q, device=dev) for c, q in zip(ctx, ql)])
    outs, mode0 = [], attn.backend.prefill
    cache0 = allocate_kv_caches(model.config, 2 * maxp, ps, torch.bfloat16, dev)[0].normal_()
    for mode in ("absorbed", "expand"):
        attn.backend.prefill = mode
        with torch.inference_mode():
            outs.append(attn(x, pos, md, cache0.clone()))
    attn.backend.prefill = mode0
    check("attention expanded vs absorbed (prefix 300+200, 0+129)", outs[1], outs[0], 2e-2)


def bench_model(model, tag, batches=(1, 8, 32, 128), prefills=(1024, 8192), ctx=1024,
                profile_batches=(), expanded=False):  # fmt: skip
    from k2serve.attention import allocate_kv_caches
    from k2serve.model.cuda_graph import DecodeGraphRunner

    ps = 64
    ppseq = -(-(ctx + 1) // ps)
    pages = max(batches) * ppseq + 1
    kv = allocate_kv_caches(model.config, pages, ps, torch.bfloat16, "cuda")
    for t in kv:
        t.normal_()
    res = {}
    runner = DecodeGraphRunner(model, kv, ppseq, buckets=tuple(batches), with_logits=True)
    t0 = time.time()
    runner.capture()
    log(f"  captured {len(batches)} decode graphs in {time.time() - t0:.1f}s")
    for B in batches:
        ids, pos, md = decode_inputs(B, ctx, ps)
        with torch.inference_mode():
            hits = experts_hit(model, ids, pos, md, kv)
            ms = timed(lambda: runner.run(ids, pos, md), iters=30)
            nb = decode_bytes(model, B, ctx, hits)
            avg = sum(hits.values()) / max(1, len(hits))
            row(tag, f"decode B={B} ctx={ctx} graph", ms, nb, 0, f"{B / ms * 1e3:.0f} tok/s, "
                f"{avg:.0f} experts/layer")  # fmt: skip
            res[f"decode{B}"] = (ms, nb)
            if B == 1:
                ms_e = timed(lambda: model.compute_logits(model(ids, pos, md, kv)), iters=10)
                row(tag, f"decode B={B} ctx={ctx} eager", ms_e, nb, 0, "no graph")
    for B in profile_batches:
        profile_step(model, kv, B, ctx)
    del runner, kv
    torch.cuda.empty_cache()
    if prefills:
        res.update(bench_prefill(model, tag, prefills, expanded, ps))
    return res


# ------------------------------------------------------------------------------------ peer
def build_peer(ours):
    """transformers DeepseekV3 (grouped_mm experts, sdpa) with our weights dequantized to bf16."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from k2serve.kernels.fused_moe import expert_dense

    raw = ours.config.to_hf()
    raw.pop("quantization_config", None)
    raw.pop("auto_map", None)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    hf_cfg._experts_implementation = "grouped_mm"
    hf_cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            peer = DeepseekV3ForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(old)
    peer = peer.to_empty(device="cuda").eval()
    ours_sd = ours.state_dict()
    with torch.no_grad():
        for name, p in peer.named_parameters():
            if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
                continue
            src = ours_sd.get(name)
            if src is None:
                base = name[: -len(".weight")]
                mod = ours.get_submodule(base)
                src = mod.dequantized_weight(torch.bfloat16)
            p.copy_(src.to(p.dtype))
        for i, layer in enumerate(peer.model.layers):
            be = getattr(ours.model.layers[i].mlp, "expert_backend", None)
            if be is None:
                continue
            ew = be.weights
            for e in range(ew.num_experts):
                w13, w2 = expert_dense(ew, e)
                layer.mlp.experts.gate_up_proj[e].copy_(w13)
                layer.mlp.experts.down_proj[e].copy_(w2)
        for name, b in peer.named_buffers():
            if "inv_freq" in name:
                continue
            src = ours_sd.get(name)
            if src is not None:
                b.copy_(src)
    peer.model.rotary_emb.__init__(hf_cfg)
    peer.model.rotary_emb.to("cuda")
    return peer


def bench_peer(peer, ctx=1024, prefill=8192):
    res = {}
    with torch.inference_mode():
        ids = torch.randint(0, 160000, (1, ctx), device="cuda")
        out = peer(ids, use_cache=True)
        cache = out.past_key_values
        nxt = torch.randint(0, 160000, (1, 1), device="cuda")
        crop = getattr(cache, "crop", None)

        def step():
            peer(nxt, past_key_values=cache, use_cache=True)
            if crop is not None:
                crop(ctx)

        res["decode1"] = timed(step, iters=20)
        ids = torch.randint(0, 160000, (1, prefill), device="cuda")
        res[f"prefill{prefill}"] = timed(lambda: peer(ids, use_cache=False, logits_to_keep=1),
                                         iters=3, warmup=1)  # fmt: skip
    return res


def check_pinned(fmt="int4"):
    """The decode fusions against the torch reference with the routing pinned (k2serve.testing.
    fidelity): a 3-layer k2-slice with 32 experts per layer (its float32 gold copy fits beside
    it), fusions off / on / on + CUDA graphs, decode B=8 at context 1024 and a cached-prefix
    prefill; per layer and at the logits within the bf16 rounding budget measured in the same
    run. Replaces the unpinned "fusions on vs off" and "peer vs ours logits" comparisons, which
    failed on routing flips (top-8 choices on dummy weights), not on kernel numerics."""
    from k2serve.testing.fidelity import (
        Variant,
        check_model,
        decode_batch,
        prefix_prefill_batch,
        reference_setup,
    )

    sys.path.insert(0, os.path.dirname(__file__))
    from fidelity import build

    model = build(fmt, 3, 32, False, "cuda")
    variants = [
        Variant("fusions off", lambda m: setup(m, engine_policy(**UNFUSED), expand=True)),
        Variant("fusions on (engine policy)", lambda m: setup(m, expand=True)),
        Variant("fusions on + CUDA graphs", lambda m: setup(m), graphs=True),
    ]
    res = check_model(model, variants, [decode_batch(8, 1024), prefix_prefill_batch()],
                      reference=reference_setup, log=log)  # fmt: skip
    for r in res:
        if not r.ok:
            FAILS.append(f"pinned {r.name}")
    del model
    gc.collect()
    torch.cuda.empty_cache()


def _tag(base, mode):
    """Row tag of a routing and format: base (dummy router, INT4), base-fp8, base[uniform]."""
    if WEIGHTS["format"] != "int4":
        base = f"{base}-{WEIGHTS['format']}"
    return base if mode == "dummy" else f"{base}[{mode.split('/')[-1]}]"


def part_model_and_peer(layers, do_peer, routings=("dummy",), quick=False):
    """k2-slice decode / prefill (and the transformers peer on 3 layers) for each routing
    (routing_modes.py: the dummy router, uniform, or replayed from a --record-routing file).
    quick: no pinned fidelity check, no fusions-off rows, no profiles."""
    from routing_modes import RoutingOverride

    if not quick:
        check_pinned()
    model = load_slice(layers)
    if not quick:
        setup(model, engine_policy(**UNFUSED), expand=True)  # the decode fusions off
        check_expand(model)
        bench_model(model, "model-base", batches=(1, 8), prefills=())
    setup(model, expand=True)
    for mode in routings:
        with RoutingOverride(model, mode, 8192):
            prof = (1, 8) if mode == routings[0] and not quick else ()
            bench_model(model, _tag("model", mode), profile_batches=prof, expanded=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not do_peer:
        return
    model = load_slice(3)
    setup(model, expand=True)
    ours = {}
    for mode in routings:
        with RoutingOverride(model, mode, 8192):
            ours[mode] = bench_model(model, _tag("ours-3L", mode), batches=(1,), prefills=(8192,),
                                     expanded=True)  # fmt: skip
    peer = build_peer(model)  # timed only: numerics are checked pinned in check_pinned()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for mode in routings:
        ms_ours_dec, nb = ours[mode]["decode1"]
        ms_ours_pf, fl = ours[mode]["prefill8192"]
        with RoutingOverride(peer, mode, 8192, hf=True):
            p = bench_peer(peer)
        row(_tag("peer", mode), "HF decode B=1 ctx=1k (eager)", p["decode1"], nb, 0,
            f"ours/peer tok/s = {p['decode1'] / ms_ours_dec:.2f}x")  # fmt: skip
        row(_tag("peer", mode), "HF prefill T=8192", p["prefill8192"], 0, fl,
            f"ours/peer tok/s = {p['prefill8192'] / ms_ours_pf:.2f}x")  # fmt: skip


class TritonCompiles:
    """Counts Triton JIT compiles (in-memory cache misses) between start() and stop() through
    triton.knobs.runtime's jit_cache_hook / jit_post_compile_hook: kernel names and seconds."""

    def __init__(self):
        import triton

        self.knobs = getattr(triton, "knobs", None)
        self.names: list[str] = []
        self.specs: list[str] = []
        self.seconds = 0.0
        self._t0 = 0.0
        self.on = False
        if self.knobs is not None:
            self.knobs.runtime.jit_cache_hook = self._before
            self.knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kwargs):
        self._t0 = time.time()
        if self.on:
            r = str(kwargs.get("repr", "?"))
            self.names.append(r.split("[")[0])
            self.specs.append(r.split("](")[-1][:400])  # the argument types: i32 / i32D / i1 ...
        return False  # compile

    def _after(self, *args, **kwargs):
        if self.on:
            self.seconds += time.time() - self._t0
        return False

    def start(self):
        self.names, self.specs, self.seconds, self.on = [], [], 0.0, True

    def stop(self) -> tuple[list[str], float]:
        self.on = False
        return self.names, self.seconds

    def close(self):
        if self.knobs is not None:
            self.knobs.runtime.jit_cache_hook = None
            self.knobs.runtime.jit_post_compile_hook = None


def sdpa_backend(flash_only: bool):
    """A context that keeps F.scaled_dot_product_attention off cuDNN's backend (flash, then
    memory-efficient for masks, then math), or nothing."""
    import contextlib

    if not flash_only:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def part_warmup(layers, max_tokens=8192):
    """Start-up warm-up (engine.warmup) on the k2-slice: how long it takes (cold: compiles; a
    warm Triton cache: loads), then the first call of prompt shapes it never ran (odd lengths,
    16 prompts in one step) against their steady time: no compile spike if ~1x."""
    from k2serve.attention import allocate_kv_caches
    from k2serve.engine.warmup import (
        WarmupStep,
        moe_backends,
        run_warmup,
        step_inputs,
        warmup_token_counts,
    )

    model = load_slice(layers)
    setup(model, expand=True)
    ps = 64
    kv = allocate_kv_caches(model.config, max_tokens // ps + 20, ps, torch.bfloat16, "cuda")
    counts = warmup_token_counts(moe_backends(model), model.config.num_experts_per_tok, max_tokens)
    dt = run_warmup(model, kv, page_size=ps, max_num_batched_tokens=max_tokens)
    row(
        "warmup", f"engine.warmup, {len(counts) + 2} steps", dt * 1e3, note=f"token counts {counts}"
    )
    compiles = TritonCompiles()
    first_steps = [((777,), (0,)), ((3001,), (0,)), ((301,) * 16, (0,) * 16), ((1, 555), (700, 0))]
    # the same kinds of step again at other new lengths, SDPA kept off cuDNN: a spike left
    # there is not a per-shape plan of cuDNN's attention
    flash_steps = [((779,), (0,)), ((3003,), (0,)), ((303,) * 16, (0,) * 16), ((1, 557), (702, 0))]
    for steps, flash in ((first_steps, False), (flash_steps, True)):
        for new_tokens, context in steps:
            step = WarmupStep(new_tokens, context)
            ids, pos, md, _ = step_inputs(step, ps, "cuda")
            fn = lambda: model.compute_logits(
                model(ids, pos, md, kv)[(md.query_start_loc[1:] - 1).long()]
            )  # noqa: E731
            with torch.inference_mode(), sdpa_backend(flash):
                torch.cuda.synchronize()
                compiles.start()
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                first = (time.time() - t0) * 1e3
                names, compile_s = compiles.stop()
                steady = timed(fn, iters=3, warmup=1)
            name = (
                f"{len(step.new_tokens)}x{step.new_tokens[-1]}"
                + (" +ctx" if any(step.context) else "")
                + (" (SDPA without cuDNN)" if flash else "")
            )
            row("warmup", f"first step {name} after warm-up", first, note=f"steady {steady:.1f} ms: "
                f"first / steady = {first / steady:.2f}x; Triton compiles {len(names)} "
                f"({compile_s * 1e3:.0f} ms) {sorted(set(names))}")  # fmt: skip
            for n, spec in zip(names, compiles.specs, strict=True):
                print(f"#   compiled {n}({spec})", flush=True)
    compiles.close()
    del model, kv
    gc.collect()
    torch.cuda.empty_cache()


def part_overlap(layers):
    """The k2-slice with the shared expert in order vs on a second stream (same run)."""
    model = load_slice(layers)
    for on in (False, True):
        setup(model, engine_policy(shared_stream=on), expand=True)
        bench_model(model, f"shared-{'stream' if on else 'inline'}", prefills=(1024, 8192),
                    expanded=True, profile_batches=(1,) if on else ())  # fmt: skip


def part_long(layers):
    """Long-context decode (issue 19): B=1 at 128K and B=8 at 32K context, bytes counting the
    latent cache rows read (split-KV sized by the kernel policy for the context)."""
    model = load_slice(layers)
    setup(model, expand=True)
    bench_model(model, "long", batches=(1,), prefills=(), ctx=131072)
    bench_model(model, "long", batches=(8,), prefills=(), ctx=32768)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="ceil,check,model,peer")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--routing",
        default="dummy,uniform",
        help="model/peer routings, comma-separated: dummy (the dummy weights' router), "
        "uniform, record:FILE (a --record-routing counts file); routing_modes.py",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="model part: no pinned check, no fusions-off rows, no profiles",
    )
    ap.add_argument("--format", choices=("int4", "fp8"), default="int4",
                    help="the k2-slice's weights: INT4 experts (group 32) or FP8 blocks")  # fmt: skip
    args = ap.parse_args(argv)
    WEIGHTS["format"] = args.format
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # routing_modes, fidelity
    if not torch.cuda.is_available():
        sys.exit("model_speed.py needs a CUDA device")
    parts = args.parts.split(",")
    if parts == ["probe"]:  # for ncu: the two decode GEMV launches of one T=1 MoE layer
        from k2serve.kernels.int4_gemv import int4_moe_decode

        ew = _rand_experts("int4", 384, 7168, 2048, "cuda")
        tw, ti = _route(1, 384, 8, "cuda")
        x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
        int4_moe_decode(x, ew, tw, ti, engine_policy().tables.int4_decode)
        torch.cuda.synchronize()
        return
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {__import__('triton').__version__} date {time.strftime('%Y-%m-%d')}")  # fmt: skip
    torch.manual_seed(int(os.environ.get("SEED", "0")))
    part_ceil()
    for name, fn in (("check", part_check), ("h2", part_h2), ("ggemv", part_ggemv),
                     ("gemv16", part_gemv_bf16), ("kern", part_kern)):  # fmt: skip
        if name in parts:
            run_part(name, fn)
    if "model" in parts or "peer" in parts:
        from routing_modes import parse_modes

        routings = tuple(parse_modes(args.routing))
        run_part("model", lambda: part_model_and_peer(args.layers, "peer" in parts, routings,
                                                      args.quick))  # fmt: skip
    for name, fn in (("mlasweep", part_mlasweep), ("pprof", part_pprof), ("dprof", part_dprof),
                     ("mixed", part_mixed), ("warmup", part_warmup), ("overlap", part_overlap),
                     ("long", part_long)):  # fmt: skip
        if name in parts:  # the parts on the k2-slice of --layers layers
            run_part(name, lambda fn=fn: fn(args.layers))
    print_table()


def run_part(name, fn):
    """Run one bench part under a header; an exception is printed and recorded, not raised, so
    the parts after it still run."""
    log(f"== {name}")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - report and go on to the next part
        import traceback

        traceback.print_exc()
        FAILS.append(f"{name}: {e!r}"[:200])


def print_table():
    """The ceilings, every row as a markdown table, and the failed checks (all bench scripts)."""
    log(f"\nceilings: copy {CEIL['bw']:.0f} GB/s, bf16 matmul {CEIL['mm']:.0f} TFLOP/s")
    log("| part | case | ms | GB/s | % copy bw | TFLOP/s | % matmul | note |")
    log("|---|---|---:|---:|---:|---:|---:|---|")
    for r in ROWS:
        log(
            f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.1f} | {r[6]:.0f} | {r[7]} |"
        )
    log(f"checks failed: {FAILS or 'none'}")


if __name__ == "__main__":
    main()
