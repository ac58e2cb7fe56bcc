"""CPU attention of one Kimi-K2 layer against the CPU's read bandwidth and matmul rate, one run.

Real K2 shapes (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64, nope / v 128), bf16
weights, dummy values. Parts, as the model runs them on the CPU (model/deepseek_v3.py):
- projections (fused q_a + kv_a 2112x7168, q_b 12288x1536, o_proj 7168x8192; 197 MB) at 1, 4,
  16 rows: the model's `linear()` (the CPU kernel's bf16 GEMV, kernels/cpu) against
  torch's F.linear on the same weights, each over enough distinct copies to miss the caches;
- the absorbed kv_b_proj (W_UK, W_UV^T as two bmm, 16.8 MB);
- MLA decode over a bf16 latent cache of 8K and 32K tokens (TorchMLABackend: bytes read = the
  context's latents, 1,152 bytes per token);
- MLA prefill: --prefill-queries new queries at the end of an 8K / 32K context (the backend
  computes in float32, in query chunks), FLOP/s against torch's float32 and bf16 matmul rate
  measured in the same run.

    python benchmarks/cpu_attn.py                # all of it
    python benchmarks/cpu_attn.py --contexts 8192 --prefill-queries 128
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from k2serve.attention.base import AttentionMetadata  # noqa: E402
from k2serve.attention.torch_ref import TorchMLABackend  # noqa: E402
from k2serve.quant.linear import linear  # noqa: E402

D, NH, QL, KL, RO, NO, VD = 7168, 64, 1536, 512, 64, 128, 128
PROJ = {"qkv_a": (QL + KL + RO, D), "q_b": (NH * (NO + RO), QL), "o_proj": (D, NH * VD)}
PROJ_BYTES = sum(n * k for n, k in PROJ.values()) * 2
KVB_BYTES = NH * (NO + VD) * KL * 2


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


def mla_case(ctx: int, n_new: int, page: int = 64):
    """(q_latent, q_pe, kv_cache, metadata) for n_new queries after ctx cached tokens."""
    S = ctx + n_new
    pages = -(-S // page)
    kv = torch.randn(pages, page, KL + RO).bfloat16()
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, n_new], dtype=torch.int32),
        seq_lens=torch.tensor([S], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32),
        block_table=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(ctx, S, dtype=torch.int64),
        max_query_len=n_new, max_seq_len=S, page_size=page, num_decodes=int(n_new == 1),
    )  # fmt: skip
    return torch.randn(n_new, NH, KL).bfloat16(), torch.randn(n_new, NH, RO).bfloat16(), kv, md


def time_mla(ctx: int, n_new: int, reps: int = 3) -> float:
    ql, qp, kv, md = mla_case(ctx, n_new)
    be = TorchMLABackend()
    return timeit(lambda: be.forward(ql, qp, kv, md, 0.1), reps)


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
    args = ap.parse_args(argv)
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
    print(f"{'context':>8} {'decode ms':>10} {'GB/s':>6} {'of BW':>6} {'prefill q':>10} "
          f"{'ms':>9} {'TFLOP/s':>8} {'of f32':>7} {'of bf16':>8} {'ms/2K q':>9}")  # fmt: skip
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        td = time_mla(ctx, 1)
        nb = (ctx + 1) * (KL + RO) * 2
        n = args.prefill_queries
        tp = time_mla(ctx - n, n, reps=1) if n else float("nan")
        rate = mla_flops(ctx - n, n) / tp / 1e12
        print(f"{ctx:>8} {td * 1e3:>10.2f} {nb / td / 1e9:>6.1f} {nb / td / 1e9 / bw:>6.0%} "
              f"{n:>10} {tp * 1e3:>9.1f} {rate:>8.3f} {rate / f32:>7.0%} {rate / bf16:>8.0%} "
              f"{tp * 2048 / max(n, 1) * 1e3:>9.0f}")  # fmt: skip
    print(
        "# decode: one query over the context (bytes = its bf16 latents); prefill: the last "
        "'prefill q' queries of that context; 'ms/2K q': scaled to 2,048 such queries"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
