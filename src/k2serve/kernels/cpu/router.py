"""The noaux_tc router at CPU decode in one call of the CPU kernel (k2router.h).

Owns: `cpu_router_topk` (the gate's float32 logits GEMV on the kernel's pool, as `cpu_linear`
computes them, then the grouped top-k on the calling thread: one ctypes call in place of
`grouped_topk_torch`'s ~15 small torch ops and their Python, ~0.2-0.3 ms a layer) and
`cpu_router_select` (the top-k alone, on given logits: tests, benchmarks).

Invariant: the results equal `grouped_topk_torch`'s on the same logits bit for bit, the order
of the ids included: the kernel reproduces torch's CPU kernels (SLEEF's expf in the vectorized
sigmoid, nth_element's permutation in topk, the inner sum's order), given torch's vector width
here (`torch_vector`). Where it cannot (another CPU capability, a top-k that torch computes
on its heap path, k of two vectors or more) these return None and the caller runs
grouped_topk_torch; so does the kernel's absence (K2SERVE_CPU_KERNEL=torch, no compiler).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from k2serve.kernels.cpu import FMT_BF16, LINEAR_MAX_ROWS, X_BF16, X_F32, _default_pool, _gemv_ok

logger = logging.getLogger(__name__)


# (sigmoid chunk, sum vector) in floats per CPU capability of torch's kernels, most likely
# first: torch runs its AVX512 sigmoid (two 16-float vectors a step) but its AVX2 sum kernel
# on AVX512 CPUs (measured with torch 2.13); "DEFAULT": libm's exp everywhere (chunk 0)
_VECTOR_GUESSES = {"AVX512": ((32, 8), (32, 16)), "AVX2": ((16, 8),), "DEFAULT": ((0, 8),)}
# probe cases (E, k, n_group, topk_group): a sigmoid tail (T * E not whole chunks), sums of
# k below / above one vector, the group path
_PROBES = ((40, 6, 1, 1), (48, 12, 1, 1), (384, 8, 1, 1), (64, 8, 8, 3))


@functools.cache
def torch_vector() -> tuple[int, int] | None:
    """(sigmoid chunk, sum vector) in floats of the CPU kernels torch runs in this process:
    the first guess for its CPU capability whose kernel selection equals grouped_topk_torch's
    bit for bit on probe logits (random and tied, T = 1 and 2), or None (then the router
    keeps torch's ops; logged once)."""
    from k2serve.kernels.cpu import load_kernel
    from k2serve.kernels.router_torch import grouped_topk_torch

    lib = load_kernel()
    cap = torch.backends.cpu.get_cpu_capability()
    if lib is None:
        return None
    g = torch.Generator().manual_seed(0)
    cases = []
    for E, k, ng, tg in _PROBES:
        for T, tied in ((1, False), (2, False), (2, True)):
            lg = torch.randn(T, E, generator=g) * 3
            lg = (lg * 2).round() / 2 if tied else lg  # ties in the scores
            bias = torch.randn(E, generator=g) * 0.1
            cases.append((lg, bias, k, ng, tg, grouped_topk_torch(lg, bias, k, ng, tg, True, 2.5)))
    for vec in _VECTOR_GUESSES.get(cap, ()):
        if all(_same(_select(lib, lg, b, k, ng, tg, True, 2.5, vec), ref)
               for lg, b, k, ng, tg, ref in cases):  # fmt: skip
            return vec
    logger.warning(
        "the CPU kernel's router top-k does not reproduce torch's (CPU capability %s): the "
        "router keeps grouped_topk_torch's ops at decode",
        cap,
    )
    return None


def _same(got, ref) -> bool:
    return got is not None and all(
        torch.equal(a.view(torch.int32) if a.is_floating_point() else a,
                    b.view(torch.int32) if b.is_floating_point() else b)
        for a, b in zip(got, ref, strict=True)
    )  # fmt: skip


def _select(lib, logits, bias, top_k, n_group, topk_group, renorm, scale, vec):
    """k2_router_select on contiguous float32 logits [T, E] -> (weights, ids) or None."""
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64)
    w = torch.empty(T, top_k, dtype=torch.float32)
    rc = lib.k2_router_select(logits.data_ptr(), T, E, *_select_args(
        bias, top_k, n_group, topk_group, renorm, scale, vec, ids, w))  # fmt: skip
    return (w, ids) if rc in (0, 1) else None


def _select_args(bias, top_k, n_group, topk_group, renorm, scale, vec, ids, w) -> tuple:
    bptr = bias.data_ptr() if bias is not None else None
    return (bptr, top_k, n_group, topk_group, int(bool(renorm)), float(scale), *vec,
            ids.data_ptr(), w.data_ptr())  # fmt: skip


def _bias_ok(bias, E: int) -> bool:
    return bias is None or (
        bias.device.type == "cpu"
        and bias.dtype == torch.float32
        and bias.is_contiguous()
        and bias.shape == (E,)
    )


def cpu_router_select(
    logits: torch.Tensor,  # [T, E] float32, CPU
    bias: torch.Tensor | None,  # [E] float32
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # ([T, k] float32, [T, k] int64) or None
    """grouped_topk_torch's results on `logits` from the kernel, or None (not covered here)."""
    from k2serve.kernels.cpu import load_kernel

    lib = load_kernel()
    if lib is None or logits.dim() != 2 or logits.dtype != torch.float32:
        return None
    if logits.device.type != "cpu" or logits.shape[0] == 0 or not _bias_ok(bias, logits.shape[1]):
        return None
    vec = torch_vector()
    if vec is None or torch.are_deterministic_algorithms_enabled():
        return None
    lg = logits.contiguous()
    return _select(
        lib, lg, bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor, vec
    )


def cpu_router_topk(
    x: torch.Tensor,  # [T, hidden] bf16 / float32, T <= LINEAR_MAX_ROWS
    weight: torch.Tensor,  # [E, hidden] bf16 (the gate)
    bias: torch.Tensor | None,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """(topk_weights [T, k] float32, topk_ids [T, k] int64, whether a logit was NaN / inf):
    TopkRouter's result at decode in one kernel call (logits as `cpu_linear(x, weight,
    float32)`, the top-k as `grouped_topk_torch`), or None where it does not apply (a prompt,
    a float32 / fp16 weight, no kernel, ...; the caller runs the torch path)."""
    if weight.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] > LINEAR_MAX_ROWS:
        return None
    T, E = x.shape[0], weight.shape[0]
    xk = x if x.dtype == weight.dtype else x.to(torch.float32)
    if not _gemv_ok(xk, weight, T) or not _bias_ok(bias, E):
        return None
    lp = _default_pool(os.getpid())
    if lp is None:
        return None
    vec = torch_vector()
    if vec is None or torch.are_deterministic_algorithms_enabled():
        return None
    lib, pool = lp
    xc = xk.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64)
    w = torch.empty(T, top_k, dtype=torch.float32)
    args = _select_args(
        bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor, vec, ids, w
    )
    xcode = X_BF16 if xc.dtype == torch.bfloat16 else X_F32
    rc = lib.k2_router_topk(pool._ptr, FMT_BF16, weight.data_ptr(), E, weight.shape[1],
                            xc.data_ptr(), xcode, T, *args, None)  # fmt: skip
    return (w, ids, rc == 1) if rc in (0, 1) else None
