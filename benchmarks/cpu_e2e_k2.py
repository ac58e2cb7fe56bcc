"""`cpu_e2e.py --full-k2`: the full Kimi-K2 on this CPU, extrapolated from measured parts.

Each part of one layer is timed with the model's own CPU code path on K2-sized weights (dummy
values), over enough distinct copies to miss the caches, then multiplied by its count in the
full model (61 layers: 1 dense + 60 MoE). Nothing here runs the whole model: the figures are
extrapolations and are printed as such.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from cpu_attn import (
    KVB_BYTES,
    PROJ,
    PROJ_BYTES,
    decode_path,
    mla_flops,
    proj_weights,
    time_mla,
    timeit,
)

from k2serve.kernels.cpu import cpu_head_gemv
from k2serve.quant.linear import linear

LAYERS, DENSE, MOE = 61, 1, 60
D, I_MOE, I_DENSE, VOCAB, TOPK, NH = 7168, 2048, 18432, 163840, 8, 64
SHARED_BYTES = 3 * D * I_MOE * 2
DENSE_BYTES = 3 * D * I_DENSE * 2
LM_BYTES = VOCAB * D * 2
KV_BYTES_PER_TOKEN = (512 + 64) * 2  # bf16 latent + roped key, per layer


def mlp_weights(inter: int, copies: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1)

    def mk(n, k):  # distinct memory, values repeated 8 times (fast to make)
        return (torch.randn(n // 8, k, generator=g) * k**-0.5).bfloat16().repeat(8, 1)

    return [(mk(inter, D), mk(inter, D), mk(D, inter)) for _ in range(copies)]


def time_mlp(ws, rows: int, fn, reps: int = 3) -> float:
    x, h = torch.randn(rows, D).bfloat16(), torch.randn(rows, ws[0][0].shape[0]).bfloat16()

    def run():
        for g, u, d in ws:
            fn(x, g), fn(x, u), fn(h, d)

    return timeit(run, reps) / len(ws)


def time_absorb_kernel(copies: int, rows: int) -> float:
    """The absorbed kv_b at decode as the model runs it (cpu_head_gemv, else bmm)."""
    wk = [torch.randn(NH, 512, 128).bfloat16() for _ in range(copies)]
    wv = [torch.randn(NH, 128, 512).bfloat16() for _ in range(copies)]
    qn, ol = torch.randn(rows, NH, 128).bfloat16(), torch.randn(rows, NH, 512).bfloat16()

    def run():
        for a, b in zip(wk, wv, strict=True):
            if cpu_head_gemv(qn, a) is None:
                torch.bmm(qn.transpose(0, 1), a.transpose(1, 2))
            if cpu_head_gemv(ol, b) is None:
                torch.bmm(ol.transpose(0, 1), b.transpose(1, 2))

    return timeit(run, 3) / copies


def time_routed(n_experts: int, tokens: int, iters: int) -> tuple[float, int]:
    """(seconds per call, bytes per expert) for one MoE layer's routed experts at `tokens`."""
    from cpu_moe import Expert, routing

    from k2serve.moe.cpu_experts import CpuExpertBackend

    g = torch.Generator().manual_seed(0)
    cache: dict = {}
    experts = [Expert("int4", D, I_MOE, g, cache, e) for e in range(n_experts)]
    per = sum(t.numel() * t.element_size() for t in experts[0].parameters())
    be = CpuExpertBackend(experts, range(n_experts), n_experts, kernel="native")
    ts = []
    for i in range(iters + 1):
        ids, w = routing(tokens, n_experts, TOPK, g)
        x = torch.randn(tokens, D, generator=g).bfloat16()
        t0 = time.perf_counter()
        be(x, ids, w)
        if i:
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], per


def full_k2(args, bw: float) -> int:
    P = args.chunk
    print(f"# full K2 EXTRAPOLATED from parts measured on this CPU ({torch.get_num_threads()} "
          f"threads; read bandwidth {bw:.1f} GB/s in this run); decode context "
          f"{args.context}")  # fmt: skip
    pw = proj_weights(3)
    t_proj = time_projections_linear(pw, 1)
    t_proj_p = time_projections_linear(pw[:1], P, reps=1) / P
    del pw
    t_abs = time_absorb_kernel(8, 1)
    # the backend's default bf16 decode (or --mla flash / ref), shuffled pages, over 16 distinct
    # caches (150 MB at 8K: as 61 layers' caches, they miss the CPU's last-level cache)
    t_mla = time_mla(args.context, 1, flash=args.mla != "ref", mode=args.mla, copies=16)
    how = {"auto": f"as the engine runs it here: {decode_path()}", "flash": "torch's flash kernel",
           "ref": "the float32 einsums"}[args.mla]  # fmt: skip
    print(f"# MLA decode: {how} (shuffled pages, 16 distinct caches)")
    sw = mlp_weights(I_MOE, 4)
    t_sh = time_mlp(sw, 1, linear)
    t_sh_p = time_mlp(sw[:1], P, F.linear, reps=1) / P
    del sw
    dw = mlp_weights(I_DENSE, 1)
    t_dense = time_mlp(dw, 1, linear)
    t_dense_p = time_mlp(dw, min(P, 512), F.linear, reps=1) / min(P, 512)
    del dw
    # distinct memory, repeated values (fast to make; the caches see 2.35 GB either way)
    lm = (torch.randn(VOCAB // 40, D) * D**-0.5).bfloat16().repeat(40, 1)
    x1 = torch.randn(1, D).bfloat16()
    t_lm = timeit(lambda: linear(x1, lm), 3)
    t_rt, per_exp = time_routed(args.experts, 1, 8)
    # a prompt chunk: 43 pairs per expert as a 2K-token step over 384 experts
    pre_tokens = max(16, round(P * args.experts / 384))
    t_rt_p = time_routed(args.experts, pre_tokens, 2)[0] / pre_tokens
    # attention's quadratic part: seconds per (query, key) pair, measured at 8K
    nq = 128
    t_q = time_mla(8192 - nq, nq, reps=1)
    per_key = t_q / (mla_flops(8192 - nq, nq) / (2 * NH * (512 + 64 + 512)))
    parts = [  # name, count, bytes per token, seconds per token
        ("attention projections", LAYERS, PROJ_BYTES, t_proj),
        ("absorbed kv_b (W_UK, W_UV)", LAYERS, KVB_BYTES, t_abs),
        (f"MLA over {args.context} cached tokens", LAYERS,
         (args.context + 1) * KV_BYTES_PER_TOKEN, t_mla),
        ("shared expert", MOE, SHARED_BYTES, t_sh),
        ("routed experts (8 INT4)", MOE, TOPK * per_exp, t_rt),
        ("dense layer MLP", DENSE, DENSE_BYTES, t_dense),
        ("lm_head", 1, LM_BYTES, t_lm),
    ]  # fmt: skip
    tot_b = sum(c * b for _, c, b, _ in parts)
    tot_t = sum(c * t for _, c, _, t in parts)
    print(f"{'part (decode, 1 token)':<34} {'count':>5} {'MB/token':>9} {'of bytes':>8} "
          f"{'ms/token':>9} {'of time':>8} {'GB/s':>6} {'of BW':>6}")  # fmt: skip
    for name, c, b, t in parts:
        gbs = b / t / 1e9
        print(f"{name:<34} {c:>5} {c * b / 1e6:>9.0f} {c * b / tot_b:>8.0%} {c * t * 1e3:>9.1f} "
              f"{c * t / tot_t:>8.0%} {gbs:>6.1f} {gbs / bw:>6.0%}")  # fmt: skip
    gbs = tot_b / tot_t / 1e9
    print(f"EXTRAPOLATED full K2 decode, batch 1, context {args.context}: {tot_t * 1e3:.0f} "
          f"ms/token = {1 / tot_t:.2f} tok/s; {tot_b / 1e9:.2f} GB/token at {gbs:.1f} GB/s = "
          f"{gbs / bw:.0%} of the read bandwidth")  # fmt: skip
    lin = LAYERS * t_proj_p + MOE * (t_sh_p + t_rt_p) + DENSE * t_dense_p  # s per token
    print(f"# prefill per token (chunks of {P}): projections {t_proj_p * 1e3:.3f} ms/layer, "
          f"shared {t_sh_p * 1e3:.3f}, routed {t_rt_p * 1e3:.3f} ({pre_tokens} tokens over "
          f"{args.experts} experts = {pre_tokens * TOPK / args.experts:.0f} pairs per expert, "
          f"as a {P}-token step over K2's 384), dense "
          f"{t_dense_p * 1e3:.3f}; MLA {per_key * 1e9:.2f} ns per (query, key) per layer "
          f"(measured at 8K)")  # fmt: skip
    for prompt in (2048, 16384):
        quad = LAYERS * per_key * prompt * (prompt + 1) / 2
        total = lin * prompt + quad + t_lm
        print(f"EXTRAPOLATED full K2 prefill {prompt} tokens: {total:.1f} s = "
              f"{prompt / total:.1f} tok/s (attention's quadratic part "
              f"{quad / total:.0%})")  # fmt: skip
    # hybrid: everything but the routed experts on one GPU at --gpu-tbs (an ASSUMPTION)
    gpu_b = tot_b - MOE * TOPK * per_exp
    gpu_t = gpu_b / (args.gpu_tbs * 1e12)
    cpu_t = MOE * t_rt
    print(f"# hybrid, one GPU: GPU part ASSUMED = {gpu_b / 1e9:.1f} GB at {args.gpu_tbs} TB/s = "
          f"{gpu_t * 1e3:.1f} ms/token (not measured here; RESULTS.md hybrid_moe: 0.868 ms for "
          f"a 3-layer slice's GPU part on the H100); CPU part = 60 x routed experts measured "
          f"here = {cpu_t * 1e3:.1f} ms")  # fmt: skip
    print(f"EXTRAPOLATED hybrid decode: {1 / (gpu_t + cpu_t):.2f} tok/s without overlap, "
          f"{1 / max(gpu_t, cpu_t):.2f} tok/s with the CPU fully hidden behind the GPU or "
          f"vice versa (max of the two)")  # fmt: skip
    return 0


def time_projections_linear(ws, rows: int, reps: int = 5) -> float:
    """One layer's projections (fused q_a + kv_a, q_b, o_proj) through the model's linear()."""
    x = {k: torch.randn(rows, kk).bfloat16() for k, (_, kk) in PROJ.items()}

    def run():
        for w in ws:
            for k in PROJ:
                linear(x[k], w[k])

    return timeit(run, reps) / len(ws)
