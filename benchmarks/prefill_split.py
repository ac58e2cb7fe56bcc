# ruff: noqa: E741, E501
"""A K2 MoE layer's two prompt GEMMs timed apart, per tile config (issue 28): which tile each
GEMM wants. gate_up (N = 2 x 2048, K = 7168: long K) and down (N = 7168, K = 2048: a quarter of
the K steps, the same output tiles a pair) need not want the same tile; the kernel tables give
both GEMMs one config.

Run (repo root, one H100 / H200): PYTHONPATH=src python3 benchmarks/prefill_split.py
    [--format int4|fp8] [--ts 8192,16384] [--routing uniform,third] [--configs NAME,...]
Config names: INT4 gluon_int4_device.cfg_of's ("128x256s4w8hlgxxe2"), FP8 fp8_gluon_device.cfg_of's
("128x128k64s6w8pfxxe2"); "table" = the device's table entry for the pair count (the engine's).
Each config's two outputs are checked against the table's (rel diff; the same sums in the same
order give 0) before they are timed (CUDA-event medians); TFLOP/s per GEMM (2 * M * N * K) and
the layer's sum. One K2 layer: E=384, D=7168, I=2048, top-8; routing uniform or "third" (every
token's experts from a fixed third: the k2-slice's dummy router).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fp8_gluon_device as fd  # noqa: E402 - FP8 config names, FP8 experts
import gluon_int4_device as gd  # noqa: E402 - INT4 config names, rel
import model_speed as ms  # noqa: E402 - timed, INT4 experts
import prefill_device as pd  # noqa: E402 - route

E, D, I, K = 384, 7168, 2048, 8


def gemms(fmt, ew, x, tw, ids, cfg):
    """(gate_up(), down(h)) of one config: gate_up returns the bf16 intermediate [M, I]
    (SiLU-and-mul applied), down the pair rows [M, D]; both launches as the engine's path makes
    them (int4_gemm.int4_moe_gemm / fp8_gemm_gluon.fp8_moe_gluon: the two launch functions
    take the same operands; the INT4 one's gate_up stores in gemm order, the FP8 one's says
    whether its epilogue applies the SiLU)."""
    from k2serve.kernels import fp8_gemm_gluon as fg
    from k2serve.kernels import int4_gemm_gluon as gg
    from k2serve.kernels.int4_gemm import to_gemm_order

    M = x.shape[0] * K
    twf = tw.reshape(-1).float().contiguous()
    sid, eids, npost, units = gg.gluon_align(ids, E, cfg)
    if fmt == "int4":
        silu = bool(cfg.get("SILU"))
        launch, a, flag, h_dtype = gg.gemm_gluon, to_gemm_order(x, cfg["W2"]), True, torch.bfloat16
    else:
        silu = bool(cfg.get("SILU", fg.CONFIG_DEFAULTS["SILU"]))
        launch, a, flag = fg.gemm_fp8_gluon, x, silu
        h_dtype = torch.bfloat16 if silu else torch.float32  # (fp8_moe_gluon's: one rounding)

    def gate_up():
        h = torch.empty(M, I if silu else 2 * I, device=x.device, dtype=h_dtype)
        launch(a, ew.w13, ew.w13_scale, h, twf, sid, eids, npost, 2 * I, D, M, K, False, flag, cfg,
               units)  # fmt: skip
        return h if silu else (F.silu(h[:, :I]) * h[:, I:]).to(torch.bfloat16)

    def down(h):
        out = torch.empty(M, D, device=x.device, dtype=torch.bfloat16)
        launch(h, ew.w2, ew.w2_scale, out, twf, sid, eids, npost, D, I, M, 1, True, False, cfg,
               units)  # fmt: skip
        return out

    return gate_up, down


def table_cfg(fmt, pairs):
    from k2serve.kernels.int4_gemm import pick_config
    from k2serve.kernels.policy import KernelPolicy

    t = KernelPolicy.for_device("cuda").tables
    table = t.int4_prefill_gluon if fmt == "int4" else t.fp8_prefill_gluon
    return {k: v for k, v in pick_config(table, pairs).items() if k not in ("what", "max_pairs")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="fp8", choices=("int4", "fp8"))
    ap.add_argument("--ts", default="8192,16384")
    ap.add_argument("--routing", default="uniform,third")
    ap.add_argument("--configs", default="")
    args = ap.parse_args(argv)
    fmt = args.format
    torch.manual_seed(0)
    ew = (ms._rand_experts("int4", E, D, I, "cuda") if fmt == "int4"
          else fd.fp8_experts(E, D, I, "cuda"))  # fmt: skip
    parse = gd.cfg_of if fmt == "int4" else fd.cfg_of
    print(f"{torch.cuda.get_device_name()} {fmt}, one K2 layer; ms (TFLOP/s)", flush=True)
    rows = ["| T | routing | config | gate_up ms | down ms | layer ms | down vs table |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for T in (int(t) for t in args.ts.split(",")):
        for routing in args.routing.split(","):
            tw, ids = pd.route(T, routing)
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            f13, f2 = 2 * T * K * 2 * I * D, 2 * T * K * D * I
            base, t2_table = None, 0.0
            # the table's entry first and again last (the first timing of a process can run
            # on a colder GPU: the two bracket the drift)
            for name in ["table", *filter(None, args.configs.split(",")), "table"]:
                cfg = table_cfg(fmt, T * K) if name == "table" else parse(name)
                try:
                    gate_up, down = gemms(fmt, ew, x, tw, ids, cfg)
                    h = gate_up()
                    y = down(h)
                    if base is None:
                        base = (h, y)
                    d13, d2 = gd.rel(h, base[0]), gd.rel(y, base[1])
                    t13 = ms.timed(gate_up, iters=5, warmup=2)
                    t2 = ms.timed(functools.partial(down, h), iters=5, warmup=2)
                except Exception as e:  # noqa: BLE001 - one line, the next config runs
                    print(f"  T={T} {routing} {name}: ERROR {type(e).__name__}: {str(e)[:300]}",
                          flush=True)  # fmt: skip
                    continue
                t2_table = t2_table or t2
                print(f"  T={T} {routing} {name:24s} gate_up {t13:7.3f} ms ({f13 / t13 / 1e9:4.0f}) "
                      f"down {t2:7.3f} ms ({f2 / t2 / 1e9:4.0f}) diff {d13:.1e} / {d2:.1e}",
                      flush=True)  # fmt: skip
                rows.append(f"| {T} | {routing} | {name} | {t13:.3f} ({f13 / t13 / 1e9:.0f}) | "
                            f"{t2:.3f} ({f2 / t2 / 1e9:.0f}) | {t13 + t2:.3f} | {t2_table / t2:.2f}x |")  # fmt: skip
            del x
    print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
