"""TorchMLABackend splits a long prompt's queries into chunks so that the float32 scores stay
bounded (SCORES_MAX_ELEMS): the chunked result equals the one-chunk result, causal mask and
cached prefix included."""

from __future__ import annotations

import torch

from k2serve.attention import torch_ref
from k2serve.attention.base import AttentionMetadata
from k2serve.attention.torch_ref import TorchMLABackend


def test_query_chunks_equal_one_chunk(monkeypatch):
    g = torch.Generator().manual_seed(0)
    H, L, R, ps, ctx, q = 4, 32, 16, 16, 21, 37  # a cached prefix, then 37 new tokens
    n_pages = -(-(ctx + q) // ps)
    kv = torch.randn(n_pages + 1, ps, L + R, generator=g)
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, q], dtype=torch.int32),
        seq_lens=torch.tensor([ctx + q], dtype=torch.int32),
        context_lens=torch.tensor([ctx], dtype=torch.int32),
        block_table=torch.arange(1, n_pages + 1, dtype=torch.int32)[None],
        slot_mapping=torch.arange(ps + ctx, ps + ctx + q, dtype=torch.int64),
        max_query_len=q, max_seq_len=ctx + q, page_size=ps,
    )  # fmt: skip
    ql, qp = torch.randn(q, H, L, generator=g), torch.randn(q, H, R, generator=g)
    be = TorchMLABackend()
    whole = be.forward(ql, qp, kv, md, 0.1)
    # 5 query rows per chunk (8 chunks, the last one short)
    monkeypatch.setattr(torch_ref, "SCORES_MAX_ELEMS", 5 * H * (ctx + q))
    chunked = be.forward(ql, qp, kv, md, 0.1)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    # a row's result does not depend on the others: the first query sees only ctx + 1 keys
    S0 = ctx + 1
    flat = kv[1:].reshape(-1, L + R)[:S0]
    s = (ql[0] @ flat[:, :L].T + qp[0] @ flat[:, L:].T) * 0.1  # [H, S0]
    ref0 = torch.softmax(s, -1) @ flat[:, :L]
    torch.testing.assert_close(chunked[0], ref0, rtol=1e-5, atol=1e-5)
