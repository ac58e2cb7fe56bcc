"""Absorbed MLA on the CPU for bf16 caches through torch's CPU flash-attention kernel.

The torch reference (torch_ref.py) gathers a sequence's pages, converts them to float32 and runs
einsums: at K2's shapes (64 heads, latent 512 + rope 64) that is 2% of the read bandwidth for one
decode token and ~40% of the float32 matmul rate for a prompt. Here the same attention runs on
bf16 operands with float32 scores and softmax, as a GPU flash kernel computes it:

- `aten::_scaled_dot_product_flash_attention_for_cpu` (oneDNN brgemm: AMX / AVX512-BF16 where the
  CPU has them) with q = [q_latent | q_pe] and k = v = the cached [latent | k_pe] rows (the kernel
  wants one head size: the 64 rope columns of the output are computed and dropped);
- the cached keys are shared by every head, so the heads are rows of one query block ("MQA"), and
  the keys a query block sees unmasked are split into chunks run as the batch (split-KV: a decode
  token's 64 rows would otherwise keep 2 threads busy); each part returns its log-sum-exp and the
  parts are merged in float32;
- the new tokens of a prompt see each other causally: that square block runs per head with the
  kernel's (top-left) causal mask, which is the right mask for a square block;
- a decode's 64 rows go in as 2 heads of HEAD_ROWS = 32 (the kernel then skips its upfront
  packing of K and V, which costs more than it saves at so few rows);
- a sequence's pages are read SEGMENT_KEYS rows at a time, in place where they are one run of
  consecutive pages, else gathered (index_select), so that every buffer stays ~10-20 MB: glibc
  serves allocations over 32 MB with fresh mmaps, and their page faults made a 32K-token decode
  3x slower than 4x the 8K one (a 38 MB gather: 9.6 ms fresh, 2 ms into reused memory, on the
  2-core dev box).

Invariants: same result as the reference up to bf16 rounding of the parts' outputs (the scores,
softmax and merge are float32); queries run in chunks of QUERY_CHUNK tokens so that the float32
merge buffers stay bounded.
"""

from __future__ import annotations

import torch

QUERY_CHUNK = 128  # new tokens per pass (rows = tokens x heads: 8,192 at 64 heads)
SEGMENT_KEYS = 8192  # cached rows gathered per kernel call (9.4 MB at K2's 576 bf16)
MIN_KEYS_PER_SPLIT = 512  # the kernel's key block: smaller splits only add merge work
HEAD_ROWS = 32  # a decode's rows per kernel head (2-core box, 64 rows at 8K: 1.63 ms vs 2.1)
# a one-token decode over fewer keys on scattered pages stays on the float32 einsums: the 16-core
# H100 host, K2 shapes, shuffled pages: 8K 2.64 ms here vs 2.39 einsums, 32K 8.76 vs 21.6; on
# consecutive pages (read in place) 8K takes 1.00 ms (benchmarks/cpu_attn.py, RESULTS.md).
# Where the native kernel runs (kernels/cpu/mla.py) decodes and verify steps take it instead.
DECODE_MIN_KEYS = 16384


def available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _flash(q, k, scale: float, is_causal: bool = False):
    """q [B, H, M, E], k = v [B, H, N, E] (strides may be 0) -> out [B, H, M, E], lse [B, H, M]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, k, 0.0, is_causal, scale=scale
    )


def _unmasked(q: torch.Tensor, kv: torch.Tensor, scale: float) -> list[tuple]:
    """Rows q [M, E] over every row of kv [N, E], N split into chunks run as the batch ->
    [(out [P, M, E], lse [P, M])]: the chunks, then the remainder (< P rows) if any. A few
    rows (a decode's 64 heads) go in as heads of HEAD_ROWS rows: below 64 rows per head the
    kernel skips its upfront packing of K and V, which costs more than it saves here."""
    (M, E), N = q.shape, kv.shape[0]
    h = M // HEAD_ROWS if M < 192 and M % HEAD_ROWS == 0 else 1
    splits = max(1, min(N // MIN_KEYS_PER_SPLIT, -(-2 * torch.get_num_threads() // -(-M // 32))))
    parts = []
    for P, keys in ((splits, kv[: N // splits * splits]), (1, kv[N // splits * splits :])):
        if keys.shape[0] == 0:
            continue
        n = keys.shape[0] // P
        out, lse = _flash(
            q.view(1, h, M // h, E).expand(P, h, M // h, E),
            keys.view(P, 1, n, E).expand(P, h, n, E),
            scale,
        )  # [P, h, M / h, E], [P, h, M / h]
        parts.append((out.reshape(P, M, E), lse.reshape(P, M)))
    return parts


def _rows(kv_cache: torch.Tensor, pages: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Cache rows a..b-1 of a sequence whose pages are `pages` -> [b - a, E], contiguous: a
    view when those pages are one run of consecutive ids (a prompt's pages taken at once from
    the pool's free queue), else a copy (index_select: 3x faster than kv_cache[pages])."""
    ps = kv_cache.shape[1]
    p0, p1 = a // ps, -(-b // ps)
    idx = pages[p0:p1]
    if p1 - p0 == 1 or bool((idx[1:] - idx[:-1] == 1).all()):
        first = int(idx[0])
        rows = kv_cache[first : first + p1 - p0].view((p1 - p0) * ps, -1)
    else:
        rows = kv_cache.index_select(0, idx).view((p1 - p0) * ps, -1)
    return rows[a - p0 * ps : b - p0 * ps]


def mla_sequence(
    q: torch.Tensor,  # [n, H, E] bf16: [q_latent | q_pe] of one sequence's new tokens
    kv_cache: torch.Tensor,  # [num_pages, page_size, E] bf16, contiguous
    pages: torch.Tensor,  # [>= ceil(S / page_size)] int64, the sequence's pages
    ctx: int,  # tokens cached before the new ones (S = ctx + n)
    scale: float,
    out: torch.Tensor,  # [n, H, L] written: L = the latent width (the output columns)
) -> None:
    n, H, E = q.shape
    L = out.shape[-1]
    ps = kv_cache.shape[1]
    seg = max(ps, SEGMENT_KEYS // ps * ps)
    for c0 in range(0, n, QUERY_CHUNK):
        c1 = min(n, c0 + QUERY_CHUNK)
        m = c1 - c0
        qc = q[c0:c1]  # [m, H, E]
        qrows = qc.reshape(m * H, E)
        # keys every row of the chunk sees: all before the chunk (and, for one token, itself)
        seen = ctx + c0 + (1 if m == 1 else 0)
        parts = []
        for a in range(0, seen, seg):
            parts += _unmasked(qrows, _rows(kv_cache, pages, a, min(seen, a + seg)), scale)
        if m > 1:  # the chunk's own tokens, causal: per head, heads in the batch's H
            keys = _rows(kv_cache, pages, ctx + c0, ctx + c1)  # [m, E]
            o, lse = _flash(
                qc.transpose(0, 1)[None], keys[None, None].expand(1, H, m, E), scale, True
            )  # [1, H, m, E], [1, H, m]
            o, lse = o.transpose(1, 2).reshape(1, m * H, E), lse.transpose(1, 2).reshape(1, m * H)
            parts.append((o, lse))
        out[c0:c1] = _merge(parts, L).view(m, H, L)  # float32 -> out's dtype


def _merge(parts: list[tuple], L: int) -> torch.Tensor:
    """[(out [P, M, E], lse [P, M])] -> [M, L] float32: the parts weighted by their share of
    each row's softmax mass, exp(lse_p - logsumexp_p(lse))."""
    if len(parts) == 1 and parts[0][0].shape[0] == 1:
        return parts[0][0][0, :, :L].float()
    w = torch.softmax(torch.cat([p[1] for p in parts]), dim=0)  # [sum P, M]
    res, i = torch.zeros(w.shape[1], L, dtype=torch.float32), 0
    for o, _ in parts:
        P = o.shape[0]
        if P == 1:  # a prompt's large part: no float32 copy of it
            res.addcmul_(o[0, :, :L], w[i, :, None])
        else:  # a decode's key splits (few rows): one pass over all of them
            res.add_((o[..., :L].float() * w[i : i + P, :, None]).sum(0))
        i += P
    return res
