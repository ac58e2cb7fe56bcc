"""The CPU flash path of TorchMLABackend (bf16 queries over a bf16 cache) against the float32
einsums of the same backend (cpu_flash=False) on the same bf16 cache: decodes, prompts with and
without a cached prefix, several sequences on descending or consecutive pages, query chunks and
key splits."""

from __future__ import annotations

import pytest
import torch

from k2serve.attention import cpu_flash
from k2serve.attention.base import AttentionMetadata
from k2serve.attention.torch_ref import TorchMLABackend

pytestmark = pytest.mark.skipif(not cpu_flash.available(), reason="no CPU flash kernel")

H, L, R, PS = 8, 64, 16, 16


def case(ctxs, qlens, seed=0, consecutive=False):
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-(c + q) // PS) for c, q in zip(ctxs, qlens, strict=True)]
    total = sum(pages_per) + 2
    kv = (torch.randn(total, PS, L + R, generator=g)).bfloat16()
    # pages in descending order (gathered), or each sequence on one run of ids (read in place)
    perm = list(range(1, total)) if consecutive else list(range(total - 1, -1, -1))
    table = torch.zeros(len(ctxs), max(pages_per), dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = torch.tensor(perm[i : i + n])
        i += n
    T = sum(qlens)
    qsl = [0, *torch.tensor(qlens).cumsum(0).tolist()]
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in zip(ctxs, qlens, strict=True)], dtype=torch.int32),
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(T, dtype=torch.int64),  # forward does not read it
        max_query_len=max(qlens), max_seq_len=max(c + q for c, q in zip(ctxs, qlens, strict=True)),
        page_size=PS, num_decodes=sum(q == 1 for q in qlens),
    )  # fmt: skip
    ql = (torch.randn(T, H, L, generator=g) * 0.3).bfloat16()
    qp = (torch.randn(T, H, R, generator=g) * 0.3).bfloat16()
    return ql, qp, kv, md


@pytest.mark.parametrize(
    "ctxs,qlens",
    [([700], [1]), ([0], [1]), ([37, 600, 5], [1, 1, 1]), ([0], [45]), ([300], [70]),
     ([600, 3, 0], [1, 9, 33])],
)  # fmt: skip
@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("consecutive", [False, True])
def test_flash_matches_the_float32_einsums(monkeypatch, ctxs, qlens, small, consecutive):
    monkeypatch.setattr(cpu_flash, "DECODE_MIN_KEYS", 0)  # every decode on the flash path
    if small:  # key segments, key splits (+ a remainder), query chunks, rows as heads
        monkeypatch.setattr(cpu_flash, "SEGMENT_KEYS", 100)  # 96 rows: 6 pages
        monkeypatch.setattr(cpu_flash, "MIN_KEYS_PER_SPLIT", 32)
        monkeypatch.setattr(cpu_flash, "QUERY_CHUNK", 16)
        monkeypatch.setattr(cpu_flash, "HEAD_ROWS", 4)  # a decode's 8 rows as 2 heads
    ql, qp, kv, md = case(ctxs, qlens, consecutive=consecutive)
    gathers = []
    select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda *a: gathers.append(1) or select(*a))
    fast = TorchMLABackend().forward(ql, qp, kv, md, 0.2)
    if consecutive:  # a run of pages is read in place
        assert not gathers
    elif max(c + q for c, q in zip(ctxs, qlens, strict=True)) > PS:
        assert gathers
    ref = TorchMLABackend(cpu_flash=False).forward(ql.float(), qp.float(), kv, md, 0.2)
    assert fast.dtype == torch.bfloat16
    # bf16 rounding of the output (and of the parts before the merge) only
    torch.testing.assert_close(fast.float(), ref, rtol=2e-2, atol=1e-2)
    ref_bf16 = ref.bfloat16().float()
    assert (fast.float() - ref).abs().max() <= 3 * (ref_bf16 - ref).abs().max() + 1e-3


def test_float32_and_opt_out_keep_the_einsums():
    ql, qp, kv, md = case([300], [70])
    a = TorchMLABackend(cpu_flash=False).forward(ql, qp, kv, md, 0.2)
    b = TorchMLABackend(cpu_flash=False).forward(ql, qp, kv, md, 0.2)
    assert torch.equal(a, b)
    assert not TorchMLABackend()._flash_path(ql.float(), qp.float(), kv.float())
    assert not TorchMLABackend(cpu_flash=False)._flash_path(ql, qp, kv)
    assert TorchMLABackend()._flash_path(ql, qp, kv)


@pytest.mark.parametrize("consecutive", [False, True])
def test_short_decode_on_scattered_pages_keeps_the_einsums(monkeypatch, consecutive):
    """Below DECODE_MIN_KEYS a decode takes the flash path only on one run of pages (read in
    place); on scattered pages the einsums are faster (no gather)."""
    ql, qp, kv, md = case([700], [1], consecutive=consecutive)
    calls = []
    seq = cpu_flash.mla_sequence
    monkeypatch.setattr(cpu_flash, "mla_sequence", lambda *a: calls.append(1) or seq(*a))
    TorchMLABackend().forward(ql, qp, kv, md, 0.2)
    assert bool(calls) == consecutive
    calls.clear()
    monkeypatch.setattr(cpu_flash, "DECODE_MIN_KEYS", 512)
    TorchMLABackend().forward(ql, qp, kv, md, 0.2)
    assert calls
