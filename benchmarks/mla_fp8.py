"""MLA decode attention over bf16 and fp8 (float8_e4m3fn) latent caches: issue 19's long-context
cases against the copy bandwidth, the code before the rework, and a sweep that picks the policy
table's defaults.

Run (one H100 or H200, from the repo root; < 150 s):  PYTHONPATH=src python3 benchmarks/mla_fp8.py
Options: --cases (default "1x32768,1x131072,8x32768" = batch x context), --no-sweep,
--smoke (the script itself on a CPU through Triton's interpreter: tiny shapes, no graphs, no
PTX; its timings mean nothing), --resources (no GPU needed: builds the decode kernel for sm_90
with triton.compile and prints registers and spill bytes per thread of each tile, read from the
cubin with Triton's bundled cuobjdump).

1. ceiling: the copy bandwidth (read + write bytes of a 2 GiB copy / time, as model_speed.py).
2. checks (exit code 1 on any FAIL): the Triton store writes the torch backend's fp8 bytes; the
   kernel over an fp8 cache (PTX and cast widening) against the torch backend on the same cache
   (mixed lengths, and 32K); a decode CUDA graph replays with changed lengths; every timed
   variant against mla_attention_ref on its own cache (rel err < 1e-2).
3. timing, the attention alone (Kimi-K2 shapes: 64 heads, 512 latent + 64 rope, page 64), per
   case and cache: "default" = the policy table's config (configs/<kind>.json "mla_decode", what
   the engine runs), "before" = the tile and split rule before issue 19's rework (run by today's kernel
   code: its page-id prefetch and merge kernel help it; the old code measured 22-31% of the
   copy bandwidth for bf16 and 0.59-0.71x for fp8/bf16 on an H100), "convert" =
   the table tile with Triton's fp8 cast, "tile" / "splits" = the sweep. Each case cycles over
   enough disjoint copies of the cache (> 256 MiB in all) that the 50-60 MB L2 cannot hold it,
   all calls captured in one CUDA graph: ms per step = replay time / calls. Bytes = the cache
   rows read (context + 1 per sequence) + q in + out; GB/s and % of the copy bandwidth from
   those.
4. report: the issue's table (% of copy bandwidth, fp8/bf16 = bf16 ms / fp8 ms, target >= 0.9;
   B=1 at 128K >= 75%, B=8 at 32K >= 65%), the sweep ranked by the geometric mean over the cases
   of ms / the table's ms, and the winners printed as the table's "mla_decode" lines to paste.
"""

# ruff: noqa: E501, B023
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
H, L, R, PS, SCALE = (4, 32, 16, 16, 0.3) if SMOKE else (64, 512, 64, 64, 0.1352)
DEV = "cpu" if SMOKE else "cuda"
FP8 = torch.float8_e4m3fn
FAILS: list[str] = []
SWEEP = {  # (block_m, block_n, num_warps, num_stages), beside each cache's table tile
    "fp8": [(64, 32, 8, 5), (64, 32, 8, 3), (64, 16, 8, 6), (64, 64, 8, 3), (64, 64, 8, 2)],
    "bf16": [(64, 32, 8, 4), (64, 32, 8, 3), (64, 16, 8, 6), (64, 64, 8, 2)],
}
SPLIT_SWEEP = [
    (1.0, 256),
    (2.0, 256),
    (0.5, 256),
    (1.0, 128),
    (1.0, 512),
    (1.0, 1024),
]  # (waves, min keys)


def log(*a):
    print(*a, flush=True)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, ok: bool, detail: str = "") -> None:
    log(f"  check {name:58s} {detail:24s} {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append(name)


def copy_bw() -> float:
    if SMOKE:
        return float("nan")
    a = torch.empty(1 << 29, device=DEV)  # 2 GiB of float32
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    e1.synchronize()
    gbs = 10 * 2 * a.numel() * 4 / (e0.elapsed_time(e1) / 1e3) / 1e9
    del a, b
    if not SMOKE:
        torch.cuda.empty_cache()
    return gbs


def make_case(B: int, ctx: int, copies: int, dtype: torch.dtype, kv_scale: float = 1.0):
    """`copies` disjoint page sets of B sequences of ctx cached tokens + 1 new one each, in one
    cache written through the Triton store (fp8: the engine's format)."""
    from k2serve.kernels.kv_store import store_latent_kv

    ppseq = -(-(ctx + 1) // PS)
    P = copies * B * ppseq
    kv = torch.empty(P, PS, L + R, dtype=dtype, device=DEV)
    chunk = 1 << 16  # rows per store call
    flat_rows = P * PS
    g = torch.Generator(device=DEV).manual_seed(0)
    for r0 in range(0, flat_rows, chunk):
        n = min(chunk, flat_rows - r0)
        x = torch.randn(n, L + R, device=DEV, generator=g, dtype=torch.bfloat16)
        store_latent_kv(kv, x[:, :L], x[:, L:], torch.arange(r0, r0 + n, device=DEV),
                        kv_scale=kv_scale)  # fmt: skip
    perm = torch.randperm(P, device=DEV, generator=g).int()  # pages scattered
    bts = perm.view(copies, B, ppseq)
    q = torch.randn(B, H, L, device=DEV, dtype=torch.bfloat16, generator=g)
    qp = torch.randn(B, H, R, device=DEV, dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(B + 1, device=DEV, dtype=torch.int32)
    ctx_t = torch.full((B,), ctx, device=DEV, dtype=torch.int32)
    return kv, bts, q, qp, qsl, ctx_t


def run(kv, bt, q, qp, qsl, ctx_t, max_seq, out=None, **kw):
    from k2serve.kernels.mla_attention import mla_attention

    return mla_attention(q, qp, kv, qsl, ctx_t, bt, SCALE, 1, max_seq, out=out, **kw)


def graph_ms(calls, reps: int = 5) -> float:
    """ms per call: all `calls` captured in one CUDA graph, the median of `reps` replays."""
    for c in calls[:2]:
        c()  # compile outside the capture
    if SMOKE:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e3 / len(calls)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / len(calls))
    del g
    return sorted(ts)[len(ts) // 2]


# ---------------------------------------------------------------------------------- checks
def checks() -> None:
    from k2serve.attention import TorchMLABackend, make_attention_backend
    from k2serve.attention.base import AttentionMetadata
    from k2serve.kernels.kv_store import store_latent_kv
    from k2serve.kernels.mla_attention import mla_attention_ref
    from k2serve.model.backends import resolve_backends

    log("checks")
    if not SMOKE:
        choice = resolve_backends("cuda", kv_cache_dtype=FP8)
        be = make_attention_backend(choice.attention, FP8, choice.policy)
        check("resolve_backends(cuda, fp8 cache) takes Triton, graph-safe",
              be.name == "triton" and be.graph_safe, be.name)  # fmt: skip
    # store: the Triton kernel's bytes == the torch backend's, edge values included
    for scale in (1.0, 0.37):
        x = torch.randn(300, L + R, device=DEV) * torch.exp(torch.randn(300, L + R, device=DEV) * 3)
        x.view(-1)[:10] = torch.tensor(
            [447.0, 449.0, 470.0, -1e4, 2**-9, 3 * 2**-11, 2**-6, 0.0, 1.9585, 1.0625]
        )
        x = x.bfloat16()
        slots = torch.randperm(400, device=DEV)[:300]
        slots[::9] = -1
        a = torch.zeros(400 // PS + 1, PS, L + R, dtype=FP8, device=DEV)
        b = a.clone()
        store_latent_kv(a, x[:, :L], x[:, L:], slots, kv_scale=scale)
        TorchMLABackend(kv_scale=scale).store(b, x[:, :L], x[:, L:], slots)
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        check(f"fp8 store bytes == torch backend's (kv_scale {scale})", same)
    # attention on mixed lengths (not multiples of the page), split-KV, both widenings
    ctx = [30, 7, 100, 255] if SMOKE else [300, 77, 1000, 4095]
    B = len(ctx)
    kv, bts, q, qp, qsl, _ = make_case(B, max(ctx), 1, FP8, kv_scale=0.5)
    ctx_t = torch.tensor(ctx, device=DEV, dtype=torch.int32)
    md = AttentionMetadata(query_start_loc=qsl, seq_lens=ctx_t + 1, context_lens=ctx_t,
                           block_table=bts[0], slot_mapping=torch.zeros(B, dtype=torch.long),
                           max_query_len=1, max_seq_len=max(ctx) + 1, page_size=PS)  # fmt: skip
    ref = TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, SCALE)
    outs = {}
    for conv in ("cast",) if SMOKE else ("ptx", "cast"):
        outs[conv] = run(
            kv, bts[0], q, qp, qsl, ctx_t, max(ctx) + 1, kv_scale=0.5, fp8_convert=conv
        )
        e = rel(outs[conv], ref)
        check(f"fp8 decode ({conv}) vs torch backend, ctx {ctx}", e < 1e-2, f"rel_err={e:.2e}")
    if not SMOKE:  # PTX and CUDA graphs need the GPU
        e = rel(outs["ptx"], outs["cast"])
        check("fp8 PTX widening vs cast widening (same values)", e < 1e-3, f"rel_err={e:.2e}")
        # a decode CUDA graph replays with new lengths
        out = torch.empty_like(q)
        run(kv, bts[0], q, qp, qsl, ctx_t, max(ctx) + 1, out=out, kv_scale=0.5)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run(kv, bts[0], q, qp, qsl, ctx_t, max(ctx) + 1, out=out, kv_scale=0.5)
        ctx_t.copy_(torch.tensor([4000, 1, 64, 2000], dtype=torch.int32))
        g.replay()
        md.seq_lens, md.context_lens = ctx_t + 1, ctx_t
        e = rel(out, TorchMLABackend(kv_scale=0.5).forward(q, qp, kv, md, SCALE))
        check("fp8 decode CUDA graph replayed with changed lengths", e < 1e-2, f"rel_err={e:.2e}")
        del kv, g
    # 32K context
    for dtype in (torch.bfloat16, FP8):
        n = 300 if SMOKE else 32768
        kv, bts, q, qp, qsl, ctx_t = make_case(1, n, 1, dtype)
        got = run(kv, bts[0], q, qp, qsl, ctx_t, n + 1)
        e = rel(got, mla_attention_ref(q, qp, kv, qsl, ctx_t, bts[0], SCALE))
        check(
            f"{str(dtype)[6:]} decode B=1 ctx {n} vs mla_attention_ref",
            e < 1e-2,
            f"rel_err={e:.2e}",
        )
        del kv
    if not SMOKE:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- timing
def table_config(fp8: bool) -> dict:
    """The decode config the engine uses on this GPU (configs/<kind>.json, "mla_decode")."""
    from k2serve.kernels.policy import KernelPolicy, device_kind, load_tables

    kind = device_kind("cuda") if torch.cuda.is_available() else "cpu"
    return KernelPolicy(tables=load_tables(kind)).mla_decode_config(fp8)


def tile_name(c: dict) -> str:
    qk = "" if c.get("split_qk", True) else " QK unsplit"
    return f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c.get('num_stages', 2)}{qk}"


def old_splits(B: int, row_blocks: int, max_seq_len: int, block_n: int) -> int:
    """The split rule before issue 19's rework (at most 64, powers of two), for "before"."""
    want = max(1, 264 // max(1, B * row_blocks))
    tiles = max(1, -(-max_seq_len // block_n))
    if B <= 2:
        n = min(want, tiles, 64)
        return min(64, 1 << (n - 1).bit_length())
    n = min(want, max(1, tiles // 2), 64)
    return 1 << (n.bit_length() - 1)


def variants(B: int, ctx: int, sweep: bool):
    """(cache, group, name, kwargs): group "default" / "before" / "tile" / "splits"."""
    from k2serve.kernels.mla_attention import _pick_splits, sm_count

    sms = sm_count(torch.device(DEV))
    for cache in ("bf16", "fp8"):
        d = table_config(cache == "fp8")
        yield cache, "default", f"table: {tile_name(d)}", {"config": d}
        if cache == "fp8" and not SMOKE:
            yield (
                cache,
                "convert",
                "table tile, Triton's cast widening",
                {"config": d, "fp8_convert": "cast"},
            )
        old = (
            dict(block_m=16, block_n=64, num_warps=4)
            if cache == "bf16"
            else dict(block_m=32, block_n=32, num_warps=8)
        )
        old.update(num_stages=2, split_qk=False)
        n_old = old_splits(B, -(-H // old["block_m"]), ctx + 1, old["block_n"])
        yield (
            cache,
            "before",
            f"old tile + split rule: {tile_name(old)}, {n_old} splits",
            {"config": old, "num_splits": n_old},
        )
        if not sweep:
            continue
        tiles = [dict(d, split_qk=False)]  # the table's tile, both warpgroups computing all QK
        tiles += [
            dict(d, block_m=bm, block_n=bn, num_warps=w, num_stages=st)
            for bm, bn, w, st in SWEEP[cache]
        ]
        for c in tiles:
            if tile_name(c) != tile_name(d):
                yield cache, "tile", f"tile {tile_name(c)}", {"config": c}
        for waves, msk in SPLIT_SWEEP:
            if (waves, msk) == (d["waves"], d["min_split_keys"]):
                continue  # the table's rule: the "default" row
            c = dict(d, waves=waves, min_split_keys=msk)
            n = _pick_splits(B, -(-H // d["block_m"]), ctx + 1, sms, waves, msk, d["max_splits"])
            yield cache, "splits", f"waves={waves} min_split_keys={msk} ({n} splits)", {"config": c}


def bench_case(B: int, ctx: int, bw: float, sweep: bool, rows: list) -> None:
    budget = 256 << 20
    label = f"B={B} ctx={ctx // 1024}K" if ctx >= 1024 else f"B={B} ctx={ctx}"
    allv = list(variants(B, ctx, sweep))
    for cache in ("bf16", "fp8"):
        dtype = torch.bfloat16 if cache == "bf16" else FP8
        per_copy = B * (ctx + 1) * (L + R) * dtype.itemsize
        copies = 2 if SMOKE else max(2, -(-budget // per_copy))
        kv, bts, q, qp, qsl, ctx_t = make_case(B, ctx, copies, dtype)
        nbytes = per_copy + B * H * (L + R) * 2 + B * H * L * 2
        base = mla_ref_out = None
        if not SMOKE or ctx <= 4096:
            from k2serve.kernels.mla_attention import mla_attention_ref

            mla_ref_out = mla_attention_ref(q, qp, kv, qsl, ctx_t, bts[0], SCALE)
        calls_per = copies if SMOKE else max(copies, 8)
        for c, group, name, kw in allv:
            if c != cache:
                continue
            try:
                out = run(kv, bts[0], q, qp, qsl, ctx_t, ctx + 1, **kw)
                base = out if base is None else base
                e = rel(out, mla_ref_out if mla_ref_out is not None else base)
                outs = [torch.empty_like(q) for _ in range(copies)]
                calls = [
                    (lambda i=i, kv=kv, bt=bts[i % copies], kw=kw: run(kv, bt, q, qp, qsl, ctx_t, ctx + 1, out=outs[i % copies], **kw))
                    for i in range(calls_per)
                ]  # fmt: skip
                ms = graph_ms(calls)
            except Exception as ex:  # noqa: BLE001 - a tile that does not build is reported
                log(f"  {cache} {name} B={B} ctx={ctx}: {type(ex).__name__}: {str(ex)[:160]}")
                continue
            if e > 1e-2:
                FAILS.append(f"{cache} {name} B={B} ctx={ctx} rel_err={e:.2e}")
            gbs = nbytes / (ms / 1e3) / 1e9
            rows.append(dict(case=label, cache=cache, group=group, name=name, kw=kw, ms=ms,
                             nbytes=nbytes, gbs=gbs, pct=100 * gbs / bw, err=e))  # fmt: skip
        del kv, bts
        if not SMOKE:
            torch.cuda.empty_cache()


def report(rows: list, cases: list[str]) -> None:
    """Every timing, then the issue's table (defaults, before, best) and the sweep's winners in
    the form of configs/h100.json's "mla_decode" entry."""
    import json
    import math

    log("\n| case | cache | group | variant | ms | MB read | GB/s | % copy bw | rel err |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['case']} | {r['cache']} | {r['group']} | {r['name']} | {r['ms']:.4f} | "
            f"{r['nbytes'] / 1e6:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | {r['err']:.1e} |")  # fmt: skip

    def get(case, cache, group):
        rs = [r for r in rows if r["case"] == case and r["cache"] == cache and r["group"] == group]
        return rs[0] if rs else None

    def best(case, cache):
        rs = [
            r for r in rows if r["case"] == case and r["cache"] == cache and r["group"] != "before"
        ]
        return min(rs, key=lambda r: r["ms"]) if rs else None

    targets = {"B=1 ctx=128K": 75.0, "B=8 ctx=32K": 65.0}
    log("\nissue 19 (attention alone, % of copy bandwidth for the latent cache bytes read):")
    log(
        "| case | bf16 before | bf16 table | fp8 before | fp8 table | best bf16 | best fp8 | fp8/bf16 table | fp8/bf16 best | target |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|")
    for case in dict.fromkeys(r["case"] for r in rows):
        v = {
            k: get(case, *k)
            for k in (
                ("bf16", "before"),
                ("bf16", "default"),
                ("fp8", "before"),
                ("fp8", "default"),
            )
        }
        if not all(v.values()):
            continue
        bb, fb = best(case, "bf16"), best(case, "fp8")
        r_tab = v[("bf16", "default")]["ms"] / v[("fp8", "default")]["ms"]
        r_best = bb["ms"] / fb["ms"]
        t = targets.get(case)
        tgt = (
            ""
            if t is None
            else (
                f">= {t:.0f}%: "
                + (
                    "met"
                    if max(v[("bf16", "default")]["pct"], v[("fp8", "default")]["pct"]) >= t
                    else "MISSED"
                )
            )
        )
        cells = " | ".join(f"{v[k]['pct']:.0f}% ({v[k]['ms']:.3f} ms)" for k in v)
        log(
            f"| {case} | {cells} | {bb['pct']:.0f}% | {fb['pct']:.0f}% | **{r_tab:.2f}x** {'ok' if r_tab >= 0.9 else 'BELOW 0.9'} | {r_best:.2f}x | {tgt} |"
        )

    # winners: the geometric mean over the cases of ms / the table default's ms
    log(
        "\nsweep (geometric mean over the cases of ms / the table's ms; < 1 = faster than the table):"
    )
    pick = {}
    for cache in ("bf16", "fp8"):
        for group in ("tile", "splits"):
            scores = {}
            for r in rows:
                if r["cache"] != cache or r["group"] not in (group, "default"):
                    continue
                d = get(r["case"], cache, "default")
                scores.setdefault(r["name"] if r["group"] == group else "(table)", []).append(
                    (r["ms"] / d["ms"], r["kw"]))  # fmt: skip
            full = {k: v for k, v in scores.items() if len(v) == len(cases)}
            if len(full) <= 1:
                continue
            ranked = sorted(full.items(), key=lambda kv: math.prod(x for x, _ in kv[1]))
            for name, v in ranked:
                g = math.prod(x for x, _ in v) ** (1 / len(v))
                log(
                    f"  {cache:4s} {group:6s} {g:6.3f}  {name}  (per case: {', '.join(f'{x:.3f}' for x, _ in v)})"
                )
            pick[(cache, group)] = ranked[0][1][0][1].get("config", {})
    tab = {c: table_config(c == "fp8") for c in ("bf16", "fp8")}
    entry = {}
    for cache in ("bf16", "fp8"):
        c = pick.get((cache, "tile")) or tab[cache]
        entry[cache] = {
            k: c[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "split_qk")
        }
    sp = pick.get(("fp8", "splits")) or pick.get(("bf16", "splits")) or tab["fp8"]
    entry.update({k: sp[k] for k in ("waves", "min_split_keys", "max_splits")})
    log('\nwinners as configs/h100.json "mla_decode" (split rule: the fp8 cache\'s winner):')
    for k, v in entry.items():
        log(f'    "{k}": {json.dumps(v)},')


def resources() -> None:
    """Registers / spill (stack) bytes per thread of each decode tile built for sm_90."""
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from k2serve.kernels import mla_attention as mla

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    log(
        "| cache | tile (rows x keys, warps, stages) | registers | spill bytes/thread | shared bytes |"
    )
    log("|---|---|---|---|---|")
    for cache in ("bf16", "fp8"):
        d = table_config(cache == "fp8")
        tiles = [(d["block_m"], d["block_n"], d["num_warps"], d["num_stages"], True)]
        tiles += [tiles[0][:4] + (False,)] + [t + (True,) for t in SWEEP[cache]]
        for bm, bn, w, st, qk in dict.fromkeys(tiles):
            sig = dict(q_lat_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*bf16" if cache == "bf16" else "*u8",
                       qsl_ptr="*i32", ctx_ptr="*i32", bt_ptr="*i32", out_ptr="*fp32", lse_ptr="*fp32",
                       bt_stride="i32", sm_scale="fp32", kv_scale="fp32", SPLITS="i32")  # fmt: skip
            cons = dict(H=H, L=L, R=R, PS=PS, BLOCK_M=bm, BLOCK_N=bn, DIRECT=False,
                        DOT_DT=tl.bfloat16, KV_FP8=0 if cache == "bf16" else 2, SPLIT_QK=qk)  # fmt: skip
            sig.update({k: "constexpr" for k in cons})
            # pointers 16-byte aligned and the strides multiples of 16, as the JIT specializes
            attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
                     if t.startswith("*") or n in ("bt_stride", "SPLITS")}  # fmt: skip
            k = triton.compile(ASTSource(mla._mla_fwd_kernel, sig, constexprs=cons, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w, num_stages=st))  # fmt: skip
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                txt = subprocess.run(
                    [tool, "-res-usage", f.name], capture_output=True, text=True
                ).stdout
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", txt, re.S)
            reg, stack = m.groups() if m else ("?", "?")
            log(
                f"| {cache} | {bm} x {bn}, {w} warps, {st} stages{'' if qk else ', QK unsplit'} | {reg} | {stack} | {k.metadata.shared} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x32768,1x131072,8x32768")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter run of the script")
    ap.add_argument("--resources", action="store_true", help="sm_90 registers/spills, no GPU")
    args = ap.parse_args()
    if args.resources:
        resources()
        return 0
    if SMOKE:
        args.cases = "1x100,2x70"
    elif not torch.cuda.is_available():
        log("needs a CUDA GPU (or --smoke)")
        return 2
    else:
        log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import triton

    log(f"triton {triton.__version__}")
    t0 = time.perf_counter()
    checks()
    bw = copy_bw()
    log(f"ceiling: copy {bw:.0f} GB/s (read+write)")
    rows: list = []
    for case in args.cases.split(","):
        B, ctx = (int(v) for v in case.split("x"))
        bench_case(B, ctx, bw, not args.no_sweep, rows)
    report(rows, args.cases.split(","))
    log(f"\n{time.perf_counter() - t0:.0f} s")
    if FAILS:
        log(f"\nchecks failed: {FAILS}")
        return 1
    log("\nall checks ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
