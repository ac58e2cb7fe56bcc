"""fp8 latent cache: the MLA decode kernel's error against the fp32 reference, per key tile.

Run (one GPU): PYTHONPATH=src python3 benchmarks/mla_fp8_tiles_check.py
The fidelity check (benchmarks/fidelity.py, int4, fp8 KV cache, decode B=1 ctx=256) failed with
64-key fp8 tiles (layer 2 8.1e-3 against a budget of 7.2e-3; 3.6e-3 with 32-key tiles): this
prints the attention's own relative error for each tile at several contexts and batches.
"""

from __future__ import annotations

import torch

from k2serve.kernels.mla_attention import mla_attention, mla_attention_ref

H, L, R, PS = 64, 512, 64, 64
TILES = {
    "32x5": dict(block_n=32, num_stages=5),
    "64x3": dict(block_n=64, num_stages=3),
    "64x2": dict(block_n=64, num_stages=2),
    "64x3 qk": dict(block_n=64, num_stages=3, split_qk=False),
}


def case(B, ctx, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-(ctx + 1) // PS)
    cache = (torch.randn(B * pages + 1, PS, L + R, device="cuda", generator=g) * 0.5).to(
        torch.float8_e4m3fn
    )
    bt = torch.randperm(B * pages, device="cuda", generator=g).int().view(B, pages) + 1
    q = torch.randn(B, H, L, device="cuda", generator=g, dtype=torch.bfloat16)
    qp = torch.randn(B, H, R, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    cl = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    return q, qp, cache, qsl, cl, bt


def main():
    for B, ctx in ((1, 256), (1, 255), (1, 257), (1, 1000), (8, 256), (1, 32768)):
        q, qp, cache, qsl, cl, bt = case(B, ctx)
        ref = mla_attention_ref(q, qp, cache, qsl, cl, bt, 0.1352).float()
        errs = []
        for name, cfg in TILES.items():
            out = mla_attention(
                q, qp, cache, qsl, cl, bt, 0.1352, max_query_len=1, max_seq_len=ctx + 1, config=cfg
            ).float()
            errs.append(f"{name} {((out - ref).norm() / ref.norm()).item():.2e}")
        print(f"B={B} ctx={ctx}: " + ", ".join(errs), flush=True)


if __name__ == "__main__":
    main()
