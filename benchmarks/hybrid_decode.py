# ruff: noqa: E501, B023, F821
"""The decode part of benchmarks/hybrid_moe.py (see its docstring, "decode"): the all-GPU
limit and its split (fixed part + per MoE layer), the CPU experts alone, the hybrid graph step
in both ways of waiting, its in-step timeline (benchmarks/hybrid_timeline.py) and the full K2
extrapolated from it."""

from __future__ import annotations

import gc
import statistics
import time

import torch
from hybrid_common import (
    FAILS,
    ROWS,
    WAITS,
    ZERO_COPY_AB,
    ZeroExperts,
    check,
    decode_inputs,
    graph_runner,
    hybrid_backends,
    kv_for,
    log,
    set_stub,
    slow_cpu,
    soft,
    wall_ms,
)


def fixed_part_ms(ref, kv_r, ppseq, B, ids, pos, md, iters) -> tuple[float, int]:
    """The all-GPU graph step with its MoE layers removed (the embedding, the dense layers, the
    final norm, the step's input copies, launch and sync): the part of the limit that does not
    grow with the MoE layers. -> (ms, dense layers)."""
    from k2serve.model.deepseek_v3 import MoE

    layers = ref.model.layers
    keep = [i for i, ly in enumerate(layers) if not isinstance(ly.mlp, MoE)]
    ref.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    try:
        r = graph_runner(ref, [kv_r[i] for i in keep], ppseq, B)
        return wall_ms(lambda: r.run(ids, pos, md), iters=iters), len(keep)
    finally:
        ref.model.layers = layers


LEAD_US = 250  # a step's prewake comes ~0.28 ms before its CPU part (the GPU chain between)
NAN = float("nan")


def cpu_calls_ms(calls, iters, prewake_us=None) -> float:
    """ms per call of `calls` = [(CpuExpertBackend, x, ids, w)], run in turn on this thread:
    back to back (prewake_us None: the pool's threads still spinning from the call before),
    or each as a step runs it: the pool prewoken, `prewake_us` of waiting (the step's GPU
    chain), then the call, timed alone (median)."""
    if prewake_us is None:
        return wall_ms(lambda: [be(x, i, w) for be, x, i, w in calls], iters=iters,
                       warmup=1) / len(calls)  # fmt: skip
    ts = []
    for it in range(iters + 1):
        for be, x, i, w in calls:
            be.prewake()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < prewake_us * 1e-6:
                pass
            t1 = time.perf_counter()
            be(x, i, w)
            if it:  # the first round warms up
                ts.append((time.perf_counter() - t1) * 1e3)
    return statistics.median(ts)


def cold_calls(hyb, B, sets=4) -> list:
    """One layer's CPU experts on `sets` other expert sets in turn (disjoint while the layer
    has sets x B x k of them), so no call finds in the L3 what the previous one read (a K2
    layer's 8 INT4 experts are ~198 MB; the H100 host's L3 ~300 MB)."""
    c = hyb.config
    be = hybrid_backends(hyb)[0].cpu_backend
    E, k = c.n_routed_experts, c.num_experts_per_tok
    g = torch.Generator().manual_seed(B)
    if sets * B * k <= E:
        perm = torch.randperm(E, generator=g)
        ids = [perm[j * B * k : (j + 1) * B * k].view(B, k) for j in range(sets)]
    else:
        ids = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)])
               for _ in range(sets)]  # fmt: skip
    x = torch.randn(B, c.hidden_size, generator=g).to(torch.bfloat16)
    w = torch.rand(B, k, generator=g)
    return [(be, x, i, w) for i in ids]


def own_calls(hyb, B) -> list | None:
    """Each MoE layer's CPU experts on the last real step's own inputs (its pinned staging
    buffers), layer after layer as the step runs them (None without staging buffers: a CPU
    device)."""
    bes = hybrid_backends(hyb)
    if any(be._buffers is None for be in bes):
        return None
    return [(be.cpu_backend, *(be._buffers[n][:B].clone() for n in ("x", "ids", "w")))
            for be in bes]  # fmt: skip


def ready_word_rows(r_h, hyb, ids, pos, md, args, name, t_real, n_tr) -> None:
    """The same captured runner with the staged inputs marked by a word the GPU writes into
    pinned memory (kernels.stream_wait.HostReadyWord) instead of an event: the output against
    the event's, the real step, its timeline."""
    from hybrid_common import check
    from hybrid_timeline import describe, timeline, traced_steps

    from k2serve.kernels.stream_wait import HostReadyWord

    bes = hybrid_backends(hyb)
    want = r_h.run(ids, pos, md).clone()
    for be in bes:
        be.ready_word = HostReadyWord()
    try:
        check(f"{name} with ready words", r_h.run(ids, pos, md).clone(), want, 1e-3)
        t_rw = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters, warmup=2)
        tl = timeline(traced_steps(r_h, bes, lambda: r_h.run(ids, pos, md),
                                   torch.cuda.synchronize, n_tr))  # fmt: skip
    finally:
        for be in bes:
            be.ready_word = None
    ROWS.append(("decode", f"{name}: real step with ready words (GPU-written host word, "
                 "not an event)", f"{t_rw:.3f} ms = {t_rw / t_real:.3f} x with events "
                 f"({t_real:.3f}); {describe(tl)}"))  # fmt: skip
    log(f"  {name}: ready words: real step {t_rw:.3f} ms (events {t_real:.3f}); {describe(tl)}")


AB_ROUNDS = 9  # zero-copy A/B: alternating rounds, median of each side's round medians


def ab_ms(fa, fb, iters: int) -> tuple[float, float]:
    """ms of fa and of fb (medians), timed in alternating rounds, so that a drift of the host
    or the GPU clocks during the A/B hits both sides."""
    ta, tb = [], []
    for _ in range(AB_ROUNDS):
        ta.append(wall_ms(fa, iters=iters))
        tb.append(wall_ms(fb, iters=iters))
    return statistics.median(ta), statistics.median(tb)


def zero_copy_ab(r_on, hyb, kv_h, ppseq, B, ids, pos, md, way, t_noexp, fused=False) -> None:
    """The way of waiting `way` = (name, device wait, one graph, spin) captured again with the
    memcpys (zero_copy=False) beside `r_on` (zero-copy: one staging kernel and one result
    kernel on host-mapped memory, kernels.zero_copy), or with `fused`, zero-copy without the
    fused waits (fused_wait=False; `r_on` has them: the word / the wait inside those
    kernels): their outputs against each other, then the GPU part (CPU experts stubbed) and
    the real step of both in alternating rounds."""
    mode, dw, one_g, spin = way
    tag = f"B={B}"
    what, off = ("FUSED-WAIT", "unfused") if fused else ("ZERO-COPY", "memcpys")
    r_off = graph_runner(hyb, kv_h, ppseq, B, device_wait=dw, one_graph=one_g, spin_wait=spin,
                         zero_copy=True if fused else False,
                         fused_wait=False if fused else None)  # fmt: skip
    if not fused and any(be.zero_copy for be in hybrid_backends(hyb)):
        FAILS.append(f"decode {tag} {mode}: the memcpy runner staged zero-copy")
    if fused and (r_off.fused_waits or not r_on.fused_waits):
        FAILS.append(f"decode {tag} {mode}: fused A/B without fused waits on one side only")
    run_on, run_off = (lambda: r_on.run(ids, pos, md)), (lambda: r_off.run(ids, pos, md))
    check(f"decode {tag} {mode}: {what.lower()} vs {off}", run_on().clone(), run_off().clone(),
          1e-3)  # fmt: skip
    set_stub(hyb, True)
    try:
        g_on, g_off = ab_ms(run_on, run_off, iters=40)
    finally:
        set_stub(hyb, False)
    s_on, s_off = ab_ms(run_on, run_off, iters=20)
    ROWS.append(("decode", f"{tag} {mode}: {what} A/B ({AB_ROUNDS} alternating rounds): "
                 f"GPU part / real step, on vs {off}",
                 f"GPU part {g_on:.3f} vs {g_off:.3f} ms = {g_on / t_noexp:.3f} vs "
                 f"{g_off / t_noexp:.3f} x limit {t_noexp:.3f} "
                 f"{'MET' if g_on <= t_noexp else 'MISSED'} (<= 1.0) ({g_on - g_off:+.3f} ms); "
                 f"real step {s_on:.3f} vs {s_off:.3f} ms ({s_on - s_off:+.3f})"))  # fmt: skip
    log(f"  {tag} {mode}: {what.lower()} A/B: GPU part {g_on:.3f} vs {off} {g_off:.3f} ms "
        f"({g_on / t_noexp:.3f} vs {g_off / t_noexp:.3f} x limit), real step {s_on:.3f} vs "
        f"{s_off:.3f} ms")  # fmt: skip
    del r_off


def part_decode(ref, hyb, args):
    from hybrid_timeline import (
        K2_MOE_LAYERS,
        describe,
        extrapolate,
        extrapolate_c,
        timeline,
        traced_steps,
    )

    log("== decode (context 1024)")
    n_moe = len(hybrid_backends(hyb))
    N = K2_MOE_LAYERS
    for B in args.batches:
        tag = f"B={B}"
        ids, pos, md, pages, ppseq = decode_inputs(B, 1024)
        kv_r, kv_h = kv_for(ref, pages * 64), kv_for(hyb, pages * 64)
        r_all = graph_runner(ref, kv_r, ppseq, B)
        t_all = wall_ms(lambda: r_all.run(ids, pos, md), iters=args.iters)
        want = r_all.run(ids, pos, md).clone()  # each way's real step is checked against it
        del r_all
        saved = {}
        for ly in ref.model.layers:
            if hasattr(ly.mlp, "expert_backend"):
                saved[ly.layer_idx] = ly.mlp.expert_backend
                ly.mlp.expert_backend = ZeroExperts()
        r_noexp = graph_runner(ref, kv_r, ppseq, B)
        t_noexp = wall_ms(lambda: r_noexp.run(ids, pos, md), iters=args.iters)
        del r_noexp
        for i, be in saved.items():
            ref.model.layers[i].mlp.expert_backend = be
        # the lm_head is not in these steps (the runners return hidden states): timed apart,
        # for a tokens-per-second figure
        h0 = torch.randn(B, ref.config.hidden_size, dtype=torch.bfloat16, device="cuda")
        t_head = wall_ms(lambda: ref.compute_logits(h0), iters=args.iters)
        ROWS.append(("decode", f"{tag} lm_head + float32 logits (eager, not in the steps)",
                     f"{t_head:.3f} ms ({ref.config.vocab_size} x {ref.config.hidden_size})"))  # fmt: skip
        ROWS.append(("decode", f"{tag} all-GPU graph step", f"{t_all:.3f} ms"))
        ROWS.append(("decode", f"{tag} all-GPU minus expert GEMVs (limit)", f"{t_noexp:.3f} ms"))
        # the limit split: its fixed part (the step without MoE layers) and per MoE layer
        fx = soft(f"decode {tag} fixed part", lambda: fixed_part_ms(ref, kv_r, ppseq, B, ids,
                                                                    pos, md, args.iters))  # fmt: skip
        t_fixed, n_dense = fx if fx else (float("nan"), 0)
        per_moe = (t_noexp - t_fixed) / n_moe
        ROWS.append(("decode", f"{tag} limit's fixed part",
                     f"{t_fixed:.3f} ms: graph step of the all-GPU model with its MoE layers "
                     f"removed (embedding, {n_dense} dense layer(s), final norm, the step's "
                     "input copies, launch, sync; no lm_head: the runners return hidden "
                     "states)"))  # fmt: skip
        ROWS.append(("decode", f"{tag} limit per MoE layer",
                     f"{per_moe:.3f} ms = (limit {t_noexp:.3f} - fixed {t_fixed:.3f}) / "
                     f"{n_moe} (attention, router, shared expert; no expert GEMVs)"))  # fmt: skip
        # the CPU experts alone, as a step runs them (on the calling thread), per MoE layer
        # the CPU experts alone, on the calling thread as a step runs them, ms per layer: back
        # to back, and prewoken LEAD_US before each call as in a step
        be = hybrid_backends(hyb)[0]
        x = torch.randn(B, hyb.config.hidden_size, dtype=torch.bfloat16)
        tid = torch.randint(0, hyb.config.n_routed_experts, (B, hyb.config.num_experts_per_tok))
        tw = torch.rand(B, hyb.config.num_experts_per_tok)
        same, it = [(be.cpu_backend, x, tid, tw)], max(5, args.iters)
        t_cpu = cpu_calls_ms(same, it)
        t_cpu_pw = cpu_calls_ms(same, it, LEAD_US)
        cold = cold_calls(hyb, B)
        t_cold = soft(f"decode {tag} CPU cold", lambda: (cpu_calls_ms(cold, it),
                                                         cpu_calls_ms(cold, it, LEAD_US)))  # fmt: skip
        t_cold, t_cold_pw = t_cold if t_cold else (NAN, NAN)
        cpu_part = n_moe * t_cpu
        ROWS.append(("decode", f"{tag} CPU experts alone, ms per layer (back to back / "
                     f"prewoken {LEAD_US} us before each call, as in a step)",
                     f"the same experts each call {t_cpu:.3f} / {t_cpu_pw:.3f} (their 198 MB "
                     f"can stay in the L3; {n_moe} x the first = the previous 'CPU part' "
                     f"{cpu_part:.3f}); cold (4 other expert sets in turn) {t_cold:.3f} / "
                     f"{t_cold_pw:.3f}"))  # fmt: skip
        set_stub(hyb, True)
        t_eager_part = wall_ms(lambda: hyb(ids, pos, md, kv_h), iters=args.iters)
        set_stub(hyb, False)
        ROWS.append(("decode", f"{tag} hybrid GPU part, eager",
                     f"{t_eager_part:.3f} ms = {t_eager_part / t_noexp:.2f} x limit"))  # fmt: skip
        log(f"  {tag}: all-GPU {t_all:.3f} ms, minus expert GEMVs {t_noexp:.3f} ms (fixed "
            f"{t_fixed:.3f} + {n_moe} x {per_moe:.3f}), CPU experts alone per layer {t_cpu:.3f} "
            f"/ prewoken {t_cpu_pw:.3f}, cold {t_cold:.3f} / {t_cold_pw:.3f}, eager GPU part "
            f"{t_eager_part:.3f} ms")  # fmt: skip
        outs: dict = {}
        for mode, dw, one_g, spin in WAITS:

            def one():
                n_tr = max(10, 2 * args.iters)
                set_stub(hyb, True)
                try:
                    r_h = graph_runner(hyb, kv_h, ppseq, B, device_wait=dw, one_graph=one_g,
                                       spin_wait=spin)  # fmt: skip
                    zc_on = all(be.zero_copy for be in hybrid_backends(hyb))
                    t_gpu = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters)
                    # the same timeline with the CPU experts answered at once: the GPU chain
                    # and the host's latencies alone (a period = its serial part + ~0)
                    tl0 = timeline(traced_steps(r_h, hybrid_backends(hyb), lambda: r_h.run(
                        ids, pos, md), torch.cuda.synchronize, n_tr))  # fmt: skip
                finally:
                    set_stub(hyb, False)
                t_real = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters, warmup=2)
                got = r_h.run(ids, pos, md).clone()
                check(f"decode B={B} context 1024, {mode}", got, want, 2e-2)
                first = outs.setdefault("first", (mode, got))  # the ways against each other
                if first[0] != mode:
                    check(f"decode B={B} context 1024, {mode} vs {first[0]}", got, first[1], 1e-3)
                with slow_cpu(hyb, 0.005):  # each CPU part 5 ms late: no way may read early
                    got = [r_h.run(ids, pos, md).clone() for _ in range(2)][-1]
                check(f"decode B={B} context 1024, {mode}, CPU parts 5 ms late", got, want, 2e-2)
                # the CPU experts the step runs, alone: its own inputs, layer after layer
                oc = own_calls(hyb, B)
                t_own, t_own_pw = (cpu_calls_ms(oc, it), cpu_calls_ms(oc, it, LEAD_US)) if oc \
                    else (NAN, NAN)  # fmt: skip
                pieces = max(r_h.num_pieces.values())
                if dw and not r_h.waits_in_graph:
                    FAILS.append(f"decode B={B} {mode}: the probe failed, host wait used")
                if one_g and not r_h.jobs:
                    FAILS.append(f"decode B={B} {mode}: no ready words, pieces used")
                if spin and not all(getattr(sig, "spin", False) for _, sig in r_h._waiting):
                    FAILS.append(f"decode B={B} {mode}: no spin-kernel waits")
                gratio = t_gpu / t_noexp
                how = ("zero-copy" if zc_on else "memcpys") + (", fused waits" if
                                                               r_h.fused_waits else "")  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: GPU part, {pieces} graph pieces, {how}",
                             f"{t_gpu:.3f} ms = {gratio:.2f} x limit "
                             f"{'MET' if gratio <= 1 else 'MISSED'} (<= 1.0)"))  # fmt: skip
                tl = timeline(traced_steps(r_h, hybrid_backends(hyb), lambda: r_h.run(ids, pos, md),
                                           torch.cuda.synchronize, n_tr))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: timeline, CPU experts stubbed (host "
                             "timestamps, ms)", describe(tl0)))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: timeline of the real step (host "
                             "timestamps, ms)", describe(tl)))  # fmt: skip
                log(f"  {tag} {mode}: stubbed: {describe(tl0)}")
                log(f"  {tag} {mode}: real: {describe(tl)}")
                # the strictest honest CPU part: the fastest measurement of the same CPU work,
                # the step's layers' experts on its inputs (inside the step, or alone back to
                # back or prewoken); not the same experts call after call, whose bytes the L3
                # can keep (a step alternates its layers: 2 x 198 MB)
                warm = {"inside the step": tl.cpu, "alone, the step's inputs": t_own,
                        "alone, the step's inputs, prewoken": t_own_pw}  # fmt: skip
                c_name, c = min(((k, v) for k, v in warm.items() if v == v), key=lambda kv: kv[1])
                ratio = t_real / max(t_gpu, n_moe * c)
                ROWS.append(("decode", f"{tag} {mode}: hybrid step, CPU experts real",
                             f"{t_real:.3f} ms = {ratio:.2f} x max(GPU part, CPU part {n_moe} x "
                             f"{c:.3f}) {'MET' if ratio <= 1.1 else 'MISSED'} (<= 1.1, this "
                             f"{n_moe}-MoE-layer slice, its fixed GPU part in series); CPU "
                             f"experts, ms per layer: inside the step {tl.cpu:.3f}, alone its "
                             f"inputs {t_own:.3f} / prewoken {t_own_pw:.3f}"))  # fmt: skip
                log(f"  {tag} {mode}: GPU part {t_gpu:.3f} ms ({gratio:.2f} x limit "
                    f"{t_noexp:.3f}), real step {t_real:.3f} ms, CPU part {n_moe} x {c:.3f} "
                    f"({c_name}), ratio {ratio:.2f}")  # fmt: skip
                # the full K2: every MoE layer's period as measured here (EXTRAPOLATED)
                if tl.period is None:
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED", "not done: "
                                 "one MoE layer has no period (--layers 3 or more)"))  # fmt: skip
                else:
                    e = extrapolate(tl, N, c, t_fixed, per_moe)
                    ROWS.append(("decode", f"{tag} {mode}: VERDICT full K2 EXTRAPOLATED ({N} "
                                 "MoE layers, said so)",
                                 f"ratio {e['ratio']:.3f} {'MET' if e['ratio'] <= 1.1 else 'MISSED'}"
                                 f" (<= 1.1): step {e['step']:.1f} ms = head {tl.head:.3f} + "
                                 f"{N - 1} x period {tl.period:.3f} (measured: CPU experts in the "
                                 f"step + serial {tl.serial:.3f}) + CPU last {tl.cpu_last:.3f} + "
                                 f"tail {tl.tail:.3f} vs max(GPU part {e['gpu_part']:.1f} = fixed "
                                 f"{t_fixed:.3f} + {N} x limit per MoE layer {per_moe:.3f}, CPU "
                                 f"part {e['cpu_part']:.1f} = {N} x {c:.3f}, the fastest "
                                 f"measurement of one layer's CPU experts: {c_name}); 1.1x "
                                 f"allows a serial part <= {e['serial_for_1_1']:.3f} ms per MoE "
                                 f"layer; {1e3 / (e['step'] + t_head):.1f} tok/s with the "
                                 "lm_head"))  # fmt: skip
                    # context: the full K2's layers are cold (60 x 198 MB never in the L3):
                    # every CPU part = the fastest cold measurement, serial parts as measured
                    c_cold = min((v for v in (t_cold, t_cold_pw) if v == v), default=NAN)
                    ec = extrapolate_c(tl, N, c_cold, t_fixed, per_moe)
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED, cold CPU parts",
                                 f"ratio {ec['ratio']:.3f}: step {ec['step']:.1f} ms = head + "
                                 f"{N - 1} x (serial {tl.serial:.3f} + {c_cold:.3f}) + "
                                 f"{c_cold:.3f} + tail vs {N} x {c_cold:.3f} (one layer's CPU "
                                 f"experts cold, fastest of back to back / prewoken); "
                                 f"{1e3 / (ec['step'] + t_head):.1f} tok/s with the lm_head"
                                 ))  # fmt: skip
                # the GPU part's target for the full K2: its per-layer growth vs the limit's
                g_per = (t_gpu - t_fixed) / n_moe
                g_full, l_full = t_fixed + N * g_per, t_fixed + N * per_moe
                ROWS.append(("decode", f"{tag} {mode}: GPU part, full K2 EXTRAPOLATED",
                             f"{g_full:.1f} ms = fixed + {N} x {g_per:.3f} ((GPU part - fixed) / "
                             f"{n_moe}) = {g_full / l_full:.2f} x the limit's {l_full:.1f} ms"
                             ))  # fmt: skip
                if mode in ZERO_COPY_AB:  # before / after of the zero-copy staging
                    if zc_on:
                        soft(f"decode B={B} {mode} zero-copy A/B", lambda: zero_copy_ab(
                            r_h, hyb, kv_h, ppseq, B, ids, pos, md, (mode, dw, one_g, spin),
                            t_noexp))  # fmt: skip
                    else:
                        FAILS.append(f"decode B={B} {mode}: zero-copy off (the probe failed "
                                     "or K2SERVE_HYBRID_ZERO_COPY=0): no A/B")  # fmt: skip
                if one_g and zc_on and not r_h.fused_waits:
                    FAILS.append(f"decode B={B} {mode}: fused waits off (the probe failed or "
                                 "K2SERVE_HYBRID_FUSED_WAIT=0): no fused A/B")  # fmt: skip
                elif one_g and zc_on:  # before / after of the fused waits (kernels.zero_copy)
                    soft(f"decode B={B} {mode} fused-wait A/B", lambda: zero_copy_ab(
                        r_h, hyb, kv_h, ppseq, B, ids, pos, md, (mode, dw, one_g, spin),
                        t_noexp, fused=True))  # fmt: skip
                if not one_g:  # (one graph: its words are its own, no events to replace)
                    soft(f"decode B={B} {mode} ready words", lambda: ready_word_rows(
                        r_h, hyb, ids, pos, md, args, f"{tag} {mode}", t_real, n_tr))  # fmt: skip
                del r_h

            soft(f"decode B={B} {mode}", one)
        gc.collect()
        torch.cuda.empty_cache()
