"""`cpu_e2e.py --full-k2`: the full Kimi-K2 on this CPU, extrapolated from measured parts.

Each part of one layer is timed with the model's own CPU code path on K2-sized weights (dummy
values), over enough distinct copies to miss the caches, then multiplied by its count in the
full model (61 layers: 1 dense + 60 MoE). Nothing here runs the whole model: the figures are
extrapolations and are printed as such.

--timing quiet (default): each decode part as the engine runs it at batch 1: its weights and
inputs built first, then torch's OpenMP team left to go idle (cpu_quiet.OmpTeam.quiesce: its
threads' CPU time is read, not assumed), then the median of several calls; the CPU the team
used during them is printed per part (0.0: the part ran beside an idle team). The read
bandwidth is probed again before each part; the limit is the max of the probes (min / median
/ max printed). --timing legacy: the previous method (the best of 3 right after building the
weights, so torch's team may still spin beside the kernel's threads; one probe).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from cpu_attn import (
    KVB_BYTES,
    PROJ,
    PROJ_BYTES,
    SCALE,
    backend,
    decode_path,
    forced_flash,
    mla_case,
    mla_flops,
    proj_weights,
    time_mla,
    timeit,
)
from cpu_moe_shared import experts_ways, report
from cpu_quiet import BwProbe, OmpTeam

from k2serve import envs
from k2serve.kernels.cpu import cpu_head_gemv
from k2serve.moe.cpu_shared import use_kernel
from k2serve.quant.linear import linear

LAYERS, DENSE, MOE = 61, 1, 60
D, I_MOE, I_DENSE, VOCAB, TOPK, NH = 7168, 2048, 18432, 163840, 8, 64
SHARED_BYTES = 3 * D * I_MOE * 2
DENSE_BYTES = 3 * D * I_DENSE * 2
LM_BYTES = VOCAB * D * 2
N_EXPERTS = 384
ROUTER_BYTES = N_EXPERTS * D * 2  # the gate's bf16 weight
KV_BYTES_PER_TOKEN = (512 + 64) * 2  # bf16 latent + roped key, per layer


def mlp_weights(inter: int, copies: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1)

    def mk(n, k):  # distinct memory, values repeated 8 times (fast to make)
        return (torch.randn(n // 8, k, generator=g) * k**-0.5).bfloat16().repeat(8, 1)

    return [(mk(inter, D), mk(inter, D), mk(D, inter)) for _ in range(copies)]


def time_mlp(ws, rows: int, fn, reps: int = 3, timer=None) -> float:
    x, h = torch.randn(rows, D).bfloat16(), torch.randn(rows, ws[0][0].shape[0]).bfloat16()

    def run():
        for g, u, d in ws:
            fn(x, g), fn(x, u), fn(h, d)

    return (timer or timeit)(run, reps) / len(ws)


def time_mlp_fused(ws, timer) -> float:
    """One row through an MLP as the model's CPU path runs it now (kernel policy
    fused_projections): gate and up as one GEMV over their rows' concatenation, then down."""
    x, n = torch.randn(1, D).bfloat16(), ws[0][0].shape[0]
    fused = [(torch.cat([g, u]), d) for g, u, d in ws]  # [2 I, D], [D, I]

    def run():
        for gu, d in fused:
            a, b = linear(x, gu).split([n, n], dim=-1)
            linear(F.silu(a) * b, d)

    return timer(run, 7) / len(ws)


def shared_variants(ws, timer_of) -> dict[str, float]:
    """One row through the shared expert (SiLU(x Wg) * (x Wu)) Wd three ways: 3 linear() GEMVs
    (the model's CPU path before fused_projections was on for the CPU), gate and up as one GEMV
    (now), and one call of the CPU experts kernel (one bf16 expert, always selected, weight 1);
    the last two checked against the first."""
    from torch import nn

    from k2serve.moe.cpu_experts import CpuExpertBackend
    from k2serve.quant.linear import UnquantizedLinear

    x = torch.randn(1, D).bfloat16()
    ids, wt = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    kern = []
    for g, u, d in ws:
        m = nn.Module()
        for name, w in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
            lin = UnquantizedLinear(w.shape[1], w.shape[0], torch.bfloat16)
            lin.weight = nn.Parameter(w, requires_grad=False)
            setattr(m, name, lin)
        kern.append(CpuExpertBackend([m], [0], 1, kernel="native"))

    def three():
        for g, u, d in ws:
            linear(F.silu(linear(x, g)) * linear(x, u), d)

    def one():
        for be in kern:
            be(x, ids, wt)

    g, u, d = ws[0]
    ref = linear(F.silu(linear(x, g)) * linear(x, u), d).float()
    a, b = linear(x, torch.cat([g, u])).split([I_MOE, I_MOE], dim=-1)
    for name, out in (("fused", linear(F.silu(a) * b, d)), ("kernel", kern[0](x, ids, wt))):
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 3e-2, f"shared expert {name}: rel err {err:.2e}"
    return {
        "3 GEMVs": timer_of("shared expert (3 GEMVs)")(three, 7) / len(ws),
        "fused gate_up": time_mlp_fused(ws, timer_of("shared expert")),
        "experts kernel": timer_of("shared expert (kernel)")(one, 7) / len(ws),
    }


def time_absorb_kernel(copies: int, rows: int, timer=None) -> float:
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

    return (timer or timeit)(run, 3) / copies


def time_router(copies: int, timer, kernel_topk: bool = True) -> float:
    """One MoE layer's router (gate: float32 logits, grouped top-8) at decode as the model runs
    it (model.router.TopkRouter, K2's 384 experts), over `copies` distinct weights; with
    kernel_topk False, the top-k in torch ops after the kernel's GEMV (TopkRouter before its
    one-call CPU path, kernels/cpu/router.py)."""
    from types import SimpleNamespace

    from k2serve.model.router import TopkRouter

    cfg = SimpleNamespace(num_experts_per_tok=TOPK, n_routed_experts=N_EXPERTS, n_group=1,
                          topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                          hidden_size=D)  # fmt: skip
    gates = []
    for _ in range(copies):
        gate = TopkRouter(cfg, torch.bfloat16)
        gate.weight.data.normal_(0, D**-0.5)
        gate.cpu_kernel_topk = kernel_topk
        gates.append(gate)
    x = torch.randn(1, D).bfloat16()

    def run():
        for gate in gates:
            gate(x)

    return timer(run, 7) / copies


def router_then_experts(n_experts: int, timer) -> dict[str, float]:
    """One MoE layer's router + routed experts, quiet timing, with the router as the engine
    runs it at decode (one CPU kernel call: the logits GEMV and the top-k), with the kernel's
    GEMV and the top-k in torch ops (wave 7), and with torch's float32 GEMV over a float32
    weight copy (wave 6: it ran on torch's OpenMP team, whose threads then spin beside the
    experts call)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from k2serve.kernels.router_torch import grouped_topk_torch
    from k2serve.model.router import TopkRouter

    cfg = SimpleNamespace(num_experts_per_tok=TOPK, n_routed_experts=N_EXPERTS, n_group=1,
                          topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
                          hidden_size=D)  # fmt: skip
    gate = TopkRouter(cfg, torch.bfloat16)
    gate.weight.data.normal_(0, D**-0.5)
    w32, x = gate.weight.float(), torch.randn(1, D).bfloat16()
    bias = gate.e_score_correction_bias

    def torch_f32():
        grouped_topk_torch(F.linear(x.float(), w32), bias, TOPK, 1, 1, True, 2.827)

    def torch_topk():
        gate.cpu_kernel_topk = False
        gate(x)
        gate.cpu_kernel_topk = True

    ways = {"router in one kernel call (now)": lambda: gate(x),
            "router GEMV on the kernel + torch top-k (wave 7)": torch_topk,
            "router on torch f32 (wave 6)": torch_f32}  # fmt: skip
    return {k: time_routed(n_experts, 1, 15, timer(f"router+experts {k}"), pre=f)[0]
            for k, f in ways.items()}  # fmt: skip


def time_mla_quiet(ctx: int, mode: str, copies: int, timer) -> float:
    """cpu_attn.time_mla's decode (1 query after ctx, shuffled pages, `copies` distinct caches),
    the caches built before the timer's quiet calls."""
    ql, qp, kv, md = mla_case(ctx, 1, shuffle=True)
    kvs = [kv] + [kv.clone() for _ in range(copies - 1)]
    be = backend(mode)

    def layers():
        for k in kvs:
            be.forward(ql, qp, k, md, SCALE)

    run = lambda: timer(layers, 3) / copies  # noqa: E731
    return forced_flash(run) if mode == "flash" else run()


def time_routed(n_experts: int, tokens: int, iters: int, timer=None, pre=None) -> tuple[float, int]:
    """(seconds per call, bytes per expert) for one MoE layer's routed experts at `tokens`;
    `pre` (quiet timing): run before each call, inside the timed span (the router)."""
    from cpu_moe import Expert, routing

    from k2serve.moe.cpu_experts import CpuExpertBackend

    g = torch.Generator().manual_seed(0)
    cache: dict = {}
    experts = [Expert("int4", D, I_MOE, g, cache, e) for e in range(n_experts)]
    per = sum(t.numel() * t.element_size() for t in experts[0].parameters())
    be = CpuExpertBackend(experts, range(n_experts), n_experts, kernel="native")
    if timer is not None:  # inputs made first (iters >= 7), then timer(): fresh routing per call
        steps = []
        for _ in range(iters + 1):
            ids, w = routing(tokens, n_experts, TOPK, g)
            steps.append((torch.randn(tokens, D, generator=g).bfloat16(), ids, w))
        it = iter(steps)  # one for the timer's warm-up

        def call():
            if pre is not None:
                pre()
            be(*next(it))

        return timer(call, iters), per
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
    quiet = args.timing == "quiet"
    team = OmpTeam() if quiet else None
    probe = BwProbe(args.bw_gib) if quiet else None
    spins: dict[str, float] = {}

    def timer(name: str):
        """The part's timer: quiet (probe, quiesce, median; torch team's CPU kept) or legacy."""
        if not quiet:
            return timeit

        def t(fn, reps):
            probe.probe()
            sec, spins[name] = team.timed(fn, max(reps, 7))
            return sec

        return t

    how_t = (f"quiet: weights built first, torch's OpenMP team ({len(team.tids)} threads) idle "
             f"before each part (checked), median of >= 7 calls" if quiet else
             "legacy: best of 3 right after building the weights")  # fmt: skip
    print(f"# full K2 EXTRAPOLATED from parts measured on this CPU ({torch.get_num_threads()} "
          f"threads; read bandwidth {bw:.1f} GB/s in the first probe); decode context "
          f"{args.context}; timing {how_t}")  # fmt: skip
    pw = proj_weights(3)
    t_proj = time_projections_linear(pw, 1, timer=timer("attention projections"))
    t_proj_p = 0.0 if args.decode_only else time_projections_linear(pw[:1], P, reps=1) / P
    del pw
    t_abs = time_absorb_kernel(8, 1, timer=timer("absorbed kv_b (W_UK, W_UV)"))

    # the backend's default bf16 decode (or --mla flash / ref), shuffled pages, over 16 distinct
    # caches (150 MB at 8K: as 61 layers' caches, they miss the CPU's last-level cache)
    def mla_at(ctx: int) -> float:
        if quiet:
            return time_mla_quiet(ctx, args.mla, 16, timer(f"MLA over {ctx} cached tokens"))
        return time_mla(ctx, 1, flash=args.mla != "ref", mode=args.mla, copies=16)

    mla_name = f"MLA over {args.context} cached tokens"
    t_mla = mla_at(args.context)
    # the same decode at other contexts (--also-context): MLA is compute-bound on a CPU (~1.1
    # GFLOP a layer at 8K), so a short context's figure is printed beside the long one's
    t_mla_at = {c: mla_at(c) for c in args.also_context if c != args.context}
    how = {"auto": f"as the engine runs it here: {decode_path()}", "flash": "torch's flash kernel",
           "ref": "the float32 einsums"}[args.mla]  # fmt: skip
    print(f"# MLA decode: {how} (shuffled pages, 16 distinct caches)")
    sw = mlp_weights(I_MOE, 4)
    # quiet: as the model runs it now (moe.cpu_shared's rule: one experts-kernel call from
    # KERNEL_MIN_THREADS pool threads, else gate + up fused); legacy: the previous 3 GEMVs
    shv = shared_variants(sw, timer) if quiet else {}
    sh_way = "experts kernel" if use_kernel() else "fused gate_up"
    t_sh = shv[sh_way] if quiet else time_mlp(sw, 1, linear)
    if quiet:
        print(f"# shared expert as the engine runs it here: {sh_way}")
    # routed + shared experts in one kernel call (the engine's way where the shared expert is
    # on the kernel, K2SERVE_CPU_FUSED_SHARED) and in two, both timed here (cpu_moe_shared)
    ways = experts_ways(args.experts, sw, TOPK, timer) if quiet else {}
    one_call = bool(ways) and use_kernel() and envs.cpu_fused_shared()
    if quiet:
        print(f"# routed + shared experts as the engine runs them here: "
              f"{'one call' if one_call else 'two parts'}")  # fmt: skip
    t_sh_p = 0.0 if args.decode_only else time_mlp(sw[:1], P, F.linear, reps=1) / P
    del sw
    dw = mlp_weights(I_DENSE, 1)
    t_dense = time_mlp_fused(dw, timer("dense layer MLP")) if quiet else time_mlp(dw, 1, linear)
    pd = min(P, 512)
    t_dense_p = 0.0 if args.decode_only else time_mlp(dw, pd, F.linear, reps=1) / pd
    del dw
    # distinct memory, repeated values (fast to make; the caches see 2.35 GB either way)
    lm = (torch.randn(VOCAB // 40, D) * D**-0.5).bfloat16().repeat(40, 1)
    x1 = torch.randn(1, D).bfloat16()
    t_lm = timer("lm_head")(lambda: linear(x1, lm), 3)
    lm = x1 = None  # free the 2.35 GB
    t_gate = time_router(16, timer("router (gate, top-8)"), args.router_topk == "kernel")
    how = {"kernel": "one CPU kernel call (GEMV + top-k)",
           "torch": "the kernel's GEMV + the top-k in torch ops (--router-topk torch)"}  # fmt: skip
    print(f"# router timed as {how[args.router_topk]}")
    if quiet:  # the engine's order: the router, then the experts (a torch op before: spin)
        got = router_then_experts(args.experts, timer)
        print("# MoE layer in the engine's order (router, then the routed experts), ms/layer "
              "(torch team's CPU during the calls): " + ", ".join(
                  f"{k} {v * 1e3:.3f} ({spins.get(f'router+experts {k}', 0.0):.1f} ms)"
                  for k, v in got.items()))  # fmt: skip
    rt_timer = timer("routed experts (8 INT4)") if quiet else None
    t_rt, per_exp = time_routed(args.experts, 1, 15 if quiet else 8, rt_timer)
    # a prompt chunk: 43 pairs per expert as a 2K-token step over 384 experts
    pre_tokens = max(16, round(P * args.experts / 384))
    t_rt_p = 0.0 if args.decode_only else time_routed(args.experts, pre_tokens, 2)[0] / pre_tokens
    # attention's quadratic part: seconds per (query, key) pair, measured at 8K
    nq = 128
    t_q = 0.0 if args.decode_only else time_mla(8192 - nq, nq, reps=1)
    per_key = t_q / (mla_flops(8192 - nq, nq) / (2 * NH * (512 + 64 + 512)))
    if quiet:
        probe.runs.append(bw)
        bw = max(probe.runs)
        print(f"# {probe.summary()}")
    t_one, t_two = (ways["one call"][0], ways["two calls"][0]) if ways else (0.0, 0.0)
    parts = [  # name, count, bytes per token, seconds per token
        ("attention projections", LAYERS, PROJ_BYTES, t_proj),
        ("absorbed kv_b (W_UK, W_UV)", LAYERS, KVB_BYTES, t_abs),
        (mla_name, LAYERS, (args.context + 1) * KV_BYTES_PER_TOKEN, t_mla),
        ("shared expert", MOE, SHARED_BYTES, t_sh),
        ("routed experts (8 INT4)", MOE, TOPK * per_exp, t_rt),
        ("routed + shared experts (1 call)", MOE, ways.get("bytes", 0), t_one),
        ("router (gate, top-8)", MOE, ROUTER_BYTES, t_gate),
        ("dense layer MLP", DENSE, DENSE_BYTES, t_dense),
        ("lm_head", 1, LM_BYTES, t_lm),
    ]  # fmt: skip
    # the engine's rows only: the one call, or the two parts
    drop = (
        ("shared expert", "routed experts (8 INT4)")
        if one_call
        else ("routed + shared experts (1 call)",)
    )
    parts = [p for p in parts if p[0] not in drop]
    if ways:
        report(ways, bw, spins)
    for (k, t), sp in zip(shv.items(), ("3 GEMVs", "", "kernel"), strict=False):  # quiet only
        gbs = SHARED_BYTES / t / 1e9
        spin = spins.get(f"shared expert ({sp})" if sp else "shared expert", 0.0)
        print(f"# shared expert as {k:<15}: {t * 1e3:.3f} ms/layer, {gbs:.1f} GB/s = "
              f"{gbs / bw:.0%} of BW (median of 7; torch team's CPU during them "
              f"{spin:.1f} ms)")  # fmt: skip
    tot_b = sum(c * b for _, c, b, _ in parts)
    tot_t = sum(c * t for _, c, _, t in parts)
    print(f"{'part (decode, 1 token)':<34} {'count':>5} {'MB/token':>9} {'of bytes':>8} "
          f"{'ms/token':>9} {'of time':>8} {'GB/s':>6} {'of BW':>6} {'omp ms':>6}")  # fmt: skip
    for name, c, b, t in parts:
        gbs = b / t / 1e9
        spin = f"{spins[name]:>6.1f}" if name in spins else f"{'-':>6}"
        print(f"{name:<34} {c:>5} {c * b / 1e6:>9.0f} {c * b / tot_b:>8.0%} {c * t * 1e3:>9.1f} "
              f"{c * t / tot_t:>8.0%} {gbs:>6.1f} {gbs / bw:>6.0%} {spin}")  # fmt: skip
    if quiet:
        print(
            "# omp ms: CPU time torch's OpenMP threads used during the part's timed calls "
            "(0.0: beside an idle team, as the engine's batch-1 decode)"
        )
    for ctx, tm in t_mla_at.items():  # the other contexts' MLA (not in the totals below)
        b = (ctx + 1) * KV_BYTES_PER_TOKEN
        name = f"(MLA over {ctx} cached tokens)"
        spin = f"{spins[name[1:-1]]:>6.1f}" if name[1:-1] in spins else f"{'-':>6}"
        print(f"{name:<34} {LAYERS:>5} {LAYERS * b / 1e6:>9.0f} {'':>8} {LAYERS * tm * 1e3:>9.1f} "
              f"{'':>8} {b / tm / 1e9:>6.1f} {b / tm / 1e9 / bw:>6.0%} {spin}")  # fmt: skip
    mla_i = [p[0] for p in parts].index(mla_name)
    for ctx, tm in {args.context: t_mla, **t_mla_at}.items():
        b_ctx = tot_b + LAYERS * (ctx - args.context) * KV_BYTES_PER_TOKEN
        t_ctx = tot_t + LAYERS * (tm - parts[mla_i][3])
        gbs = b_ctx / t_ctx / 1e9
        print(f"EXTRAPOLATED full K2 decode, batch 1, context {ctx}: {t_ctx * 1e3:.0f} "
              f"ms/token = {1 / t_ctx:.2f} tok/s; {b_ctx / 1e9:.2f} GB/token at {gbs:.1f} GB/s "
              f"= {gbs / bw:.0%} of the read bandwidth")  # fmt: skip
    if ways:  # the other way's decode, from the paired timings of this run
        other = "two calls (before)" if one_call else "one call"
        t_alt = tot_t + MOE * ((t_two - t_one) if one_call else (t_one - t_sh - t_rt))
        gbs = tot_b / t_alt / 1e9
        print(
            f"# the same decode (context {args.context}) with the routed + shared experts as "
            f"{other}: {t_alt * 1e3:.0f} ms/token = {gbs / bw:.0%} of the read bandwidth"
        )
    if not args.decode_only:
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


def time_projections_linear(ws, rows: int, reps: int = 5, timer=None) -> float:
    """One layer's projections (fused q_a + kv_a, q_b, o_proj) through the model's linear()."""
    x = {k: torch.randn(rows, kk).bfloat16() for k, (_, kk) in PROJ.items()}

    def run():
        for w in ws:
            for k in PROJ:
                linear(x[k], w[k])

    return (timer or timeit)(run, reps) / len(ws)
