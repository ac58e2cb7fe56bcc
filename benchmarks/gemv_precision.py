"""CPU emulation (torch fp16, no GPU) of the decode GEMV's fp16 sums at K2's K=7168, against
float64 on the same bf16 inputs: the shipped grouped kernel (each word's 4 products per half
summed in fp16, activations in [256, 512), halves and words summed in fp32) and GSUM
(kernels/int4_gemv_gsum.py: a group's 16 products per half in fp16, activations in [64, 128),
halves added in fp16). Each fp16 FMA is emulated as an fp32 multiply-add rounded to fp16 (the
product of two fp16 values is exact in fp32). Prints the relative error of R output rows for
activations at four magnitudes (the output's bf16 rounding, ~2e-3, is not included).

Run: PYTHONPATH=src python3 benchmarks/gemv_precision.py
"""

import torch


def emulate(n, s, x, top: int, chain_words: int):
    """n [R, K] weights - 8, s [R, K/32] scales, x [K] -> [R] float64."""
    R, K = n.shape
    e = torch.floor(torch.log2(x.abs().max())) - top
    xw = (x / 2**e).half().float().view(K // 8, 8)
    nw = n.view(R, K // 8, 8)
    acc = torch.zeros(R)
    for c in range(K // (8 * chain_words)):
        lo, hi = torch.zeros(R), torch.zeros(R)
        for w in range(c * chain_words, (c + 1) * chain_words):
            for j in range(4):
                lo = (nw[:, w, j] * xw[w, j] + lo).half().float()
                hi = (nw[:, w, j + 4] * xw[w, j + 4] + hi).half().float()
        ws = lo + hi if chain_words == 1 else (lo + hi).half().float()
        acc += ws * s[:, (c * chain_words * 8) // 32]
    return acc.double() * 2 ** e.double()


def main():
    torch.manual_seed(0)
    K, R = 7168, 256
    n = torch.randint(0, 16, (R, K)).float() - 8
    s = (torch.rand(R, K // 32) * 0.004 + 0.002).bfloat16().float()
    errs = {"shipped (word sums)": [], "GSUM (group sums)": []}
    for t in range(4):
        x = torch.randn(K) * 10.0 ** (t - 2)
        x[::97] *= 20  # a few large activations
        x = x.bfloat16().float()
        ref = (n.double() * s.double().repeat_interleave(32, 1) * x.double()).sum(1)
        for name, (top, cw) in zip(errs, ((8, 1), (6, 4)), strict=True):
            y = emulate(n, s, x, top, cw)
            errs[name].append(((y - ref).norm() / ref.norm()).item())
    for name, v in errs.items():
        print(f"{name:20s} rel err vs float64: " + " ".join(f"{e:.2e}" for e in v))


if __name__ == "__main__":
    main()
