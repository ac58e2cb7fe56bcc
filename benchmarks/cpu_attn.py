"""CPU attention of one Kimi-K2 layer against the CPU's read bandwidth and matmul rate, one run.

Real K2 shapes (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64, nope / v 128), bf16
weights, dummy values. Parts, as the model runs them on the CPU (model/deepseek_v3.py):
- projections (fused q_a + kv_a 2112x7168, q_b 12288x1536, o_proj 7168x8192; 197 MB) at 1, 4,
  16 rows: the model's `linear()` (the CPU kernel's bf16 GEMV, kernels/cpu) against
  torch's F.linear on the same weights, each over enough distinct copies to miss the caches;
- the absorbed kv_b_proj (W_UK, W_UV^T as two bmm, 16.8 MB);
- MLA decode over a bf16 latent cache of 8K and 32K tokens (TorchMLABackend: bytes read = the
  context's latents, 1,152 bytes per token), on shuffled pages;
- MLA prefill: --prefill-queries new queries at the end of an 8K / 32K context, FLOP/s against
  torch's float32 and bf16 matmul rate measured in the same run.
The decode runs three ways: the backend's default (bf16: the native kernel, kernels/cpu/k2mla.h,
on AMX where the CPU has it), torch's CPU flash kernel (attention/cpu_flash.py, forced for every
decode: cpu_kernel=False, DECODE_MIN_KEYS=0) and, as 'ref', the float32 einsums (cpu_flash=False,
the path before); plus the kernel's vdpbf16ps path (the one CPUs without AMX get) and a
speculative verify step of --verify-tokens tokens (kernel vs flash). The prefill runs the flash
path (the backend's choice for prompts) and the einsums. First a check of the kernel's and the
flash path's results against the einsums on the same inputs (max abs difference, next to the
bf16 rounding of the einsum result itself).

    python benchmarks/cpu_attn.py                # all of it
    python benchmarks/cpu_attn.py --contexts 8192 --prefill-queries 128 --no-ref
    python benchmarks/cpu_attn.py --rows 1 --prefill-queries 0 --define K2_MLA_KC=512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from k2serve.attention import cpu_flash  # noqa: E402
from k2serve.attention.base import AttentionMetadata  # noqa: E402
from k2serve.attention.torch_ref import TorchMLABackend  # noqa: E402
from k2serve.kernels.cpu import mla as cpu_mla  # noqa: E402
from k2serve.quant.linear import linear  # noqa: E402

D, NH, QL, KL, RO, NO, VD = 7168, 64, 1536, 512, 64, 128, 128
PROJ = {"qkv_a": (QL + KL + RO, D), "q_b": (NH * (NO + RO), QL), "o_proj": (D, NH * VD)}
PROJ_BYTES = sum(n * k for n, k in PROJ.values()) * 2
KVB_BYTES = NH * (NO + VD) * KL * 2
SCALE = (NO + RO) ** -0.5  # K2's softmax scale before the YaRN mscale


def timeit(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def proj_weights(copies: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {k: (torch.randn(n, kk, generator=g) * kk**-0.5).bfloat16() for k, (n, kk) in PROJ.items()}
        for _ in range(copies)
    ]


def time_projections(ws: list[dict], rows: int, fn, reps: int = 5) -> float:
    """Seconds for one layer's projections (mean over the copies: each copy is cold)."""
    x = {k: torch.randn(rows, kk).bfloat16() for k, (_, kk) in PROJ.items()}

    def run():
        for w in ws:
            for k in PROJ:
                fn(x[k], w[k])

    return timeit(run, reps) / len(ws)


def time_absorb(copies: int, rows: int = 1, reps: int = 5) -> float:
    wk = [torch.randn(NH, NO, KL).bfloat16() for _ in range(copies)]
    wv = [torch.randn(NH, KL, VD).bfloat16() for _ in range(copies)]
    qn, ol = torch.randn(NH, rows, NO).bfloat16(), torch.randn(NH, rows, KL).bfloat16()

    def run():
        for a, b in zip(wk, wv, strict=True):
            torch.bmm(qn, a)
            torch.bmm(ol, b)

    return timeit(run, reps) / copies


def mla_case(ctx: int, n_new: int, page: int = 64, shuffle: bool = True):
    """(q_latent, q_pe, kv_cache, metadata) for n_new queries after ctx cached tokens, on
    shuffled pages (a served sequence's pages are not always one run) or on pages 0, 1, ..."""
    g = torch.Generator().manual_seed(ctx + n_new)
    S = ctx + n_new
    pages = -(-S // page)
    kv = torch.randn(pages, page, KL + RO, generator=g).bfloat16()
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n_new], dtype=torch.int32),
        seq_lens=torch.tensor([S], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32),
        block_table=(torch.randperm(pages, generator=g) if shuffle else torch.arange(pages))
        .to(torch.int32)[None],
        slot_mapping=torch.arange(ctx, S, dtype=torch.int64),
        max_query_len=n_new, max_seq_len=S, page_size=page, num_decodes=int(n_new == 1),
    )  # fmt: skip
    # queries of a trained model's scale: softmax neither uniform nor one-hot
    ql = (torch.randn(n_new, NH, KL, generator=g) * 0.5).bfloat16()
    qp = (torch.randn(n_new, NH, RO, generator=g) * 0.5).bfloat16()
    return ql, qp, kv, md


def backend(mode: str) -> TorchMLABackend:
    """'auto': the backend's default choice; 'flash': torch's flash kernel for every bf16
    sequence; 'ref': the float32 einsums."""
    if mode == "ref":
        return TorchMLABackend(cpu_flash=False)
    return TorchMLABackend(cpu_kernel=mode == "auto")


def forced_flash(fn):
    """fn() with every decode on the flash path (no DECODE_MIN_KEYS cut-off)."""
    keep, cpu_flash.DECODE_MIN_KEYS = cpu_flash.DECODE_MIN_KEYS, 0
    try:
        return fn()
    finally:
        cpu_flash.DECODE_MIN_KEYS = keep


def time_mla(ctx: int, n_new: int, reps: int = 3, flash: bool = True, shuffle=True,
             mode: str = "auto", copies: int = 1) -> float:  # fmt: skip
    """Seconds for one layer's MLA of n_new queries after ctx tokens (flash=False: 'ref');
    copies > 1: the mean over that many distinct caches (as the model's layers: a cache that
    misses the CPU's caches is read from DRAM)."""
    ql, qp, kv, md = mla_case(ctx, n_new, shuffle=shuffle)
    kvs = [kv] + [kv.clone() for _ in range(copies - 1)]
    mode = mode if flash else "ref"
    be = backend(mode)

    def layers():
        for k in kvs:
            be.forward(ql, qp, k, md, SCALE)

    run = lambda: timeit(layers, reps) / copies  # noqa: E731
    return forced_flash(run) if mode == "flash" else run()


def time_kernel(ctx: int, n_new: int, path: int, reps: int = 3) -> float:
    """The native kernel alone on one path (nan where it does not run here)."""
    ql, qp, kv, md = mla_case(ctx, n_new)
    out = torch.empty(n_new, NH, KL, dtype=torch.bfloat16)
    pages, S = md.block_table[0], ctx + n_new
    if cpu_mla.mla_decode(ql, qp, kv, pages, S, SCALE, out, path) != path:
        return float("nan")
    return timeit(lambda: cpu_mla.mla_decode(ql, qp, kv, pages, S, SCALE, out, path), reps)


def check_mla(ctx: int, n_new: int, mode: str = "auto") -> str:
    """The bf16 path (`mode`) vs the float32 einsums on the same bf16 inputs."""
    ql, qp, kv, md = mla_case(ctx, n_new)
    run = lambda: backend(mode).forward(ql, qp, kv, md, SCALE).float()  # noqa: E731
    fast = forced_flash(run) if mode == "flash" else run()
    ref = TorchMLABackend(cpu_flash=False).forward(ql.float(), qp.float(), kv, md, SCALE)
    err, rnd = (fast - ref).abs().max().item(), (ref.bfloat16().float() - ref).abs().max().item()
    name = "flash" if mode == "flash" else f"default ({decode_path(n_new)})"
    return (f"# check ctx {ctx} + {n_new} new: max|{name} - f32 einsum| {err:.2e} (bf16 rounding "
            f"of the f32 result: {rnd:.2e}; |f32| max {ref.abs().max().item():.2f})")  # fmt: skip


def decode_path(n_new: int = 1) -> str:
    """What the backend runs for a bf16 decode of n_new tokens on this CPU (scattered pages)."""
    from k2serve.attention.torch_ref import KERNEL_MAX_TOKENS

    paths = cpu_mla.mla_paths() if n_new <= KERNEL_MAX_TOKENS else []
    if cpu_mla.PATH_AMX in paths:
        return "native kernel, AMX"
    if cpu_mla.PATH_AVX512 in paths and n_new == 1:
        return "native kernel, vdpbf16ps (short contexts)"
    return "torch flash / einsums"


def mla_flops(ctx: int, n_new: int) -> float:
    """Scores (L + R) and output (L) products of n_new causal queries after ctx tokens."""
    keys = n_new * ctx + n_new * (n_new + 1) / 2
    return 2 * NH * keys * (KL + RO + KL)


def matmul_rate(dtype: torch.dtype, n: int = 2048, reps: int = 3) -> float:
    a = torch.randn(n, n).to(dtype)
    return 2 * n**3 / timeit(lambda: a @ a, reps) / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--copies", type=int, default=4, help="distinct weight copies (> the LLC)")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--prefill-queries", type=int, default=256)
    ap.add_argument("--bw-gib", type=float, default=2.0)
    ap.add_argument("--no-ref", action="store_true", help="skip timing the float32 einsums")
    ap.add_argument("--verify-tokens", type=int, default=4, help="a verify step's tokens")
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE: build a kernel variant (its own cache entry)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.define:
        from k2serve.kernels import cpu as ck

        ck.CXX_FLAGS = ck.CXX_FLAGS + tuple(f"-D{d}" for d in args.define)
    from cpu_e2e import read_bandwidth  # benchmarks/cpu_e2e.py

    bw = read_bandwidth(args.bw_gib)
    f32, bf16 = matmul_rate(torch.float32), matmul_rate(torch.bfloat16)
    print(f"# cpu_attn: K2 attention, {torch.get_num_threads()} threads, torch {torch.__version__};"
          f" read bandwidth {bw:.1f} GB/s; torch matmul 2048^2: float32 {f32:.2f} TFLOP/s, "
          f"bf16 {bf16:.2f} TFLOP/s")  # fmt: skip
    ws = proj_weights(args.copies)
    print(f"# projections: {PROJ_BYTES / 1e6:.0f} MB per layer ({args.copies} copies, cold)")
    print(f"{'rows':>5} {'kernel ms':>10} {'GB/s':>6} {'of BW':>6} {'torch ms':>9} {'GB/s':>6} "
          f"{'of BW':>6} {'x torch':>8}")  # fmt: skip
    for rows in [int(r) for r in args.rows.split(",") if r]:
        tk = time_projections(ws, rows, linear)
        tt = time_projections(ws, rows, F.linear)
        gk, gt = PROJ_BYTES / tk / 1e9, PROJ_BYTES / tt / 1e9
        print(f"{rows:>5} {tk * 1e3:>10.3f} {gk:>6.1f} {gk / bw:>6.0%} {tt * 1e3:>9.3f} "
              f"{gt:>6.1f} {gt / bw:>6.0%} {tt / tk:>8.2f}")  # fmt: skip
    del ws
    ta = time_absorb(max(args.copies, 8))
    print(f"# absorbed kv_b (W_UK, W_UV^T bmm, 1 token): {ta * 1e3:.3f} ms, "
          f"{KVB_BYTES / ta / 1e9:.1f} GB/s = {KVB_BYTES / ta / 1e9 / bw:.0%} of BW")  # fmt: skip
    ctxs = [int(c) for c in args.contexts.split(",") if c]
    n = args.prefill_queries
    print(
        f"# decode path here: {decode_path()}; kernel paths that run: "
        f"{[cpu_mla.PATH_NAMES[p] for p in cpu_mla.mla_paths()]}, defines {args.define}"
    )
    for ctx in ctxs[:1]:
        print(check_mla(ctx, 1))
        print(check_mla(ctx, 1, "flash"))
        if args.verify_tokens > 1:
            print(check_mla(ctx - args.verify_tokens, args.verify_tokens))
        if n:
            print(check_mla(ctx - n, n))
    print(f"{'context':>8} {'decode ms':>10} {'GB/s':>6} {'TFLOP/s':>8} {'of bf16':>8} "
          f"{'flash ms':>9} {'ref ms':>7} {'x flash':>8} {'x ref':>6} {'vdpbf16':>8}")  # fmt: skip
    for ctx in ctxs:
        td = time_mla(ctx, 1, reps=5)
        tf = time_mla(ctx, 1, reps=5, mode="flash")
        tdr = float("nan") if args.no_ref else time_mla(ctx, 1, flash=False)
        tv = time_kernel(ctx, 1, cpu_mla.PATH_AVX512, reps=2)
        nb = (ctx + 1) * (KL + RO) * 2
        rd = mla_flops(ctx, 1) / td / 1e12
        print(f"{ctx:>8} {td * 1e3:>10.3f} {nb / td / 1e9:>6.1f} {rd:>8.3f} {rd / bf16:>8.0%} "
              f"{tf * 1e3:>9.3f} {tdr * 1e3:>7.2f} {tf / td:>8.2f} {tdr / td:>6.1f} "
              f"{tv * 1e3:>8.2f}")  # fmt: skip
    v = args.verify_tokens
    if v > 1:
        for ctx in ctxs:
            tk, tf = time_mla(ctx - v, v, reps=5), time_mla(ctx - v, v, reps=5, mode="flash")
            print(f"# verify step, {v} tokens at {ctx}: default {tk * 1e3:.3f} ms "
                  f"({decode_path(v)}), flash {tf * 1e3:.3f} ms, x flash {tf / tk:.2f}, "
                  f"{mla_flops(ctx - v, v) / tk / 1e12:.3f} TFLOP/s")  # fmt: skip
    if n:
        print(f"{'context':>8} {'prefill q':>10} {'ms':>8} {'TFLOP/s':>8} {'of f32':>7} "
              f"{'of bf16':>8} {'ref ms':>8} {'x ref':>6} {'ms/2K q':>8}")  # fmt: skip
    for ctx in ctxs if n else []:
        tp = time_mla(ctx - n, n, reps=1)
        tpr = float("nan") if args.no_ref else time_mla(ctx - n, n, 1, flash=False)
        rate = mla_flops(ctx - n, n) / tp / 1e12
        print(f"{ctx:>8} {n:>10} {tp * 1e3:>8.1f} {rate:>8.3f} {rate / f32:>7.0%} "
              f"{rate / bf16:>8.0%} {tpr * 1e3:>8.1f} {tpr / tp:>6.1f} "
              f"{tp * 2048 / n * 1e3:>8.0f}")  # fmt: skip
    hr = cpu_flash.HEAD_ROWS
    for rows in (hr, NH):  # a decode's heads: blocks of HEAD_ROWS rows vs one block of NH
        cpu_flash.HEAD_ROWS = rows
        print(f"# flash decode at {ctxs[0]}, {rows} rows per kernel head: "
              f"{time_mla(ctxs[0], 1, reps=5, mode='flash') * 1e3:.2f} ms")  # fmt: skip
    cpu_flash.HEAD_ROWS = hr
    print(f"# decode at {ctxs[0]} on pages 0, 1, ... (read in place): default "
          f"{time_mla(ctxs[0], 1, reps=5, shuffle=False) * 1e3:.3f} ms, flash "
          f"{time_mla(ctxs[0], 1, reps=5, shuffle=False, mode='flash') * 1e3:.2f} ms")  # fmt: skip
    print(
        "# decode: one query over the context, shuffled pages (bytes = its bf16 latents; "
        "FLOP/s of the useful products, vs the bf16 matmul rate; 'decode ms': the backend's "
        "default path, 'flash ms': torch's flash kernel, 'ref': the float32 einsums, the path "
        "before; 'vdpbf16': the native kernel's non-AMX path); prefill: the last 'prefill q' "
        "queries of that context; 'ms/2K q': scaled to 2,048 such queries"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
