"""INT4 W4A16 routed experts for decode-sized batches on tensor cores: the entry point of the
f16 design (kernels/int4_moe_mma16.py), which the kernel policy's `int4_decode_mma` runs.

Owns: `int4_moe_mma` (the routed-expert output: the aligned blocks of moe_align_block_size, the
`active` flag, a gate_up launch with SiLU(gate) * up in its epilogue, a down launch with the
top-k weight applied and the top-k sum), `MMA_CONFIG` (the default config), `CONFIG_KEYS` and
the config check.

Why: at T = 32..256 tokens x top-8 each hit expert gets ~1.3-5.4 (token, expert) pairs. The
grouped CUDA-core GEMV (int4_gemv.py) reads as many activation bytes (from L2) as weight bytes
per program and does the products on CUDA cores. Here one program takes one aligned block of
an expert's pairs (BLOCK_M rows, padding rows masked) and BLOCK_N weight rows and runs the
products on tensor cores, so a weight tile is read once per block. The kernel, its layout,
precision, cost and measurements: int4_moe_mma16.py.

Wave 9's bf16 nibble-plane design (config F16=0, keys KW / ETAB / SPLIT: ~5 SASS instructions
a weight, 47-51% of the copy bandwidth on the H100, RESULTS.md "INT4 decode MoE on tensor
cores") was never dispatched and is removed; such a config is refused with a ValueError. F16=1
(the tables' configs carry it) names the f16 design, the only one.

Layout: compressed-tensors words w int32 [E, N, K/8] (nibble j of word i = column 8i + j,
value + 8), scales bf16 [E, N, K/32]; w13 rows: gate (0..I-1) then up (I..2I-1).

Invariants: group 32; K (hidden and intermediate) multiples of 32 G; fp32 accumulation; no
host synchronisation (the grid: moe_align_block_size's bound on the block count), so CUDA-graph
safe; `active` [1] int32 0: every program returns at once.
"""

from __future__ import annotations

import torch

from ._triton import require_triton
from .int4_moe_mma16 import F16_KEYS, check_f16, launch_f16
from .moe_align import moe_align_block_size

# 16 pairs x 64 weight rows, weights as the MMA's M (SWAP=1), two warps, 4 groups a K step,
# L2 prefetch 2 steps ahead: the fastest tile of the H100 sweeps, T=128 uniform 4.69 ms = 63%
# of copy bw (kernels/configs/h100.json); the defaults of the keys a config leaves out
MMA_CONFIG = dict(F16=1, BLOCK_M=16, BLOCK_N=64, G=4, SWAP=1, ATOMIC=0, num_warps=2,
                  num_stages=3, PF=2)  # fmt: skip
CONFIG_KEYS = F16_KEYS
BF16_KEYS = ("KW", "ETAB", "SPLIT")  # the removed bf16 design's own keys


def _configs(config: dict, D: int, I: int) -> tuple[dict, dict]:  # noqa: E741
    """(gate_up, down) launch configs: `config`'s keys over MMA_CONFIG, "w2" overrides for the
    down launch; ValueError for a config the f16 kernel cannot run."""
    own = {k: v for k, v in config.items() if k not in ("w2", "what")}
    base = {**MMA_CONFIG, **own}
    c2 = {**base, **config.get("w2", {})}
    for c in (base, c2):
        if c["F16"] != 1 or set(c) & set(BF16_KEYS):
            raise ValueError(
                "int4_moe_mma: wave 9's bf16 tensor-core design (config F16=0, keys "
                f"{', '.join(BF16_KEYS)}) was removed; use the f16 design (F16=1, "
                f"kernels/int4_moe_mma16.py; keys {', '.join(CONFIG_KEYS)}); got {config}"
            )
    unknown = set(base) - set(CONFIG_KEYS) | set(c2) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"int4_moe_mma: unknown config keys {sorted(unknown)}")
    if c2["BLOCK_M"] != base["BLOCK_M"]:
        raise ValueError("int4_moe_mma: one BLOCK_M for both launches (one alignment)")
    check_f16(base, D)
    check_f16(c2, I)
    return base, c2


def int4_moe_mma(
    x: torch.Tensor,  # [T, D] bf16
    ew,  # ExpertWeights, quant "int4", group 32
    topk_weights: torch.Tensor,  # [T, k] float
    topk_ids: torch.Tensor,  # [T, k] int
    config: dict | None = None,
    active: torch.Tensor | None = None,  # [1] int32 on the device: 0 = skip (moe_select.py)
) -> torch.Tensor:  # [T, D] x.dtype
    """Routed-expert output on tensor cores; no host synchronisation. `config` (defaults
    MMA_CONFIG): F16 (1, the f16 design), BLOCK_M (rows of an aligned block), BLOCK_N (weight
    rows a program), G (groups of 32 columns a K step), SWAP (weights as the MMA's M), ATOMIC
    (the down launch adds into a float32 [T, D] instead of storing [T*k, D] for a torch sum),
    PF (the L2 prefetch distance in K steps, 0: none), num_warps, num_stages, maxnreg (a
    register cap a thread); "w2": overrides for the down launch (not BLOCK_M). `active` 0: the
    programs return at once (the output is then undefined)."""
    require_triton(x)
    T, D = x.shape
    I = ew.intermediate  # noqa: E741
    if ew.quant != "int4" or ew.group_size != 32:
        raise ValueError(f"int4_moe_mma: needs int4 experts of group 32 (got {ew.quant}, "
                         f"group {ew.group_size})")  # fmt: skip
    if ew.hidden != D:
        raise ValueError(f"int4_moe_mma: hidden size {D} != experts' {ew.hidden}")
    c13, c2 = _configs(dict(config or {}), D, I)
    sorted_ids, eids, npost = moe_align_block_size(topk_ids, ew.num_experts, c13["BLOCK_M"])
    if active is not None:  # 0 rows in use: every program returns at once
        npost = npost * active
    tw = topk_weights.reshape(-1).float().contiguous()
    return launch_f16(x, ew, tw, topk_ids, sorted_ids, eids, npost, c13, c2)
