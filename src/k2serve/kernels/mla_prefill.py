"""Flash attention forward for MLA prompts in the expanded (non-absorbed) form, varlen.

Owns: `mla_prefill_attention(...)` (Triton, one launch for every prompt sequence of a step),
`mla_prefill_ref(...)` (float32 torch reference, the oracle), `default_config`, `pick_config`.

Math (MLA expanded, DeepSeek-V3 `inference/model.py` attn_impl="naive"): per head h
    score[i, n] = (q_nope[i, h] . k_nope[n, h] + q_pe[i, h] . k_pe[n]) * scale
    out[i, h]   = softmax_n(score[i, :]) @ v[:, h]
with k_nope, v the two halves of kv_b_proj(latent) [S, H, N + V] and k_pe [S, R] shared by all
heads (not broadcast in memory). Query i of a sequence with c cached tokens sees keys n <= c + i
(causal aligned to the bottom right; c = 0 is plain causal).

Why a kernel: torch's SDPA needs one [S, H, N + R] key tensor (a cat of k_nope with the
broadcast k_pe), v zero-padded to the qk width (its flash kernel computes P @ V at 192 dims, a
third of it on zeros), a cat of q, a loop over sequences and a copy of each output: on the H100
those copies and the padded MMAs were ~20 of an 8K prompt step's 80 ms (3 K2 layers). Here the
inputs are read in place through their strides (q_nope / q_pe may be views of one q tensor,
k_nope / v views of the kv_b_proj output) and the output is written straight into `out`.

Kernel: one program per (query block, head, sequence); the grid's first axis runs the query
blocks of a head from the last (the longest causal rows) to the first, so the heavy programs
start first and the tail of the launch is short ones. fp32 online softmax in base 2 (scale *
log2 e folded into one multiply). The keys visible to every row of a block run unmasked; the
few blocks on the diagonal run masked; blocks above it are never visited (one_loop: every
block masked, one pipelined loop; pipe: the unmasked blocks' QK issued one block ahead, so its
MMAs run under the previous block's softmax). Launch configs (block_m, block_n, num_warps,
num_stages, one_loop, pipe) come from the policy tables ("mla_prefill" in
configs/<kind>.json, by the longest query length of the step) through `config`.

Invariants: cu_seqlens_q / cu_seqlens_k are int32 on the device, [B + 1], with
cu_seqlens_k[b + 1] - cu_seqlens_k[b] >= cu_seqlens_q[b + 1] - cu_seqlens_q[b] (the keys of a
sequence are its cached prefix then its new tokens); every row of every sequence is written.
No host synchronisation (the grid uses the host int max_query_len).
"""

from __future__ import annotations

import math

import torch

from ._triton import HAS_TRITON, cdiv, dot_dtype, require_triton, tl, triton
from .policy import band_index

CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "one_loop", "pipe")
# a config the device cannot hold (shared memory, registers): raised at launch, before any
# work, so a caller can fall back (Triton's OutOfResources; empty without Triton)
LAUNCH_ERRORS: tuple[type[Exception], ...] = ()
if HAS_TRITON:
    from triton.runtime.errors import OutOfResources

    LAUNCH_ERRORS = (OutOfResources,)

# --------------------------------------------------------------------------------------------
# torch reference


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, R]
    k_nope: torch.Tensor,  # [S_total, H, N]
    k_pe: torch.Tensor,  # [S_total, R]
    v: torch.Tensor,  # [S_total, H, V]
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    cu_seqlens_k: torch.Tensor,  # [B + 1]
    scale: float,
) -> torch.Tensor:  # [T, H, V] float32
    """Per sequence, an explicit bottom-right causal mask and a float32 softmax."""
    T, H, _ = q_nope.shape
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float32, device=q_nope.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        c = (k1 - k0) - (q1 - q0)
        score = torch.einsum("thd,shd->hts", q_nope[q0:q1].float(), k_nope[k0:k1].float())
        score += torch.einsum("thd,sd->hts", q_pe[q0:q1].float(), k_pe[k0:k1].float())
        qi = torch.arange(q1 - q0, device=score.device)
        ki = torch.arange(k1 - k0, device=score.device)
        mask = ki[None, :] > c + qi[:, None]  # [t, s]: above the bottom-right diagonal
        p = (score * scale).masked_fill(mask[None], float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hts,shd->thd", p, v[k0:k1].float())
    return out


# --------------------------------------------------------------------------------------------
# Triton kernel

if HAS_TRITON:

    @triton.jit
    def _attend(
        acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off, v_off,
        s_kn_t, s_kr_t, s_v_t, lo, hi, S, q_pos, offs_b, qk_scale,
        MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """The online softmax over key blocks [lo, hi) from the scalar bases (block lo's; they
        come back advanced past hi): acc [BM, V], m_i / l_i [BM] (base 2). MASKED: key n is
        seen by row i when n <= q_pos[i] (and n < S); else all are."""
        for n0 in range(lo, hi, BLOCK_N):
            kn = kn_base + kn_off
            kr = kr_base + kr_off
            vp = v_base + v_off
            if MASKED:
                offs_n = n0 + offs_b
                n_ok = offs_n < S
                k_n = tl.load(kn, mask=n_ok[None, :], other=0.0).to(DOT_DT)  # [N, BN]
                k_r = tl.load(kr, mask=n_ok[None, :], other=0.0).to(DOT_DT)  # [R, BN]
            else:
                k_n = tl.load(kn).to(DOT_DT)
                k_r = tl.load(kr).to(DOT_DT)
            s = tl.dot(q_r, k_r, tl.dot(q_n, k_n))  # [BM, BN] fp32
            if MASKED:
                s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
            # the row max scaled, then one FMA per score: exp2(s * scale log2 e - m); every
            # row sees key 0 in the first block, so m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(vp, mask=n_ok[:, None], other=0.0).to(DOT_DT)  # [BN, V]
            else:
                v = tl.load(vp).to(DOT_DT)
            acc = tl.dot(p.to(DOT_DT), v, acc * alpha[:, None])
            m_i = m_new
            kn_base += BLOCK_N * s_kn_t
            kr_base += BLOCK_N * s_kr_t
            v_base += BLOCK_N * s_v_t
        return acc, m_i, l_i, kn_base, kr_base, v_base

    @triton.jit
    def _softmax_pv(s, acc, m_i, l_i, v, qk_scale, DOT_DT: tl.constexpr):
        """One key block's online-softmax step: scores s [BM, BN] (unscaled), v [BN, V]."""
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(DOT_DT), v, acc * alpha[:, None])
        return acc, m_new, l_i

    @triton.jit
    def _attend_pipe(
        acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off, v_off,
        s_kn_t, s_kr_t, s_v_t, lo, hi, qk_scale,
        BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr,
    ):  # fmt: skip
        """_attend unmasked with the next block's QK issued before this block's softmax (its
        MMAs overlap the exp2s; FA3's intra-warpgroup overlap). Needs hi - lo >= BLOCK_N."""
        s = tl.dot(q_r, tl.load(kr_base + kr_off).to(DOT_DT),
                   tl.dot(q_n, tl.load(kn_base + kn_off).to(DOT_DT)))  # fmt: skip
        for _n0 in range(lo + BLOCK_N, hi, BLOCK_N):
            kn_base += BLOCK_N * s_kn_t
            kr_base += BLOCK_N * s_kr_t
            k_n = tl.load(kn_base + kn_off).to(DOT_DT)
            k_r = tl.load(kr_base + kr_off).to(DOT_DT)
            # the rope dot first: Triton waits for it before chaining the nope dot, whose 8
            # MMAs (128 of the 192 dims) then run under this block's softmax
            s_next = tl.dot(q_n, k_n, tl.dot(q_r, k_r))
            v = tl.load(v_base + v_off).to(DOT_DT)
            acc, m_i, l_i = _softmax_pv(s, acc, m_i, l_i, v, qk_scale, DOT_DT)
            v_base += BLOCK_N * s_v_t
            s = s_next
        v = tl.load(v_base + v_off).to(DOT_DT)
        acc, m_i, l_i = _softmax_pv(s, acc, m_i, l_i, v, qk_scale, DOT_DT)
        kn_base += BLOCK_N * s_kn_t
        kr_base += BLOCK_N * s_kr_t
        v_base += BLOCK_N * s_v_t
        return acc, m_i, l_i, kn_base, kr_base, v_base

    # M_BLOCKS follows the step's longest prompt: not specialized (== 1, % 16), so a new
    # length never compiles a variant inside a request
    @triton.jit(do_not_specialize=["M_BLOCKS"])
    def _mla_prefill_kernel(
        qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr,
        s_qn_t, s_qn_h, s_qr_t, s_qr_h, s_kn_t, s_kn_h, s_kr_t, s_v_t, s_v_h, s_o_t, s_o_h,
        qk_scale,  # scale * log2(e), > 0
        M_BLOCKS,  # cdiv(max_query_len, BLOCK_M)
        N: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr,
        ONE_LOOP: tl.constexpr, PIPE: tl.constexpr,
    ):  # fmt: skip
        m_blk = M_BLOCKS - 1 - tl.program_id(0)  # the longest causal rows first
        h = tl.program_id(1)
        b = tl.program_id(2)
        q0 = tl.load(cu_q_ptr + b)
        k0 = tl.load(cu_k_ptr + b)
        n_q = tl.load(cu_q_ptr + b + 1) - q0
        S = tl.load(cu_k_ptr + b + 1) - k0
        if m_blk * BLOCK_M >= n_q:
            return
        c = S - n_q  # cached keys: query i sees keys <= c + i
        offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)  # query index in the sequence
        row_ok = offs_m < n_q
        rows = (q0 + offs_m).to(tl.int64)
        offs_dn = tl.arange(0, N)
        offs_dr = tl.arange(0, R)
        offs_dv = tl.arange(0, V)
        offs_b = tl.arange(0, BLOCK_N)
        q_n = tl.load(qn_ptr + rows[:, None] * s_qn_t + h * s_qn_h + offs_dn[None, :],
                      mask=row_ok[:, None], other=0.0).to(DOT_DT)  # fmt: skip
        q_r = tl.load(qr_ptr + rows[:, None] * s_qr_t + h * s_qr_h + offs_dr[None, :],
                      mask=row_ok[:, None], other=0.0).to(DOT_DT)  # fmt: skip
        # a key block's addresses: a scalar base advanced per block (64-bit) + int32 offsets
        # (loop-invariant; no loop-carried pointer tensors: Triton 3.6 kept those in 160
        # registers a thread and spilled)
        k0l = k0.to(tl.int64)
        kn_base = kn_ptr + k0l * s_kn_t + h * s_kn_h
        kr_base = kr_ptr + k0l * s_kr_t
        v_base = v_ptr + k0l * s_v_t + h * s_v_h
        kn_off = offs_b[None, :] * s_kn_t + offs_dn[:, None]  # [N, BN]
        kr_off = offs_b[None, :] * s_kr_t + offs_dr[:, None]  # [R, BN]
        v_off = offs_b[:, None] * s_v_t + offs_dv[None, :]  # [BN, V]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V], tl.float32)
        q_pos = c + offs_m  # [BM] the last key each row sees
        hi = tl.minimum(c + (m_blk + 1) * BLOCK_M, S)  # past the block's last row's keys
        if ONE_LOOP:  # every block masked: one pipelined loop, one set of stage buffers
            acc, m_i, l_i, kn_base, kr_base, v_base = _attend(
                acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off, v_off,
                s_kn_t, s_kr_t, s_v_t, 0, hi, S, q_pos, offs_b, qk_scale,
                True, BLOCK_N, DOT_DT,
            )  # fmt: skip
        else:
            # keys every row of the block sees (n <= c + its first row): whole blocks, no mask
            full_end = (c + m_blk * BLOCK_M + 1) // BLOCK_N * BLOCK_N
            if PIPE:
                if full_end > 0:
                    acc, m_i, l_i, kn_base, kr_base, v_base = _attend_pipe(
                        acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off,
                        v_off, s_kn_t, s_kr_t, s_v_t, 0, full_end, qk_scale, BLOCK_N, DOT_DT,
                    )  # fmt: skip
            else:
                acc, m_i, l_i, kn_base, kr_base, v_base = _attend(
                    acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off, v_off,
                    s_kn_t, s_kr_t, s_v_t, 0, full_end, S, q_pos, offs_b, qk_scale,
                    False, BLOCK_N, DOT_DT,
                )  # fmt: skip
            # the diagonal: the rest, masked per row
            acc, m_i, l_i, kn_base, kr_base, v_base = _attend(
                acc, m_i, l_i, q_n, q_r, kn_base, kr_base, v_base, kn_off, kr_off, v_off,
                s_kn_t, s_kr_t, s_v_t, full_end, hi, S, q_pos, offs_b, qk_scale,
                True, BLOCK_N, DOT_DT,
            )  # fmt: skip
        o = acc / l_i[:, None]
        tl.store(o_ptr + rows[:, None] * s_o_t + h * s_o_h + offs_dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip


def default_config() -> dict:
    """128 query rows x 64 keys, 8 warps, 3 stages: each warpgroup 64 rows (one warpgroup MMA
    tall), the [128, 128] fp32 accumulator at 64 registers a thread; shared memory 3 x 40 KB of
    key + value stages + 48 KB of q. Triton 3.6's sm_90 build: 184 registers, no spill, 172 KB
    (sm_80's 163 KB cannot hold it: a launch there raises OutOfResources and the expanded path
    falls back to SDPA). The policy tables hold the measured pick (H100: 128 x 128 x 2 stages
    from 1025 tokens, 15% faster at 8K; benchmarks/mla_prefill_bench.py --sweep)."""
    return dict(block_m=128, block_n=64, num_warps=8, num_stages=3, one_loop=False, pipe=False)


def pick_config(configs, max_query_len: int) -> dict:
    """The first of `configs` (a table's list, each with "max_len": int or None, ascending)
    whose max_len covers `max_query_len`; none: `default_config()`."""
    configs = tuple(configs or ())
    i = band_index(configs, max_query_len, key="max_len")
    if i is None:
        return default_config()
    return {k: configs[i][k] for k in CONFIG_KEYS if k in configs[i]}


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_prefill_attention(
    q_nope: torch.Tensor,  # [T, H, N] (strided view ok; last dim contiguous)
    q_pe: torch.Tensor,  # [T, H, R]
    k_nope: torch.Tensor,  # [S_total, H, N] (e.g. kv_b_proj output [..., :N])
    k_pe: torch.Tensor,  # [S_total, R], shared by all heads
    v: torch.Tensor,  # [S_total, H, V] (e.g. kv_b_proj output [..., N:])
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, device
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32, device
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, V]
    config: dict | None = None,  # overrides of default_config (the policy table's pick)
) -> torch.Tensor:
    """Causal (bottom-right) MLA prompt attention over all sequences in one launch."""
    require_triton(q_nope)
    T, H, N = q_nope.shape
    R, V = q_pe.shape[-1], v.shape[-1]
    if q_pe.shape[:2] != (T, H) or k_nope.shape[1:] != (H, N) or v.shape[1] != H:
        raise ValueError(f"MLA prefill shapes: q_nope {tuple(q_nope.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, k_nope {tuple(k_nope.shape)}, v "
                         f"{tuple(v.shape)}")  # fmt: skip
    if k_pe.shape != (k_nope.shape[0], R) or v.shape[0] != k_nope.shape[0]:
        raise ValueError(f"k_pe {tuple(k_pe.shape)} / v {tuple(v.shape)} do not match k_nope "
                         f"{tuple(k_nope.shape)}")  # fmt: skip
    for name, d in (("nope dim", N), ("rope dim", R), ("v dim", V)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name}={d} must be a power of two >= 16 for the Triton kernel")
    if not scale > 0:
        raise ValueError(f"softmax scale={scale} must be positive")
    cfg = default_config()
    if config:
        unknown = set(config) - set(CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"unknown MLA prefill config keys {sorted(unknown)}; use {CONFIG_KEYS}"
            )
        cfg.update(config)
    bm, bn = cfg["block_m"], cfg["block_n"]
    for name, x in (("block_m", bm), ("block_n", bn)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"MLA prefill {name}={x}: a power of two >= 16 (an MMA operand)")
    q_nope, q_pe, k_nope, k_pe, v = map(_last_dim_unit, (q_nope, q_pe, k_nope, k_pe, v))
    if out is None:
        out = torch.empty(T, H, V, dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != (T, H, V) or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be [{T}, {H}, {V}], last dim contiguous")
    B = cu_seqlens_q.shape[0] - 1
    if T == 0 or B <= 0 or max_query_len <= 0:
        return out
    m_blocks = cdiv(max_query_len, bm)
    dt = tl.float32 if q_nope.dtype == torch.float32 else dot_dtype()
    _mla_prefill_kernel[(m_blocks, H, B)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), float(scale) * math.log2(math.e), m_blocks,
        N=N, R=R, V=V, BLOCK_M=bm, BLOCK_N=bn, DOT_DT=dt, ONE_LOOP=bool(cfg["one_loop"]),
        PIPE=bool(cfg["pipe"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def prefill_flops(q_lens, k_lens, H: int, N: int, R: int, V: int) -> float:
    """The real work of causal MLA prompts: 2 x (N + R + V) per (query, visible key, head);
    query i of a sequence with c cached keys sees c + i + 1 keys."""
    pairs = sum(q * (k - q) + q * (q + 1) / 2 for q, k in zip(q_lens, k_lens, strict=True))
    return 2.0 * pairs * H * (N + R + V)


__all__ = [
    "CONFIG_KEYS",
    "LAUNCH_ERRORS",
    "default_config",
    "mla_prefill_attention",
    "mla_prefill_ref",
    "pick_config",
    "prefill_flops",
]
