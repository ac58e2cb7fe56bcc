"""INT4 W4A16 routed experts of decode batches on f16 tensor cores with cheap dequant
(issue 28: "decode B=128 >= 60% of copy bandwidth"; the F16=1 config of `int4_moe_mma`).

Owns: `_int4_mma_f16_kernel`, `pack_f16` (the activation layout and per-row power-of-two
scale it reads), `launch_f16` (both projections of the routed experts), `F16_KEYS` and
`check_f16` (the config keys and their check).

Why: wave 9's bf16 design (nibble planes, one fp32 FMA with the group scale a weight, a bf16
rounding; removed, see int4_moe_mma.py) executed ~5 thread-instructions per INT4 weight
(Nsight Compute, H100, T=128: 1.65e9 warp instructions for gate_up) and read at ~51% of the
copy bandwidth, like the CUDA-core grouped GEMV. Here a weight costs ~1.1 (Marlin's dequant:
one lop3 makes two f16 values of two nibbles with the 0x6400 exponent, one f16x2 sub / fma
finishes them, exact: int4_dequant.f16x2_dequant_asm), the scale is applied once per group to
an MMA partial (one FFMA an accumulator element a group), the MMA is mma.sync m16n8k16 f16
with fp32 accumulation.

Layout. One group (32 columns = 4 words a row) is one K=32 operand whose k order puts word t
of the group in lane t of a quad, as Triton 3.6's mma.sync f16 operand (kWidth 4 on sm_90: a
thread holds k = 4t..4t+3 and 16 + 4t..16 + 4t + 3 of a K=32 pair of k16 steps) wants it:
nibble j = 4c + 2a + b of word t is k = 16a + 4t + 2b + c; `pack_f16` permutes the
activations the same way, so the words go from shared memory (cp.async, Triton's pipeline) to
the MMA's registers with no layout conversion (checked in the sm_90 SASS:
benchmarks/mma_sass.py).

Precision: the weights (n - 8) are exact in f16; the activations are scaled per row by a
power of two into [256, 512) (exact for bf16 inputs: f16 keeps 11 bits; entries below ~2^-22
of the row's maximum become f16 subnormals, below ~2^-34 zero) and rs undoes it in the
epilogue; products and sums are fp32 in the MMA. Each launch agrees with a float32 reference
of the same quantized math to ~2e-7 (tests/kernels/test_int4_moe_mma16.py).

Cost (benchmarks/mma_sass.py, Triton 3.6 sm_90, SASS instructions a weight in the K loop,
gate_up / down): 8x128 SWAP=1 two warps 2.21 / 2.46, 8x32 G=8 one warp 2.16 / 2.25, against
4.92 / 5.70 for the removed bf16 design's 16x32 tile; no spills, no shared-memory round trip of
the dequantized operand. The pieces a weight: lop3 0.52, f16x2 sub / fma 0.50, shift 0.13, HMMA
0.13, FFMA 0.25 (BLOCK_M 8; 0.5 at 16), the rest addressing, the activation fragments' moves
(Triton's kWidth-4 operand needs two LDS.64 halves a register pair) and the scale loads.
Measured (H100, benchmarks/decode_mma.sh, one K2 layer, 2026-11-25, runs 1-2): 16x64 SWAP=1
two warps, G=4 with the L2 prefetch (PF=2): T=128 uniform 4.69 ms = 63% of copy bw (grouped
GEMV 5.61, bf16 design 5.92), T=192 / 256 62% (1.36-1.37x the Gluon GEMM), T=128 on a third
of the experts 1.86 ms (1.36x); T=32 / 64 0.74 / 0.88x the per-pair GEMV. Without PF and G=2,
5.03 ms (59%). Tiles of 64 weight rows a warp ran ~2x slower whatever their instruction count
(8x128: 2.2 a weight, 10.2 ms): the time follows the weight rows streamed at once an SM and the
bytes a row a K step (DRAM locality), not the instructions. Dispatched for 1024-2048 (token,
expert) pairs (kernels/configs/h100.json int4_decode_mma).

Invariants: compressed-tensors words (nibble j of word i = column 8i + j, value + 8), bf16
scales, group 32; K a multiple of 32 G; no host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, INTERPRET, cdiv, tl, triton
from .int4_dequant import f16x2_dequant_asm, use_asm

if HAS_TRITON:
    # the f16x2 pairs t0..t3 = (n_j - 8, n_j+4 - 8) split into the 8 f16 outputs $0..$7
    _DQ8_ASM = tl.constexpr(
        f16x2_dequant_asm(
            "$8",
            ("t0", "t1", "t2", "t3"),
            decl=".reg .b32 t0, t1, t2, t3;",
            then="""
            mov.b32 {$0, $4}, t0;
            mov.b32 {$1, $5}, t1;
            mov.b32 {$2, $6}, t2;
            mov.b32 {$3, $7}, t3;
            """,
        )
    )

    @triton.jit
    def _dq8(p, USE_ASM: tl.constexpr):
        """Word p -> its 8 weights n_j - 8 (j = 0..7) as f16, exact (the f16x2 dequant of
        int4_dequant.f16x2_dequant_asm, each pair split into its two halves)."""
        if USE_ASM:
            return tl.inline_asm_elementwise(
                asm=_DQ8_ASM,
                constraints="=h,=h,=h,=h,=h,=h,=h,=h,r",
                args=[p],
                dtype=(tl.float16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:  # the interpreter
            return (_nib(p, 0), _nib(p, 1), _nib(p, 2), _nib(p, 3), _nib(p, 4), _nib(p, 5),
                    _nib(p, 6), _nib(p, 7))  # fmt: skip

    @triton.jit
    def _nib(p, j: tl.constexpr):
        """Nibble j of words p minus 8, as f16 (plain Triton)."""
        return (((p >> (4 * j)) & 15) - 8).to(tl.float16)

    @triton.jit
    def _group_op(p, BN: tl.constexpr, SWAP: tl.constexpr, USE_ASM: tl.constexpr):
        """A group's words p ([4, BN] SWAP=0 / [BN, 4] SWAP=1, word t of row n) -> the MMA
        operand [32, BN] / [BN, 32] f16, k = 16a + 4t + 2b + c for nibble 4c + 2a + b.
        Joins, a permute and a reshape: register renaming only (no shared memory in the SASS)."""
        v0, v1, v2, v3, v4, v5, v6, v7 = _dq8(p, USE_ASM)
        r = tl.join(
            tl.join(tl.join(v0, v4), tl.join(v1, v5)), tl.join(tl.join(v2, v6), tl.join(v3, v7))
        )  # [.., 2 c, 2 b, 2 a]
        if SWAP:  # [BN, t, c, b, a] -> [BN, a, t, b, c]
            w = tl.reshape(tl.permute(r, (0, 4, 1, 3, 2)), (BN, 32))
        else:  # [t, BN, c, b, a] -> [a, t, b, c, BN]
            w = tl.reshape(tl.permute(r, (4, 0, 3, 2, 1)), (32, BN))
        return w

    @triton.jit
    def _scales(s_ptrs, s_ok, G: tl.constexpr):
        """A K step's G / 2 int32 scale pairs [BN] as a 4-tuple (G < 8: the last repeated)."""
        p0 = tl.load(s_ptrs, mask=s_ok, other=0)
        p1 = p0
        p2 = p0
        p3 = p0
        if G >= 4:
            p1 = tl.load(s_ptrs + 1, mask=s_ok, other=0)
            p2 = p1
            p3 = p1
        if G == 8:
            p2 = tl.load(s_ptrs + 2, mask=s_ok, other=0)
            p3 = tl.load(s_ptrs + 3, mask=s_ok, other=0)
        return p0, p1, p2, p3

    @triton.jit
    def _scale(sp, g: tl.constexpr):
        """Group g's scale (fp32) of a K step's scale pairs sp (groups 2h low, 2h + 1 high)."""
        q = sp[g // 2]
        if g % 2 == 0:
            return (q << 16).to(tl.float32, bitcast=True)
        return (q & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _f16_step(acc, w_ptrs, sp, a_ptrs, a_ok, n_ok, G: tl.constexpr, BN: tl.constexpr,
                  SWAP: tl.constexpr, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
        """acc += sum over the K step's G groups of scale_g * (W_g . a_g)."""
        for g in tl.static_range(G):
            w = _group_op(tl.load(w_ptrs + 4 * g, mask=n_ok, other=0), BN, SWAP, USE_ASM)
            a = tl.load(a_ptrs + 32 * g, mask=a_ok, other=0.0)
            s = _scale(sp, g)
            if SWAP:
                acc = tl.fma(tl.dot(w.to(DOT_DT), a.to(DOT_DT)), s[:, None], acc)
            else:
                acc = tl.fma(tl.dot(a.to(DOT_DT), w.to(DOT_DT)), s[None, :], acc)
        return acc

    @triton.jit
    def _prefetch_l2(ptrs, on):
        """prefetch.global.L2 of each pointer's line where `on` (a scalar predicate)."""
        return tl.inline_asm_elementwise(
            asm="""
            {
            .reg .pred p;
            setp.ne.b32 p, $2, 0;
            @p prefetch.global.L2 [$1];
            mov.b32 $0, 0;
            }
            """,
            constraints="=r,l,r",
            args=[ptrs, on.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _pack_f16_kernel(x_ptr, a_ptr, rs_ptr, K, x_stride, a_stride, BLOCK_K: tl.constexpr):
        """One row of `pack_f16`: e = floor(log2 max|x|) - 8 (in [-120, 120]; 0 for a zero
        row), a = x 2^-e as f16 in the kernel's k order, rs = 2^e."""
        r = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK_K)
        ok = col < K
        xr = tl.load(x_ptr + r * x_stride + col, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(xr), 0)
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 8
        e = tl.where(amax > 0, tl.minimum(tl.maximum(e, -120), 120), 0)
        tl.store(rs_ptr + r, ((127 + e) << 23).to(tl.float32, bitcast=True))
        down = ((127 - e) << 23).to(tl.float32, bitcast=True)
        w = col % 32  # 8t + 4c + 2a + b -> 16a + 4t + 2b + c
        pos = col - w + 16 * ((w // 2) % 2) + 4 * (w // 8) + 2 * (w % 2) + (w // 4) % 2
        tl.store(a_ptr + r * a_stride + pos, (xr * down).to(tl.float16), mask=ok)

    @triton.jit
    def _int4_mma_f16_kernel(
        a_ptr, rs_ptr, w_ptr, s_ptr, c_ptr, tw_ptr, sorted_ptr, eid_ptr, npost_ptr,
        N, K, num_pairs, a_stride, c_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n,
        A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr, OUT_DIV: tl.constexpr,
        ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
        SWAP: tl.constexpr, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr, PF: tl.constexpr,
    ):  # fmt: skip
        """One aligned block of BLOCK_M pairs of expert e (moe_align_block_size; padding
        rows read nothing and store nothing, blocks past the rows in use return at once) x
        BLOCK_N weight rows n: a (`pack_f16`) f16 rows scaled by 1 / rs, K steps of
        G groups; the scale pairs of step it + 1 are loaded in step it (registers: plain loads
        are not pipelined by Triton). PF > 0 (with USE_ASM): each weight row's 128-byte line
        of step it + PF is prefetched into L2 in step it (a line is 8 / G steps). GATED: rows n
        and N + n, stores silu(gate) * up (bf16, natural column order); else times tw[pair]
        (MUL_W), stored to c[pair] or added (ATOMIC) to c[pair // OUT_DIV] (float32)."""
        pid = tl.program_id(0)
        nbn = tl.cdiv(N, BLOCK_N)
        pid_m = pid // nbn
        pid_n = pid % nbn
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = pair < num_pairs
        rows = tl.where(ok, pair // A_DIV, 0).to(tl.int64)
        e = tl.load(eid_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, 4)
        kk = tl.arange(0, 32)
        if SWAP:  # words [BN, 4], activations [32, BM], accumulator [BN, BM]
            n_ok = (offs_n < N)[:, None]
            w_ptrs = w_ptr + e * w_stride_e + offs_n[:, None] * w_stride_n + t[None, :]
            a_ptrs = a_ptr + rows[None, :] * a_stride + kk[:, None]
            a_ok = ok[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:  # words [4, BN], activations [BM, 32], accumulator [BM, BN]
            n_ok = (offs_n < N)[None, :]
            w_ptrs = w_ptr + e * w_stride_e + offs_n[None, :] * w_stride_n + t[:, None]
            a_ptrs = a_ptr + rows[:, None] * a_stride + kk[None, :]
            a_ok = ok[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        s_ok = offs_n < N
        s_ptrs = s_ptr + e * s_stride_e + offs_n * s_stride_n  # [BN] scale pairs
        u_off = N * w_stride_n
        us_off = N * s_stride_n
        acc_u = acc
        steps = K // (32 * G)
        pf_rows = w_ptr + e * w_stride_e + tl.minimum(offs_n, N - 1) * w_stride_n  # [BN]
        sp = _scales(s_ptrs, s_ok, G)
        su = sp
        if GATED:
            su = _scales(s_ptrs + us_off, s_ok, G)
        for it in range(0, steps):  # the next step's scales loaded one step ahead
            nxt = s_ok & (offs_n * 0 + it + 1 < steps)
            if PF > 0 and USE_ASM:  # the words' line PF steps ahead, once a line, into L2
                off = tl.minimum((it + PF) * 4 * G, K // 8 - 1)
                _prefetch_l2(pf_rows + off, (it + PF) * G % 8 == 0)
                if GATED:
                    _prefetch_l2(pf_rows + u_off + off, (it + PF) * G % 8 == 0)
            s_ptrs += G // 2
            sp_n = _scales(s_ptrs, nxt, G)
            acc = _f16_step(acc, w_ptrs, sp, a_ptrs, a_ok, n_ok, G, BLOCK_N, SWAP, DOT_DT,
                            USE_ASM)  # fmt: skip
            sp = sp_n
            if GATED:
                su_n = _scales(s_ptrs + us_off, nxt, G)
                acc_u = _f16_step(acc_u, w_ptrs + u_off, su, a_ptrs, a_ok, n_ok, G, BLOCK_N,
                                  SWAP, DOT_DT, USE_ASM)  # fmt: skip
                su = su_n
            w_ptrs += 4 * G
            a_ptrs += 32 * G
        if SWAP:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
            acc_u = tl.trans(acc_u)
        rs = tl.load(rs_ptr + rows, mask=ok, other=0.0)[:, None]  # undoes pack_f16's scaling
        mask = ok[:, None] & (offs_n < N)[None, :]
        dst = c_ptr + pair.to(tl.int64)[:, None] * c_stride + offs_n[None, :]
        if GATED:
            g = acc * rs
            y = g / (1.0 + tl.exp(-g)) * (acc_u * rs)
            tl.store(dst, y.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            acc = acc * rs
            if MUL_W:
                acc = acc * tl.load(tw_ptr + pair, mask=ok, other=0.0)[:, None]
            if ATOMIC:
                dst = c_ptr + (pair // OUT_DIV).to(tl.int64)[:, None] * c_stride + offs_n[None, :]
                tl.atomic_add(dst, acc, mask=mask, sem="relaxed")
            else:
                tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=mask)


def pack_f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (K % 32 == 0) -> (f16 [M, K] in the F16 kernel's k order, rs [M] float32): each
    row times 2^-e (exact) so that its largest magnitude lies in [256, 512), rs = 2^e; in each
    group of 32 columns, column 8t + 4c + 2a + b moves to 16a + 4t + 2b + c. One launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    a = torch.empty(M, K, dtype=torch.float16, device=x.device)
    rs = torch.empty(M, dtype=torch.float32, device=x.device)
    bk = triton.next_power_of_2(K)
    _pack_f16_kernel[(M,)](x, a, rs, K, x.stride(0), a.stride(0), BLOCK_K=bk,
                           num_warps=8 if K >= 4096 else 4)  # fmt: skip
    return a, rs


F16_KEYS = (  # int4_moe_mma's config keys; PF: the L2 prefetch distance in K steps (0: none)
    "F16",
    "BLOCK_M",
    "BLOCK_N",
    "G",
    "SWAP",
    "ATOMIC",
    "num_warps",
    "num_stages",
    "maxnreg",
    "PF",
)


def check_f16(c: dict, K: int) -> None:
    """ValueError unless config c runs the F16 kernel over K columns."""
    if c["G"] not in (2, 4, 8) or K % (32 * c["G"]):
        raise ValueError(f"int4_moe_mma F16: G={c['G']} (groups a K step) must be 2, 4 or 8 and "
                         f"K={K} a multiple of 32 G")  # fmt: skip
    if c["BLOCK_M"] & (c["BLOCK_M"] - 1) or c["BLOCK_N"] & (c["BLOCK_N"] - 1):
        raise ValueError(f"int4_moe_mma F16: BLOCK_M, BLOCK_N must be powers of two ({c})")
    if c["BLOCK_M"] < 8 or c["BLOCK_N"] < 16:
        raise ValueError(f"int4_moe_mma F16: BLOCK_M >= 8 and BLOCK_N >= 16 (MMA tiles; {c})")


def _launch(a, rs, w, s, c, tw, sorted_ids, eids, npost, N, K, num_pairs, a_div, gated, mul_w,
            out_div, atomic, cfg):  # fmt: skip
    s32 = s.view(torch.int32)  # [E, N, K/64]: the scales of groups 2h (low) and 2h + 1
    grid = (eids.shape[0] * cdiv(N, cfg["BLOCK_N"]),)
    _int4_mma_f16_kernel[grid](
        a, rs, w, s32, c, tw, sorted_ids, eids, npost, N, K, num_pairs, a.stride(0),
        c.stride(0), w.stride(0), w.stride(1), s32.stride(0), s32.stride(1), A_DIV=a_div,
        GATED=gated, MUL_W=mul_w, OUT_DIV=out_div, ATOMIC=atomic, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], G=cfg["G"], SWAP=cfg["SWAP"],
        DOT_DT=tl.float32 if INTERPRET else tl.float16, USE_ASM=use_asm(), PF=cfg.get("PF", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip


def launch_f16(x, ew, tw, topk_ids, sorted_ids, eids, npost, c13: dict, c2: dict):
    """Both projections of the routed experts (F16 design): [T, D] x.dtype."""
    T, D = x.shape
    I = ew.intermediate  # noqa: E741
    k = topk_ids.shape[1]
    M = T * k
    a, rs = pack_f16(x)
    act = torch.empty(M, I, dtype=torch.bfloat16, device=x.device)  # silu(gate) * up
    _launch(a, rs, ew.w13, ew.w13_scale, act, tw, sorted_ids, eids, npost, I, D, M, k, True,
            False, 1, False, c13)  # fmt: skip
    a2, rs2 = pack_f16(act)
    if c2["ATOMIC"]:
        out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
        _launch(a2, rs2, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1,
                False, True, k, True, c2)  # fmt: skip
        return out.to(x.dtype)
    out = torch.empty(M, D, dtype=torch.float32, device=x.device)
    _launch(a2, rs2, ew.w2, ew.w2_scale, out, tw, sorted_ids, eids, npost, D, I, M, 1, False,
            True, 1, False, c2)  # fmt: skip
    return out.view(T, k, D).sum(1).to(x.dtype)
