# ruff: noqa: E501, B023, F821
"""Hybrid GPU + CPU experts on one CUDA GPU: correctness first, then the two targets of issue 15
that belong to the hybrid path, each against its limit measured in the same run.

Run (repo root, one GPU):  PYTHONPATH=src python3 benchmarks/hybrid_moe.py [--quick]
  --quick     decode B=1 only, prefill 32K only, every correctness check (< 3 min on an H100)
  --layers N  k2-slice layers (default 3: 1 dense + 2 MoE, INT4, dummy weights, real K2 sizes)
  --n-gpu N   routed experts per MoE layer kept on the GPU in the hybrid model (default 0: all
              384 in host memory, the hardest case for both targets)
  --parts checks,decode --no-layerwise   decode only (no layer-wise prefill set-up)
  --watchdog S   dump the stacks and exit after S seconds (a blocked stream fails fast)

Model: two copies of the same k2-slice (same seed, so the same weights): `ref` with every expert
on the GPU (fused Triton MoE), `hyb` with the placement above (CPU experts in host memory).
Checks (relative error of the final hidden states vs `ref`, bf16):
  cpu-path prefill T=4         hyb computes its CPU experts on the CPU
  layer-wise prefill T=2048    hyb streams its CPU experts to the GPU (threshold forced to 1)
  piecewise graph decode B     hyb's decode graphs (piecewise around the host round trip) vs ref
  graph decode B, host wait / device wait: hyb's decode graphs in both ways of waiting
          for the CPU experts (model.cuda_graph: a host round trip between graph pieces, the
          old path; or a stream wait on a host flag inside the graph) vs ref
Targets (decode: both ways of waiting measured in the same run, "before" = host wait):
  decode  "GPU part of a hybrid step with graphs <= all-GPU step minus the expert GEMVs":
          ref graph step with the routed experts removed (limit) vs hyb graph step with the
          CPU experts answered instantly (the GPU part: every GPU piece, the D2H/H2D staging,
          the event / flag waits and the replays between); also the hyb eager step with the
          same stub (what graphs buy).
          "hybrid step <= 1.1 x max(GPU part, CPU experts part)": the real hyb graph step vs
          the GPU part and the CPU experts alone (n MoE layers x one layer's CPU experts on
          the calling thread, as a step runs them).
          Timeline (benchmarks/hybrid_timeline.py): host timestamps inside the real step give
          the head, each MoE layer's period (CPU experts + serial part, split), the tail; the
          limit is split into its fixed part (the all-GPU graph step with the MoE layers
          removed) and a part per MoE layer; from both, the full K2 (60 MoE layers)
          EXTRAPOLATED: head + 59 periods + the last CPU part + tail vs max(fixed + 60 x the
          limit per layer, 60 x the CPU experts alone).
  prefill "hybrid prefill of a 32K prompt >= 1,000 tok/s extrapolated to 60 layers": a
          32K-token step through hyb with layer-wise GPU prefill (calibrated threshold, printed
          with the measured PCIe rate): the copy of one layer's CPU experts (c), the step with
          the experts resident (compute per MoE layer m, dense layer counted in), the step with
          every layer streamed (measured pipeline), and the 60-layer estimate c + 60 max(c, m)
          (double buffer: each layer's copy runs under the previous layer's compute); the
          all-GPU ref step beside it.
Timings: wall clock around a synchronized step (host actions are part of the step), median.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

import torch

ROWS: list[tuple[str, str, str]] = []
FAILS: list[str] = []


def log(*a):
    print(*a, flush=True)


def wall_ms(fn, iters=10, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def check(name, out, ref, tol):
    out, ref = out.float(), ref.float()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(out).all()) and err < tol
    log(f"  check {name:48s} rel_err={err:.2e} (< {tol:g}) {'ok' if ok else 'FAIL'}")
    ROWS.append(("check", name, f"rel_err {err:.1e} {'ok' if ok else 'FAIL'}"))
    if not ok:
        FAILS.append(name)


def load(layers, placement=None):
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model
    from k2serve.weights.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config("k2-slice", "int4", layers=layers))
    t = time.time()
    m = load_model(None, load_format="dummy", config=cfg, device="cuda", progress=False,
                   expert_placement=placement, seed=0)  # fmt: skip
    log(
        f"loaded k2-slice int4 {layers} layers ({placement.describe() if placement else 'all on the GPU'}) in {time.time() - t:.0f}s"
    )
    return m


def kv_for(model, tokens, ps=64):
    from k2serve.attention import allocate_kv_caches

    return allocate_kv_caches(model.config, -(-tokens // ps) + 8, ps, torch.bfloat16, "cuda")


def prefill_inputs(T, ps=64):
    from k2serve.attention.base import AttentionMetadata

    pages = -(-T // ps)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([T], device="cuda", dtype=torch.int32),
        context_lens=torch.zeros(1, device="cuda", dtype=torch.int32),
        block_table=torch.arange(pages, device="cuda", dtype=torch.int32)[None],
        slot_mapping=torch.arange(T, device="cuda"), max_query_len=T, max_seq_len=T,
        page_size=ps, num_decodes=0,
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.randint(0, 2000, (T,), device="cuda", generator=g)
    return ids, torch.arange(T, device="cuda"), md


def decode_inputs(B, ctx, ps=64):
    from k2serve.attention.base import AttentionMetadata

    ppseq = -(-(ctx + 1) // ps)
    bt = torch.arange(B * ppseq, device="cuda", dtype=torch.int32).view(B, ppseq)
    md = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, device="cuda", dtype=torch.int32),
        seq_lens=torch.full((B,), ctx + 1, device="cuda", dtype=torch.int32),
        context_lens=torch.full((B,), ctx, device="cuda", dtype=torch.int32),
        block_table=bt, slot_mapping=(bt[:, ctx // ps].long() * ps + ctx % ps),
        max_query_len=1, max_seq_len=ctx + 1, page_size=ps, num_decodes=B,
    )  # fmt: skip
    ids = torch.randint(0, 2000, (B,), device="cuda")
    return ids, torch.full((B,), ctx, device="cuda", dtype=torch.long), md, B * ppseq, ppseq


def hybrid_backends(model):
    return [ly.mlp.expert_backend for ly in model.model.layers
            if getattr(getattr(ly.mlp, "expert_backend", None), "name", None) == "hybrid"]  # fmt: skip


class StubCpu:
    """Stands in for a layer's CPU experts: answers at once with zeros (the GPU part alone)."""

    def __init__(self, real):
        self.real, self.shape = real, None

    def submit(self, x, ids, w, **kw):
        self.shape = x.shape
        self._out = torch.zeros(x.shape, dtype=x.dtype)

    def wait(self):
        return self._out

    def prewake(self, usec: int = 0) -> None:  # nothing to wake
        pass


def set_stub(model, on: bool):
    for be in hybrid_backends(model):
        if on and not isinstance(be.cpu_backend, StubCpu):
            be.cpu_backend = StubCpu(be.cpu_backend)
        elif not on and isinstance(be.cpu_backend, StubCpu):
            be.cpu_backend = be.cpu_backend.real


class ZeroExperts:
    name = "zero"

    def __call__(self, hidden, topk_ids, topk_weights):
        return torch.zeros_like(hidden)


def graph_runner(model, kv, max_pages, B, device_wait=None):
    from k2serve.model.cuda_graph import DecodeGraphRunner

    r = DecodeGraphRunner(model, kv, max_pages, buckets=(B,), device_wait=device_wait)
    r.capture()
    return r


# the two ways a hybrid decode graph waits for the CPU experts (model.cuda_graph):
# before = a host round trip between graph pieces, after = a stream wait inside the graph
WAITS = (("host wait (before)", False), ("device wait (after)", True))


def soft(name, fn):
    """Run one part; on an error print it, count it as a failure and go on."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        log(f"  {name}: ERROR {type(e).__name__}: {e}")
        FAILS.append(name)
        return None


def part_checks(ref, hyb, args):
    log("== correctness")
    T = 4
    ids, pos, md = prefill_inputs(T)
    kv_r, kv_h = kv_for(ref, T), kv_for(hyb, T)
    check(f"cpu-path prefill T={T}", hyb(ids, pos, md, kv_h), ref(ids, pos, md, kv_r), 2e-2)
    lw = getattr(hyb, "layerwise_prefill", None)
    if args.no_layerwise:
        pass
    elif lw is None:
        FAILS.append("layer-wise prefill setup")
    else:
        thr, lw.threshold = lw.threshold, 1
        T = 2048
        ids, pos, md = prefill_inputs(T)
        kv_r, kv_h = kv_for(ref, T), kv_for(hyb, T)
        check(f"layer-wise prefill T={T}", hyb(ids, pos, md, kv_h), ref(ids, pos, md, kv_r), 2e-2)
        lw.threshold = thr
    for B in args.batches:
        ids, pos, md, pages, ppseq = decode_inputs(B, 256)
        kv_r = kv_for(ref, pages * 64)
        want = ref(ids, pos, md, kv_r)
        for mode, dw in WAITS:

            def one():
                kv_h = kv_for(hyb, pages * 64)
                r = graph_runner(hyb, kv_h, ppseq, B, device_wait=dw)
                got = [r.run(ids, pos, md).clone() for _ in range(3)][-1]  # replays agree
                check(f"graph decode B={B}, {mode} ({max(r.num_pieces.values())} pieces)",
                      got, want, 2e-2)  # fmt: skip

            soft(f"graph decode B={B} {mode}", one)
    gc.collect()
    torch.cuda.empty_cache()


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


def part_decode(ref, hyb, args):
    from hybrid_timeline import K2_MOE_LAYERS, describe, extrapolate, timeline, traced_steps

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
        ROWS.append(("decode", f"{tag} CPU experts part alone ({n_moe} MoE layers)",
                     f"{cpu_part:.3f} ms = {n_moe} x {t_cpu:.3f} ms"))  # fmt: skip
        set_stub(hyb, True)
        t_eager_part = wall_ms(lambda: hyb(ids, pos, md, kv_h), iters=args.iters)
        set_stub(hyb, False)
        ROWS.append(("decode", f"{tag} hybrid GPU part, eager",
                     f"{t_eager_part:.3f} ms = {t_eager_part / t_noexp:.2f} x limit"))  # fmt: skip
        log(f"  {tag}: all-GPU {t_all:.3f} ms, minus expert GEMVs {t_noexp:.3f} ms (fixed "
            f"{t_fixed:.3f} + {n_moe} x {per_moe:.3f}), CPU part {cpu_part:.3f} ms ({n_moe} x "
            f"{t_cpu:.3f}), eager GPU part {t_eager_part:.3f} ms")  # fmt: skip
        for mode, dw in WAITS:

            def one():
                n_tr = max(10, 2 * args.iters)
                set_stub(hyb, True)
                try:
                    r_h = graph_runner(hyb, kv_h, ppseq, B, device_wait=dw)
                    t_gpu = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters)
                    # the same timeline with the CPU experts answered at once: the GPU chain
                    # and the host's latencies alone (a period = its serial part + ~0)
                    tl0 = timeline(traced_steps(r_h, hybrid_backends(hyb), lambda: r_h.run(
                        ids, pos, md), torch.cuda.synchronize, n_tr))  # fmt: skip
                finally:
                    set_stub(hyb, False)
                t_real = wall_ms(lambda: r_h.run(ids, pos, md), iters=args.iters, warmup=2)
                pieces = max(r_h.num_pieces.values())
                if dw and not r_h.waits_in_graph:
                    FAILS.append(f"decode B={B} {mode}: the probe failed, host wait used")
                limit = max(t_gpu, cpu_part)
                ratio, gratio = t_real / limit, t_gpu / t_noexp
                hidden = max(0.0, t_gpu + cpu_part - t_real) / max(t_gpu, 1e-9)
                ROWS.append(("decode", f"{tag} {mode}: GPU part, {pieces} graph pieces",
                             f"{t_gpu:.3f} ms = {gratio:.2f} x limit "
                             f"{'MET' if gratio <= 1 else 'MISSED'} (<= 1.0)"))  # fmt: skip
                ROWS.append(("decode", f"{tag} {mode}: hybrid step, CPU experts real",
                             f"{t_real:.3f} ms = {ratio:.2f} x max(GPU part, CPU part) "
                             f"{'MET' if ratio <= 1.1 else 'MISSED'} (<= 1.1, this {n_moe}-MoE-"
                             f"layer slice); {hidden:.0%} of the GPU part hidden"))  # fmt: skip
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
                    e = extrapolate(tl, N, t_cpu, t_fixed, per_moe)
                    ROWS.append(("decode", f"{tag} {mode}: full K2 EXTRAPOLATED ({N} MoE layers, "
                                 "said so)",
                                 f"step {e['step']:.1f} ms = head {tl.head:.3f} + {N - 1} x period "
                                 f"{tl.period:.3f} + CPU last {tl.cpu_last:.3f} + tail {tl.tail:.3f}"
                                 f" vs max(GPU part {e['gpu_part']:.1f} = fixed {t_fixed:.3f} + {N} "
                                 f"x limit per MoE layer {per_moe:.3f}, CPU part {e['cpu_part']:.1f}"
                                 f" = {N} x {t_cpu:.3f} alone) = ratio {e['ratio']:.2f} "
                                 f"{'MET' if e['ratio'] <= 1.1 else 'MISSED'} (<= 1.1); 1.1x needs "
                                 f"a serial part <= {e['serial_for_1_1']:.3f} ms per MoE layer (now "
                                 f"{tl.serial:.3f})"))  # fmt: skip
                # the GPU part's target for the full K2: its per-layer growth vs the limit's
                g_per = (t_gpu - t_fixed) / n_moe
                g_full, l_full = t_fixed + N * g_per, t_fixed + N * per_moe
                ROWS.append(("decode", f"{tag} {mode}: GPU part, full K2 EXTRAPOLATED",
                             f"{g_full:.1f} ms = fixed + {N} x {g_per:.3f} ((GPU part - fixed) / "
                             f"{n_moe}) = {g_full / l_full:.2f} x the limit's {l_full:.1f} ms"
                             ))  # fmt: skip
                del r_h

            soft(f"decode B={B} {mode}", one)
        gc.collect()
        torch.cuda.empty_cache()


def part_prefill(ref, hyb, args):
    log("== prefill")
    lw = getattr(hyb, "layerwise_prefill", None)
    if lw is None:
        log("  layer-wise prefill could not be set up (see the warning above)")
        FAILS.append("layer-wise prefill setup")
        return
    c = hyb.config
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        lw._load(0)  # one layer's CPU experts into a slot (side stream), timed alone
    torch.cuda.synchronize()
    copy_ms = (time.perf_counter() - t0) / 3 * 1e3
    lw.invalidate()
    gbs = lw.slot_bytes / copy_ms / 1e6
    ROWS.append(("prefill", "threshold (calibrated)", f"{lw.threshold} tokens"))
    ROWS.append(
        (
            "prefill",
            "one layer's CPU experts over PCIe",
            f"{copy_ms:.1f} ms ({lw.slot_bytes / 1e9:.2f} GB at {gbs:.1f} GB/s)",
        )
    )
    L = c.num_hidden_layers
    n_moe = len(hybrid_backends(hyb))
    for T in args.prefills:
        ids, pos, md = prefill_inputs(T)
        kv_h = kv_for(hyb, T)
        # resident: with 2 hybrid layers and 2 slots, repeated steps copy nothing (each layer's
        # experts stay in their slot): the step's compute alone
        t_res = wall_ms(lambda: hyb(ids, pos, md, kv_h), iters=2, warmup=1)

        def pipelined():
            lw.invalidate()  # every layer copied in this step, as with 60 layers
            hyb(ids, pos, md, kv_h)

        t_pipe = wall_ms(pipelined, iters=2, warmup=1)
        per_moe = t_res / n_moe  # conservative: the dense layer and embedding counted in
        # 60 MoE layers: the first copy exposed, then each layer max(copy, compute) (the next
        # layer's copy runs under this layer's compute)
        est60 = copy_ms + 60 * max(copy_ms, per_moe)
        tps = T / (est60 / 1e3)
        ok = tps >= 1000
        ROWS.append(
            (
                "prefill",
                f"T={T} hybrid step, experts resident ({L} layers)",
                f"{t_res:.0f} ms = {per_moe:.0f} ms per MoE layer (compute, dense layer included)",
            )
        )
        ROWS.append(
            (
                "prefill",
                f"T={T} hybrid step, every layer streamed",
                f"{t_pipe:.0f} ms ({n_moe} layers + the next step's first layer copied)",
            )
        )
        ROWS.append(
            (
                "prefill",
                f"T={T} extrapolated to 60 MoE layers",
                f"{copy_ms:.0f} + 60 x max({copy_ms:.0f}, {per_moe:.0f}) ms = {est60 / 1e3:.1f} s -> {tps:.0f} tok/s {'MET' if ok else 'MISSED'} (>= 1000)",
            )
        )
        kv_r = kv_for(ref, T)
        t_r = wall_ms(lambda: ref(ids, pos, md, kv_r), iters=2, warmup=1)
        ROWS.append(
            (
                "prefill",
                f"T={T} all-GPU step (same layers)",
                f"{t_r:.0f} ms = {t_r / n_moe:.0f} ms per MoE layer; hybrid resident/all-GPU {t_res / t_r:.2f}x",
            )
        )
        log(
            f"  T={T}: hybrid resident {t_res:.0f} ms, streamed {t_pipe:.0f} ms, all-GPU {t_r:.0f} ms, extrapolated {tps:.0f} tok/s"
        )
        del kv_h, kv_r
        torch.cuda.empty_cache()
    ROWS.append(
        (
            "prefill",
            "peer (published, not run)",
            "KT layer-wise prefill 290 tok/s at 30K, K2-Thinking, 1 GPU (field.md 1.2)",
        )
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--n-gpu", type=int, default=0)
    ap.add_argument("--parts", default="checks,decode,prefill")
    ap.add_argument(
        "--no-layerwise",
        action="store_true",
        help="skip the layer-wise prefill set-up and its check (decode only)",
    )
    ap.add_argument(
        "--watchdog",
        type=float,
        default=0,
        help="seconds: dump every thread's stack and exit if still running",
    )
    args = ap.parse_args(argv)
    if args.watchdog > 0:  # a blocked stream must not eat the rest of a device call
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if not torch.cuda.is_available():
        log(
            "benchmarks/hybrid_moe.py needs a CUDA GPU (the targets are GPU + CPU figures); nothing run"
        )
        return 2
    args.batches = (1,) if args.quick else (1, 4, 16)
    args.prefills = (32768,) if args.quick else (8192, 32768)
    args.iters = 5 if args.quick else 15
    log(
        f"device {torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    from k2serve.config import ModelConfig
    from k2serve.moe import make_placement
    from k2serve.weights.presets import preset_config

    cfg = ModelConfig.from_hf(preset_config("k2-slice", "int4", layers=args.layers))
    ref = load(args.layers)
    hyb = load(args.layers, make_placement(cfg, args.n_gpu))
    from k2serve.moe.layerwise import setup_layerwise_prefill

    # outside inference mode (it re-points parameters); calibrates the threshold (logged)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = time.time()
    if not args.no_layerwise:
        setup_layerwise_prefill(hyb, None, fused=True)  # the engine's choice on CUDA
        log(f"layer-wise prefill set up in {time.time() - t:.0f}s")
    parts = args.parts.split(",")
    t0 = time.time()
    with torch.inference_mode():
        if "checks" in parts:
            part_checks(ref, hyb, args)
        if "decode" in parts:
            part_decode(ref, hyb, args)
        if "prefill" in parts:
            part_prefill(ref, hyb, args)
    log(
        f"\n== results (k2-slice INT4, {args.layers} layers, {args.n_gpu} of 384 experts per MoE layer on the GPU; {time.time() - t0:.0f}s)"
    )
    w = max(len(r[1]) for r in ROWS) if ROWS else 10
    for sec, case, val in ROWS:
        log(f"  {sec:8s} {case:{w}s}  {val}")
    if FAILS:
        log(f"FAILED checks: {', '.join(FAILS)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
