# ruff: noqa: E501, E741, F821, B023
"""One K2 MoE layer's routed experts (384 x 7168 x 2048, top-8) on the same tensors: k2serve's
kernels against the libraries, and the routing-aware dispatch against fixed paths.

Run (one GPU, from the repo root):  PYTHONPATH=src python3 benchmarks/moe_libs.py [--parts dispatch,libs]

Parts:
- dispatch (issue 28 item 3): at T=16..256 and uniform / skewed (a third of the experts, as the
  k2-slice's dummy router) / recorded (--record FILE) routing, the per-pair GEMV, grouped GEMV
  and GEMM each, the engine's routing-aware choice (`FusedMoEBackend` with the policy's
  `int4_routing_select` bands) and the pair-count rule alone (bands off), every one replayed
  from a CUDA graph (what decode steps run). Prints which path the device chose.
- libs (item 1): T=1..16384 uniform, the whole routed-expert forward (routing prep, both
  GEMMs, SiLU-and-mul, weighted top-k sum) of: ours INT4 group-32 (engine policy), ours
  FP8-block 128x128 (engine policy), torch._grouped_mm bf16 (transformers' grouped_mm experts),
  torch._scaled_grouped_mm FP8 rowwise (a DeepGEMM-style grouped FP8 GEMM in torch), FlashInfer's
  CUTLASS fused MoE when importable (not carried: see the report). The weights are the same
  values: INT4 -> bf16 (exact), bf16 -> FP8 with one scale per 128-row block (so the same fp8
  bytes serve the 128x128 block scales and the row scales). Each output is checked against
  the bf16 grouped_mm output first (fp8: within 8e-2, the e4m3 rounding of these weights is
  4.7e-2 on the CPU); then timed (median of CUDA-event repeats).
  Rates: TFLOP/s against the bf16 and fp8 dense matmul rate measured in the same run, and the
  bytes of the distinct experts hit against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_speed import CEIL, FAILS, check, log, print_table, row, run_part, timed  # noqa: E402
from routing_modes import load_counts, routing_ids  # noqa: E402

E, D, I, K = 384, 7168, 2048, 8
DEV = "cuda"  # module constants: a CPU smoke test sets small sizes and "cpu"
MM = {"fp8": float("nan")}
# the INT4 decode paths the dispatch part times each on its own (FusedMoEBackend.run_path)
FIXED_PATHS = ("decode", "grouped", "mma", "gemm")


def ceilings():
    n = 1 << 30
    a = torch.randn(n, device=DEV)
    b = torch.empty_like(a)
    CEIL["bw"] = 2 * a.numel() * 4 / timed(lambda: b.copy_(a), iters=10) / 1e6
    del a, b
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    CEIL["mm"] = 2 * 8192**3 / timed(lambda: x @ y, iters=10) / 1e9
    try:
        xf, yf = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=DEV)
        ms = timed(lambda: torch._scaled_mm(xf, yf, one, one, out_dtype=torch.bfloat16), iters=10)
        MM["fp8"] = 2 * 8192**3 / ms / 1e9
    except Exception as e:  # noqa: BLE001
        log(f"  fp8 matmul rate: {e!r}"[:200])
    log(f"ceilings: copy {CEIL['bw']:.0f} GB/s, bf16 matmul {CEIL['mm']:.0f} TFLOP/s, "
        f"fp8 matmul {MM['fp8']:.0f} TFLOP/s")  # fmt: skip


def int4_experts(dev=None):
    dev = dev or DEV
    from k2serve.kernels.fused_moe import ExpertWeights

    def pk(n, k):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=dev)

    def sc(n, k):
        return (torch.rand(E, n, k // 32, device=dev) * 0.004 + 0.002).bfloat16()

    return ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)


def dequant_all(w, s, chunk=16):  # INT4 [E, N, K/8] -> bf16 [E, N, K] (exact: n * 2^-k scale)
    from k2serve.kernels.fused_moe import dequant_int4_ref

    out = torch.empty(w.shape[0], w.shape[1], w.shape[2] * 8, dtype=torch.bfloat16, device=w.device)
    for e in range(w.shape[0]):
        out[e] = dequant_int4_ref(w[e], s[e]).bfloat16()
    return out


def fp8_of(wb):  # bf16 [E, N, K] -> fp8 [E, N, K], scale per 128-row block [E, N/128] fp32
    Em, N, Kd = wb.shape
    q = torch.empty(Em, N, Kd, dtype=torch.float8_e4m3fn, device=wb.device)
    sc = torch.empty(Em, N // 128, dtype=torch.float32, device=wb.device)
    for e in range(Em):  # one expert at a time: no full-size temporaries
        w = wb[e].float()  # [N, K]
        sc[e] = w.view(N // 128, 128 * Kd).abs().amax(-1).clamp_min(1e-12) / 448.0
        q[e] = (w / sc[e].repeat_interleave(128)[:, None]).to(torch.float8_e4m3fn)
    return q, sc


def sort_pairs(ids):
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    return order, counts.cumsum(0).to(torch.int32)


def grouped_mm_moe(x, w13t, w2t, tw, ids):
    """transformers-style: pairs sorted by expert, torch._grouped_mm per projection (bf16)."""
    order, offs = sort_pairs(ids)
    tok = order // K
    h = torch._grouped_mm(x[tok], w13t, offs=offs)  # [M, 2I]
    a = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, w2t, offs=offs)  # [M, D]
    return unsort_sum(y, order, tw)


def unsort_sum(y, order, tw):  # y [M, D] sorted by expert -> sum_j tw[t, j] y[t, j]: [T, D]
    T = tw.shape[0]
    yu = torch.empty_like(y)
    yu[order] = y
    return torch.bmm(tw.view(T, 1, K).to(y.dtype), yu.view(T, K, -1)).view(T, -1)


def _q_rows(a):  # bf16 [M, K] -> fp8, per-row scale [M] fp32
    s = a.abs().amax(-1).float().clamp_min(1e-12) / 448.0
    return (a.float() / s[:, None]).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_moe(x, q13t, s13, q2t, s2, tw, ids):
    """FP8 rowwise: activations quantized per row, weights per output row; _scaled_grouped_mm."""
    order, offs = sort_pairs(ids)
    tok = order // K
    xq, xs = _q_rows(x)  # per token, then gathered (the same rows, less memory)
    h = torch._scaled_grouped_mm(xq[tok], q13t, xs[tok], s13, offs=offs, out_dtype=torch.bfloat16)
    a = F.silu(h[:, :I]) * h[:, I:]
    aq, as_ = _q_rows(a)
    y = torch._scaled_grouped_mm(aq, q2t, as_, s2, offs=offs, out_dtype=torch.bfloat16)
    return unsort_sum(y, order, tw)


def moe_flops(T):
    return 2.0 * T * K * 3 * D * I


def expert_bytes(ids, per):
    return ids.unique().numel() * per


# ------------------------------------------------------------------------------ dispatch
def graph_of(fn):
    fn()  # compile / warm outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def part_dispatch(record: str | None, tokens=(16, 32, 48, 64, 96, 128, 192, 256)):
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    ew = int4_experts()
    kw = KernelPolicy.for_device(DEV).moe_kwargs()
    be = FusedMoEBackend(ew, **kw)
    rule = FusedMoEBackend(ew, **{**kw, "routing_select": ()})
    per = sum(t[0].numel() * t.element_size() for t in (ew.w13, ew.w2, ew.w13_scale, ew.w2_scale))
    log(f"  bands: {[dict(b) for b in be.routing_select]}")
    counts = load_counts(record) if record else None
    skew = [[1000 if e % 3 == 0 else 0 for e in range(E)]]  # a third of the experts
    routings = [("uniform", None), ("skewed", skew)] + ([("recorded", counts)] if counts else [])
    for T in tokens:
        x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
        tw = torch.rand(T, K, device=DEV)
        for name, cts in routings:
            mode = "uniform" if cts is None else "record:x"
            ids = routing_ids(mode, T, E, K, 0, T, DEV, cts)
            hits = ids.unique().numel()
            nb = hits * per
            paths, lim = be.plan(T, K)
            outs, times = {}, {}
            fns = {p: (lambda p=p: rule.run_path(p, x, ids, tw)) for p in FIXED_PATHS}
            fns["select"] = lambda: be(x, ids, tw)
            fns["pair rule"] = lambda: rule(x, ids, tw)
            for p, fn in fns.items():
                try:
                    g = graph_of(fn)
                    times[p] = timed(g.replay, iters=20)
                    outs[p] = fn()
                except Exception as e:  # noqa: BLE001
                    log(f"  {p} T={T} {name}: {e!r}"[:200])
            if "gemm" in outs:
                for p in outs:
                    if p != "gemm":
                        check(f"dispatch {p} vs gemm T={T} {name}", outs[p], outs["gemm"], 2e-2)
            chosen = paths[0]
            if len(paths) > 1:
                from k2serve.kernels.moe_select import moe_select

                chosen = paths[int(moe_select(ids, E, lim)[:-1].argmax())]
            fixed = {p: times[p] for p in FIXED_PATHS if p in times}
            best = min(fixed, key=fixed.get) if fixed else "?"
            for p, ms in times.items():
                note = f"{hits} experts, {T * K / hits:.1f} pairs/expert"
                if p == "select":
                    note += f"; chose {chosen} (best fixed: {best} {fixed.get(best, float('nan')):.3f} ms)"
                row(f"dispatch-{name}", f"T={T} {p}", ms, nb, 0, note)


# ------------------------------------------------------------------------------ libraries
def part_libs(tokens=(1, 16, 64, 128, 256, 1024, 4096, 8192, 16384)):
    from k2serve.kernels.fused_moe import ExpertWeights
    from k2serve.kernels.policy import KernelPolicy
    from k2serve.moe.fused_moe import FusedMoEBackend

    kw = KernelPolicy.for_device(DEV).moe_kwargs()
    t0 = time.time()
    ew4 = int4_experts()
    w13 = dequant_all(ew4.w13, ew4.w13_scale)  # [E, 2I, D] bf16, the INT4 values exactly
    w2 = dequant_all(ew4.w2, ew4.w2_scale)  # [E, D, I]
    q13, r13 = fp8_of(w13)  # [E, 2I, D] fp8, [E, 2I/128]
    q2, r2 = fp8_of(w2)
    be4 = FusedMoEBackend(ew4, **kw)
    # FP8-block 128x128: the per-128-row scale repeated over the K blocks
    ew8 = ExpertWeights("fp8", q13, q2, r13[:, :, None].expand(-1, -1, D // 128).contiguous(),
                        r2[:, :, None].expand(-1, -1, I // 128).contiguous())  # fmt: skip
    be8 = FusedMoEBackend(ew8, **kw)
    s13 = r13.repeat_interleave(128, 1).contiguous()  # [E, 2I] rowwise
    s2 = r2.repeat_interleave(128, 1).contiguous()  # [E, D]
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)  # [E, D, 2I], [E, I, D] column-major
    q13t, q2t = q13.transpose(1, 2), q2.transpose(1, 2)
    log(
        f"  weights ready in {time.time() - t0:.1f}s ({torch.cuda.memory_allocated() / 2**30:.0f} GiB)"
    )
    per = {"int4": (ew4.w13[0].numel() * 4 + ew4.w2[0].numel() * 4) * 1.125,
           "fp8": 3 * D * I, "bf16": 6 * D * I}  # fmt: skip
    libs = {
        "ours INT4 g32": ("int4", lambda x, tw, ids: be4(x, ids, tw)),
        "ours FP8-block": ("fp8", lambda x, tw, ids: be8(x, ids, tw)),
        "torch _grouped_mm bf16": ("bf16", lambda x, tw, ids: grouped_mm_moe(x, w13t, w2t, tw, ids)),
        "torch _scaled_grouped_mm fp8 rowwise": (
            "fp8", lambda x, tw, ids: scaled_grouped_mm_moe(x, q13t, s13, q2t, s2, tw, ids)),
    }  # fmt: skip
    fi = flashinfer_moe(w13, w2)
    if fi is not None:
        libs["flashinfer cutlass bf16"] = ("bf16", fi)
    for T in tokens:
        x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
        tw = torch.rand(T, K, device=DEV)
        ids = routing_ids("uniform", T, E, K, 0, T, DEV)
        ref = grouped_mm_moe(x, w13t, w2t, tw, ids)
        fl = moe_flops(T)
        res = {}
        for name, (fmt, fn) in libs.items():
            try:
                check(f"libs {name} T={T}", fn(x, tw, ids), ref, 2e-2 if fmt != "fp8" else 8e-2)
                ms = timed(lambda fn=fn: fn(x, tw, ids), iters=5 if T >= 4096 else 15, warmup=2)
            except Exception as e:  # noqa: BLE001
                log(f"  {name} T={T}: {e!r}"[:240])
                FAILS.append(f"libs {name} T={T}")
                continue
            res[name] = ms
            rate = fl / ms / 1e9
            nb = expert_bytes(ids, per[fmt])
            row("libs", f"T={T} {name}", ms, nb, fl,
                f"{100 * rate / MM['fp8']:.0f}% of fp8 mm" if fmt == "fp8" else "")  # fmt: skip
        if res:
            best = min(res, key=res.get)
            log(f"  libs T={T}: fastest {best} {res[best]:.3f} ms; ours INT4 / fastest = "
                f"{res.get('ours INT4 g32', float('nan')) / res[best]:.2f}x")  # fmt: skip


def flashinfer_moe(w13, w2):
    """FlashInfer's CUTLASS fused MoE (bf16 weights) when the package imports, else None."""
    try:
        t = time.time()
        from flashinfer.fused_moe import cutlass_fused_moe
    except Exception as e:  # noqa: BLE001
        log(f"  flashinfer: not importable ({e!r})"[:200])
        return None
    log(f"  flashinfer imported in {time.time() - t:.1f}s")

    def run(x, tw, ids):
        return cutlass_fused_moe(x, ids.int(), tw, w13, w2, torch.bfloat16, quant_scales=[])[0]

    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="dispatch,libs")
    ap.add_argument("--record", default=None, help="a --record-routing counts file (dispatch)")
    ap.add_argument("--dispatch-tokens", default="16,32,48,64,96,128,192,256")
    ap.add_argument("--lib-tokens", default="1,16,64,128,256,1024,4096,8192,16384")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("moe_libs.py needs a CUDA device")
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} "
        f"triton {__import__('triton').__version__} date {time.strftime('%Y-%m-%d')}")  # fmt: skip
    torch.manual_seed(0)
    ceilings()
    parts = args.parts.split(",")
    if "dispatch" in parts:
        toks = tuple(int(t) for t in args.dispatch_tokens.split(","))
        run_part("dispatch", lambda: part_dispatch(args.record, toks))
        torch.cuda.empty_cache()
    if "libs" in parts:
        toks2 = tuple(int(t) for t in args.lib_tokens.split(","))
        run_part("libs", lambda: part_libs(toks2))
    log(f"fp8 matmul {MM['fp8']:.0f} TFLOP/s (the % matmul column is of bf16)")
    print_table()


if __name__ == "__main__":
    main()
