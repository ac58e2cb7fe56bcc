"""MLA prompt attention, expanded form: the Triton varlen flash kernel (kernels/mla_prefill.py)
against the SDPA path (attention/triton_mla.py mla_prefill_expanded with prefill_attn="sdpa":
per sequence a kv_b_proj, cats, V padded to 192, torch's flash SDPA, a copy into out).

Run (one H100 / H200, from the repo root, < 300 s, no network):
    OUT=$OUT PYTHONPATH=src python3 benchmarks/mla_prefill_bench.py --sweep
Options: --sweep (time a list of kernel configs per case and print the best per length as the
"mla_prefill" line of kernels/configs/<kind>.json), --smoke (the script itself on a CPU under
Triton's interpreter at tiny shapes; its timings mean nothing), --iters N.

1. ceiling: torch.mm 8192^3 in bf16 (as model_speed.py part_ceil), TFLOP/s.
2. checks, per case (exit code 1 on any FAIL): the kernel path's output against the SDPA
   path's (max abs / rel error); at the smallest case both against the float32 reference.
3. timing (CUDA events, median): "kernel" = mla_prefill_attention alone on the kv_b_proj
   output, "ours" = mla_prefill_expanded with the kernel (cache store + one kv_b_proj + the
   kernel), "sdpa" = mla_prefill_expanded with SDPA (the current path, store to out). K2 sizes:
   64 heads, latent 512, nope 128, rope 64, v 128, page 64, bf16 cache. TFLOP/s = the real
   work of causal attention (QK^T at 192 dims and PV at 128 over the visible keys only,
   mla_prefill.prefill_flops) / time, and its % of the matmul rate.
4. the table; with --sweep, the best config per case and the JSON line to paste.
Full output goes to $OUT/mlaflash_bench.txt (mlaflash_bench_sweep.txt with --sweep) when OUT is set.
"""

# ruff: noqa: E501
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402

from k2serve.attention.base import AttentionMetadata  # noqa: E402
from k2serve.attention.triton_mla import TritonMLABackend, mla_prefill_expanded  # noqa: E402
from k2serve.kernels import mla_prefill as mp  # noqa: E402
from k2serve.kernels.policy import device_kind, load_tables  # noqa: E402

H, L, N, R, V, PS = (2, 64, 128, 64, 128, 16) if SMOKE else (64, 512, 128, 64, 128, 64)
DEV = "cpu" if SMOKE else "cuda"
# (name, [(cached, new) per sequence])
CASES = (
    [("T=40", [(0, 40)]), ("T=100", [(0, 100)]), ("varlen", [(16, 24), (0, 24), (16, 24), (0, 24)])]
    if SMOKE
    else [(f"T={t}", [(0, t)]) for t in (1024, 4096, 8192, 16384)]
    + [("4x2048 (2 with 1K cached)", [(1024, 2048), (0, 2048), (1024, 2048), (0, 2048)])]
)
SWEEP = [  # (block_m, block_n, num_warps, num_stages, one_loop, pipe), likeliest first: each
    # fits sm_90 with Triton 3.6 without spills (shared memory 106-221 KB, its sm_90 build)
    (128, 64, 8, 3, 0, 0), (128, 64, 8, 3, 0, 1), (128, 64, 8, 4, 0, 1), (128, 64, 8, 4, 0, 0),
    (128, 32, 8, 3, 0, 1), (128, 64, 8, 2, 0, 0), (128, 64, 8, 3, 1, 0), (128, 64, 8, 4, 1, 0),
    (128, 32, 8, 3, 0, 0), (128, 32, 8, 4, 0, 0), (128, 128, 8, 2, 0, 0), (64, 64, 4, 3, 0, 0),
    (64, 64, 4, 4, 0, 0), (64, 32, 4, 4, 0, 0),
]  # fmt: skip
if SMOKE:
    SWEEP = [(16, 16, 4, 2, 0, 0), (32, 16, 4, 2, 1, 0), (16, 16, 4, 2, 0, 1)]
FAILS: list[str] = []
LINES: list[str] = []


def log(*a) -> None:
    s = " ".join(str(x) for x in a)
    LINES.append(s)
    print(s, flush=True)


def check(name: str, ok: bool, detail: str) -> None:
    log(f"  check {name:44s} {detail:44s} {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append(name)


def timed(fn, iters: int) -> float:
    """Median ms of `iters` calls after 2 warm-ups (CUDA events; perf_counter on the CPU)."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(iters):
        if SMOKE:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def matmul_rate(iters: int) -> float:
    if SMOKE:
        return float("nan")
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = timed(lambda: x @ y, iters)
    return 2 * 8192**3 / ms / 1e9


def build(plan, seed=0):
    """A layer stand-in (what mla_prefill_expanded reads; a bf16 kv_b_proj), a paged bf16 cache
    holding the cached prefixes, the step's inputs and metadata (with host copies)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * s).bfloat16()

    kv_b = torch.nn.Linear(L, H * (N + V), bias=False, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        kv_b.weight.copy_(rnd(H * (N + V), L, s=L**-0.5))
    layer = types.SimpleNamespace(
        num_heads=H, qk_nope_head_dim=N, v_head_dim=V, kv_lora_rank=L, qk_rope_head_dim=R,
        scaling=(N + R) ** -0.5, kv_b_proj=kv_b, backend=TritonMLABackend("expand"),
    )  # fmt: skip
    per = max(-(-(c + q) // PS) for c, q in plan)
    table = torch.arange(len(plan) * per, dtype=torch.int32, device=DEV).view(len(plan), per)
    cache = torch.zeros(len(plan) * per, PS, L + R, dtype=torch.bfloat16, device=DEV)
    for b, (c, _) in enumerate(plan):
        if c:
            pos = torch.arange(c, device=DEV)
            layer.backend.store(
                cache, rnd(c, L), rnd(c, R), (table[b][pos // PS] * PS + pos % PS).long()
            )
    pos = [torch.arange(c, c + q, device=DEV) for c, q in plan]
    slots = torch.cat([table[b][p // PS] * PS + p % PS for b, p in enumerate(pos)]).long()
    import numpy as np

    qsl = np.cumsum([0] + [q for _, q in plan]).astype(np.int32)
    ctx = np.array([c for c, _ in plan], dtype=np.int32)
    md = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(DEV),
        seq_lens=torch.tensor([c + q for c, q in plan], dtype=torch.int32, device=DEV),
        context_lens=torch.from_numpy(ctx).to(DEV), block_table=table, slot_mapping=slots,
        max_query_len=max(q for _, q in plan), max_seq_len=max(c + q for c, q in plan),
        page_size=PS, query_start_loc_host=qsl, context_lens_host=ctx,
    )  # fmt: skip
    T = int(qsl[-1])
    q = rnd(T, H, N + R)
    inputs = (q[..., :N], q[..., N:], rnd(T, L), rnd(T, R))  # q_nope, q_pe views of one q
    return layer, inputs, md, cache


def path(layer, inputs, md, cache, attn: str, config=None):
    """The expanded path with `attn` on its own copy of the layer (its own backend)."""
    cfgs = () if config is None else ({"max_len": None, **config},)
    mine = types.SimpleNamespace(**vars(layer))
    mine.backend = TritonMLABackend("expand", prefill_attn=attn, prefill_configs=cfgs)

    def fn():
        return mla_prefill_expanded(mine, *inputs, md, cache)

    fn.backend = mine.backend
    return fn


def kernel_args(layer, inputs, md, cache):
    """The kernel's own inputs as the path builds them (keys of cached prefixes gathered)."""
    from k2serve.attention.triton_mla import _cached_rows

    qsl, ctx = [int(x) for x in md.query_start_loc_host], [int(x) for x in md.context_lens_host]
    lats, pes, cu = [], [], [0]
    for b, c in enumerate(ctx):
        t0, t1 = qsl[b], qsl[b + 1]
        if c == 0:
            lats.append(inputs[2][t0:t1])
            pes.append(inputs[3][t0:t1])
        else:
            rows = _cached_rows(layer, md, cache, b, c + t1 - t0, torch.bfloat16)
            lats.append(rows[:, :L])
            pes.append(rows[:, L:])
        cu.append(cu[-1] + c + t1 - t0)
    lat, pe = torch.cat(lats), torch.cat(pes)
    kv = layer.kv_b_proj(lat).view(lat.shape[0], H, N + V)
    cu_k = torch.tensor(cu, dtype=torch.int32, device=DEV)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(len(ctx))]
    k_lens = [cu[b + 1] - cu[b] for b in range(len(ctx))]
    args = (inputs[0], inputs[1], kv[..., :N], pe, kv[..., N:], md.query_start_loc, cu_k)
    return args, q_lens, k_lens


def errs(a, b) -> tuple[float, float]:
    a, b = a.float(), b.float()
    return (a - b).abs().max().item(), ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def one_line(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[-1][:160] if msg else ''}"


def run_case(name, plan, mm, iters, sweep, rows, best, deadline):
    """Check then time one case: the SDPA path (its output is the reference), the kernel with
    the policy table's config and (--sweep) each SWEEP config, each on its own (a config that
    fails prints one line), then the whole kernel path with the policy's config (else the
    fastest that ran)."""
    log(f"\n== {name}")
    layer, inputs, md, cache = build(plan)
    sdpa_fn = path(layer, inputs, md, cache, "sdpa")
    ref = sdpa_fn().clone()  # the path stores the new tokens: the kernel's inputs read after
    args, q_lens, k_lens = kernel_args(layer, inputs, md, cache)
    T, mq = sum(q_lens), max(q_lens)
    flops = mp.prefill_flops(q_lens, k_lens, H, N, R, V)
    r32 = None
    if T * max(k_lens) * H <= 2**28:  # float32 reference [H, T, S] fits
        r32 = mp.mla_prefill_ref(*args, layer.scaling)
        ma0, re0 = errs(ref, r32)
        log(f"  sdpa path vs fp32 reference: max {ma0:.2e} rel {re0:.2e}")
    t_sdpa = timed(sdpa_fn, iters)
    tf_sdpa = flops / t_sdpa / 1e9
    log(
        f"  sdpa path (kv_b_proj .. out) {t_sdpa:8.3f} ms ({tf_sdpa:5.0f} TFLOP/s of attention work)"
    )
    policy_cfg = mp.pick_config(load_tables(device_kind(DEV)).mla_prefill, mq)
    cands = [("policy", policy_cfg)]
    if sweep:
        cands += [(str(c), dict(zip(mp.CONFIG_KEYS, c, strict=True))) for c in SWEEP]
    results = {}
    for label, c in cands:
        if label != "policy" and time.monotonic() > deadline:
            log(f"  {label}: skipped (time budget)")
            continue
        try:
            out = torch.full_like(ref, float("nan"))
            mp.mla_prefill_attention(*args, mq, layer.scaling, out=out, config=c)
            ma, re = errs(out, ref)
            ok = math.isfinite(ma) and re < 1e-2 and ma < 0.1
            check(f"{name} {label}: kernel vs sdpa path", ok, f"max {ma:.2e} rel {re:.2e}")
            if r32 is not None and label == "policy":
                (ma1, re1), (_, re2) = errs(out, r32), errs(ref, r32)
                check(f"{name} {label}: kernel vs fp32 ref", re1 < 1e-2 and re1 <= 2 * re2 + 1e-3,
                      f"rel {re1:.2e} (sdpa's {re2:.2e}) max {ma1:.2e}")  # fmt: skip
            if not ok:
                continue
            t = timed(
                lambda c=c, out=out: mp.mla_prefill_attention(
                    *args, mq, layer.scaling, out=out, config=c
                ),
                iters,
            )
            results[label] = (c, t)
            tf = flops / t / 1e9
            log(
                f"  kernel {label:28s} {t:8.3f} ms {tf:6.0f} TFLOP/s ({100 * tf / mm:4.1f}% of mm) {t_sdpa / t:5.2f}x the sdpa path"
            )
        except Exception as e:  # noqa: BLE001 - one failing config, the rest goes on
            log(f"  kernel {label:28s} error {one_line(e)}")
            if label == "policy":
                FAILS.append(f"{name} policy config {c}")
    del r32
    if not results:
        FAILS.append(f"{name}: no kernel config ran")
        return
    fastest = min(results, key=lambda k: results[k][1])
    use = "policy" if "policy" in results else fastest
    c_use, t_use = results[use]
    ours_fn = path(layer, inputs, md, cache, "triton", config=c_use)
    o = ours_fn()
    ma, re = errs(o, ref)
    ran = ours_fn.backend.prefill_attn == "triton"  # not fallen back to SDPA
    check(f"{name}: kernel path ({use}) vs sdpa path", ran and re < 1e-2 and ma < 0.1,
          f"max {ma:.2e} rel {re:.2e}{'' if ran else ' FELL BACK'}")  # fmt: skip
    t_ours = timed(ours_fn, iters)
    log(
        f"  kernel path (kv_b_proj + kernel, {use}) {t_ours:8.3f} ms: {t_sdpa / t_ours:5.2f}x the sdpa path"
    )
    c_f, t_f = results[fastest]
    rows.append(
        (name, t_use, flops / t_use / 1e9, t_f, flops / t_f / 1e9, t_ours, t_sdpa, tf_sdpa, mm)
    )
    if sweep:
        best.append((name, mq, c_f, t_f, flops / t_f / 1e9))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=3 if SMOKE else 10)
    ap.add_argument(
        "--budget",
        type=float,
        default=190.0,
        help="seconds; later sweep configs are skipped after it",
    )
    a = ap.parse_args()
    dev = "cpu (interpreter smoke)" if SMOKE else torch.cuda.get_device_name()
    log(f"mla_prefill_bench: {dev}, torch {torch.__version__}, H={H} L={L} N={N} R={R} V={V}")
    mm = float("nan")
    try:
        mm = matmul_rate(a.iters)
        log(f"ceiling: bf16 matmul 8192^3 {mm:.0f} TFLOP/s")
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
    rows, best = [], []
    deadline = time.monotonic() + a.budget
    for name, plan in CASES:
        try:
            run_case(name, plan, mm, a.iters, a.sweep, rows, best, deadline)
        except Exception:  # noqa: BLE001 - a failing case prints its error, the rest goes on
            FAILS.append(name)
            log(f"  {name}: error\n{traceback.format_exc()}")
        if not SMOKE:
            torch.cuda.empty_cache()
    log(
        f"\n== table (bf16 matmul {mm:.0f} TFLOP/s; TFLOP/s = causal attention work / time; path = kv_b_proj .. out)"
    )
    log(
        f"{'case':28s} {'policy ms':>9s} {'TF/s':>5s} {'% mm':>5s} | {'swept ms':>8s} {'TF/s':>5s} {'% mm':>5s} | {'path ms':>8s} {'sdpa ms':>8s} {'sdpa TF/s':>9s} {'speedup':>7s}"
    )
    for n_, tk, tfk, tb, tfb, to, ts, tfs, m_ in rows:
        log(
            f"{n_:28s} {tk:9.3f} {tfk:5.0f} {100 * tfk / m_:5.1f} | {tb:8.3f} {tfb:5.0f} {100 * tfb / m_:5.1f} | {to:8.3f} {ts:8.3f} {tfs:9.0f} {ts / to:6.2f}x"
        )
    if best:
        log("\n== sweep: best config per case")
        for name, mq, cfg, t, tf in best:
            log(f"{name:28s} max_q {mq:6d} {cfg} {t:8.3f} ms {tf:6.0f} TFLOP/s")
        single = sorted(((mq, cfg) for name, mq, cfg, _, _ in best if name.startswith("T=")),
                        key=lambda x: x[0])  # fmt: skip
        entries = []
        for i, (mq, cfg) in enumerate(single):
            e = {"max_len": None if i == len(single) - 1 else mq,
                 **{k: bool(cfg[k]) if k in ("one_loop", "pipe") else int(cfg[k]) for k in mp.CONFIG_KEYS}}  # fmt: skip
            if entries and all(entries[-1][k] == e[k] for k in mp.CONFIG_KEYS):
                entries[-1]["max_len"] = e["max_len"]  # same config: one wider entry
            else:
                entries.append(e)
        log('"mla_prefill": ' + json.dumps(entries) + ",")
    log(f"\nFAILS: {FAILS}" if FAILS else "\nall checks ok")
    out = os.environ.get("OUT")
    if out:
        fname = "mlaflash_bench_sweep.txt" if a.sweep else "mlaflash_bench.txt"
        with open(os.path.join(out, fname), "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
