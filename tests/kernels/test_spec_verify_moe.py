"""A verify step's few tokens (1 + K = 2..6) on the INT4 decode GEMVs with experts shared between
tokens (consecutive tokens often route alike): the per-pair GEMV (what such a step runs now: it
reads a shared expert once per pair) and the grouped GEMV with one block per expert (BLOCK_M the
next power of two >= T: each distinct expert read once), with the kernel policy's launch configs
as benchmarks/spec_decode_gpu.py --parts moe runs them, both equal to the reference."""

import pytest
import torch

from k2serve.kernels import fused_moe as fm
from k2serve.kernels import int4_gemv
from k2serve.kernels.policy import load_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter (conftest)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _int4_experts(E, D, I):  # noqa: E741 - random packed INT4 experts, group 32
    def pk(n, k):
        return torch.randint(-(2**31), 2**31 - 1, (E, n, k // 8), dtype=torch.int32, device=DEVICE)

    def sc(n, k):
        return (torch.rand(E, n, k // 32, device=DEVICE) * 0.004 + 0.002).bfloat16()

    return fm.ExpertWeights("int4", pk(2 * I, D), pk(D, I), sc(2 * I, D), sc(D, I), 32)


@pytest.mark.parametrize("T", [2, 5])
def test_few_token_step_with_shared_experts(T):
    t = load_tables()
    E, k = 8, 4
    # hidden 128: one K block of W=16 a row (the K loop of these configs runs at hidden 256 in
    # test_kernels' policy-table test and test_int4_gemv_gsum's GSUM KT=1 case)
    ew = _int4_experts(E, 128, 128)
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:, 0] = 5  # one expert in every token, others shared by chance (8 experts, top-4)
    ids = ids.to(DEVICE)
    x = torch.randn(T, 128, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(T, k, device=DEVICE) / k
    ref = fm.fused_moe_ref(x, ew, w, ids)
    per_pair = int4_gemv.int4_moe_decode(x, ew, w, ids, dict(t.int4_decode), asm=False)
    bm = min(8, 1 << (T - 1).bit_length())
    cfg = {**dict(t.int4_decode_grouped), "BLOCK_M": bm}
    cfg["w2"] = {**dict(cfg.get("w2", {})), "BLOCK_M": bm}
    grouped = int4_gemv.int4_moe_decode_grouped(x, ew, w, ids, cfg, asm=False)
    assert rel(per_pair, ref) < 2e-2
    assert rel(grouped, ref) < 2e-2
