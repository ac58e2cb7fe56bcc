# ruff: noqa: E501, B023, F821
"""The decode part of benchmarks/hybrid_moe.py (see its docstring, "decode"): the all-GPU
limit and its split (fixed part + per MoE layer), the CPU experts alone, the hybrid graph step
in both ways of waiting, its in-step timeline (benchmarks/hybrid_timeline.py) and the full K2
extrapolated from it."""

from __future__ import annotations

import gc

import torch
from hybrid_common import (
    FAILS,
    ROWS,
    WAITS,
    ZeroExperts,
    decode_inputs,
    graph_runner,
    hybrid_backends,
    kv_for,
    log,
    set_stub,
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


def cpu_cold_ms(hyb, B, iters, sets=4) -> float:
    """One layer's CPU experts alone, each call on another set of experts (disjoint while the
    layer has 4 x B x k of them), so no call finds in the L3 what the previous one read (a K2
    layer's 8 INT4 experts are ~198 MB; the H100 host's L3 ~300 MB): ms per call."""
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

    def run():
        for i in ids:
            be(x, i, w)

    return wall_ms(run, iters=iters, warmup=1) / sets


def cpu_step_inputs_ms(hyb, B, iters) -> float | None:
    """Each MoE layer's CPU experts alone on the last real step's own inputs (its pinned
    staging buffers), layer after layer as the step runs them: ms per layer (None without
    staging buffers: a CPU device)."""
    bes = hybrid_backends(hyb)
    if any(be._buffers is None for be in bes):
        return None
    ins = [tuple(be._buffers[n][:B].clone() for n in ("x", "ids", "w")) for be in bes]

    def run():
        for be, (x, i, w) in zip(bes, ins, strict=True):
            be.cpu_backend(x, i, w)

    return wall_ms(run, iters=iters, warmup=1) / len(bes)


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


def part_decode(ref, hyb, args):
    from hybrid_timeline import (
        K2_MOE_LAYERS,
        cpu_shifted,
        describe,
        extrapolate,
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
        be = hybrid_backends(hyb)[0]
        x = torch.randn(B, hyb.config.hidden_size, dtype=torch.bfloat16)
        tid = torch.randint(0, hyb.config.n_routed_experts, (B, hyb.config.num_experts_per_tok))
        tw = torch.rand(B, hyb.config.num_experts_per_tok)
        t_cpu = wall_ms(lambda: be.cpu_backend(x, tid, tw), iters=max(5, args.iters), warmup=2)
        cpu_part = n_moe * t_cpu
        t_cold = soft(f"decode {tag} CPU cold", lambda: cpu_cold_ms(hyb, B, max(3, args.iters)))
        t_cold = float("nan") if t_cold is None else t_cold
        ROWS.append(("decode", f"{tag} CPU experts part alone ({n_moe} MoE layers)",
                     f"{cpu_part:.3f} ms = {n_moe} x {t_cpu:.3f} ms (the same experts each call:"
                     f" the previous figure; their bytes can stay in the L3); one layer on 4 "
                     f"other expert sets in turn (cold): {t_cold:.3f} ms"))  # fmt: skip
        set_stub(hyb, True)
        t_eager_part = wall_ms(lambda: hyb(ids, pos, md, kv_h), iters=args.iters)
        set_stub(hyb, False)
        ROWS.append(("decode", f"{tag} hybrid GPU part, eager",
                     f"{t_eager_part:.3f} ms = {t_eager_part / t_noexp:.2f} x limit"))  # fmt: skip
        log(f"  {tag}: all-GPU {t_all:.3f} ms, minus expert GEMVs {t_noexp:.3f} ms (fixed "
            f"{t_fixed:.3f} + {n_moe} x {per_moe:.3f}), CPU part {cpu_part:.3f} ms ({n_moe} x "
            f"{t_cpu:.3f}), eager GPU part {t_eager_part:.3f} ms")  # fmt: skip
        for mode, dw, one_g in WAITS:

            def one():
                n_tr = max(10, 2 * args.iters)
                set_stub(hyb, True)
                try:
                    r_h = graph_runner(hyb, kv_h, ppseq, B, device_wait=dw, one_graph=one_g)
                    t_gpu = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters)
                    # the same timeline with the CPU experts answered at once: the GPU chain
                    # and the host's latencies alone (a period = its serial part + ~0)
                    tl0 = timeline(traced_steps(r_h, hybrid_backends(hyb), lambda: r_h.run(
                        ids, pos, md), torch.cuda.synchronize, n_tr))  # fmt: skip
                finally:
                    set_stub(hyb, False)
                t_real = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters, warmup=2)
                # the CPU experts the step runs, alone: its own inputs, layer after layer
                t_own = cpu_step_inputs_ms(hyb, B, max(3, args.iters))
                own_part = n_moe * (t_cpu if t_own is None else t_own)
                pieces = max(r_h.num_pieces.values())
                if dw and not r_h.waits_in_graph:
                    FAILS.append(f"decode B={B} {mode}: the probe failed, host wait used")
                if one_g and not r_h.jobs:
                    FAILS.append(f"decode B={B} {mode}: no ready words, pieces used")
                limit = max(t_gpu, cpu_part)
                ratio, gratio = t_real / limit, t_gpu / t_noexp
                hidden = max(0.0, t_gpu + cpu_part - t_real) / max(t_gpu, 1e-9)
                ROWS.append(("decode", f"{tag} {mode}: GPU part, {pieces} graph pieces",
                             f"{t_gpu:.3f} ms = {gratio:.2f} x limit "
                             f"{'MET' if gratio <= 1 else 'MISSED'} (<= 1.0)"))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: hybrid step, CPU experts real",
                             f"{t_real:.3f} ms = {ratio:.2f} x max(GPU part, CPU part) "
                             f"{'MET' if ratio <= 1.1 else 'MISSED'} (<= 1.1, this {n_moe}-MoE-"
                             f"layer slice); {hidden:.0%} of the GPU part hidden; "
                             f"{t_real / max(t_gpu, own_part):.2f} x max(GPU part, the step's "
                             f"own CPU experts alone {own_part:.3f} = {n_moe} x "
                             f"{own_part / n_moe:.3f}, its inputs layer after layer)"))  # fmt: skip
                log(f"  {tag} {mode}: GPU part {t_gpu:.3f} ms ({gratio:.2f} x limit "
                    f"{t_noexp:.3f}), real step {t_real:.3f} ms, CPU part {cpu_part:.3f} ms, "
                    f"ratio {ratio:.2f}")  # fmt: skip
                tl = timeline(traced_steps(r_h, hybrid_backends(hyb), lambda: r_h.run(ids, pos, md),
                                           torch.cuda.synchronize, n_tr))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: timeline, CPU experts stubbed (host "
                             "timestamps, ms)", describe(tl0)))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: timeline of the real step (host "
                             "timestamps, ms)", describe(tl)))  # fmt: skip
                log(f"  {tag} {mode}: stubbed: {describe(tl0)}")
                log(f"  {tag} {mode}: real: {describe(tl)}")
                # the full K2: every MoE layer's period as measured here (EXTRAPOLATED)
                if tl.period is None:
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED", "not done: "
                                 "one MoE layer has no period (--layers 3 or more)"))  # fmt: skip
                else:
                    t_alone = own_part / n_moe  # the step's own CPU experts alone
                    e = extrapolate(tl, N, t_alone, t_fixed, per_moe)
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED ({N} MoE layers, "
                                 "said so)",
                                 f"step {e['step']:.1f} ms = head {tl.head:.3f} + {N - 1} x period "
                                 f"{tl.period:.3f} + CPU last {tl.cpu_last:.3f} + tail {tl.tail:.3f}"
                                 f" vs max(GPU part {e['gpu_part']:.1f} = fixed {t_fixed:.3f} + {N} "
                                 f"x limit per MoE layer {per_moe:.3f}, CPU part {e['cpu_part']:.1f}"
                                 f" = {N} x {t_alone:.3f}, the step's own alone) = ratio {e['ratio']:.2f} "
                                 f"{'MET' if e['ratio'] <= 1.1 else 'MISSED'} (<= 1.1); 1.1x needs "
                                 f"a serial part <= {e['serial_for_1_1']:.3f} ms per MoE layer (now "
                                 f"{tl.serial:.3f}); with the lm_head: "
                                 f"{1e3 / (e['step'] + t_head):.1f} tok/s"))  # fmt: skip
                    # the same with every CPU part as cold as in a 60-layer model: each CPU
                    # part of the step shifted by (cold - own alone)
                    ec = extrapolate(cpu_shifted(tl, t_cold - t_alone), N, t_cold, t_fixed,
                                     per_moe)  # fmt: skip
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED, cold CPU parts",
                                 f"step {ec['step']:.1f} ms vs CPU part {ec['cpu_part']:.1f} = "
                                 f"{N} x {t_cold:.3f} (cold) = ratio {ec['ratio']:.2f} "
                                 f"{'MET' if ec['ratio'] <= 1.1 else 'MISSED'} (<= 1.1); the "
                                 f"in-step CPU parts taken {t_cold - t_alone:+.3f} ms each; with "
                                 f"the lm_head: {1e3 / (ec['step'] + t_head):.1f} tok/s"
                                 ))  # fmt: skip
                # the GPU part's target for the full K2: its per-layer growth vs the limit's
                g_per = (t_gpu - t_fixed) / n_moe
                g_full, l_full = t_fixed + N * g_per, t_fixed + N * per_moe
                ROWS.append(("decode", f"{tag} {mode}: GPU part, full K2 EXTRAPOLATED",
                             f"{g_full:.1f} ms = fixed + {N} x {g_per:.3f} ((GPU part - fixed) / "
                             f"{n_moe}) = {g_full / l_full:.2f} x the limit's {l_full:.1f} ms"
                             ))  # fmt: skip
                if not one_g:  # (one graph: its words are its own, no events to replace)
                    soft(f"decode B={B} {mode} ready words", lambda: ready_word_rows(
                        r_h, hyb, ids, pos, md, args, f"{tag} {mode}", t_real, n_tr))  # fmt: skip
                del r_h

            soft(f"decode B={B} {mode}", one)
        gc.collect()
        torch.cuda.empty_cache()
