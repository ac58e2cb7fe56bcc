"""Absorbed MLA over the paged latent cache vs the naive one-sequence forward (issue 2)."""

from __future__ import annotations

import torch
from tests.model.conftest import tiny_config

from k2serve.attention import AttentionMetadata, TorchMLABackend, allocate_kv_caches
from k2serve.weights.loader import load_model

PAGE = 4


def _model(kind="deepseek"):
    from k2serve.config import ModelConfig

    cfg = ModelConfig.from_hf(tiny_config(kind, "bf16"))
    return load_model(
        None, dtype=torch.float32, load_format="dummy", config=cfg, seed=3, progress=False
    )


class _Seq:
    def __init__(self, ids: list[int], pages: list[int]) -> None:
        self.ids, self.pages, self.computed = ids, pages, 0


def _step(model, caches, seqs: list[_Seq], new_counts: list[int]) -> list[torch.Tensor]:
    """Run one paged step: seq b gets new_counts[b] new tokens. Returns hidden per sequence."""
    ids, pos, slots, qsl = [], [], [], [0]
    for s, n in zip(seqs, new_counts, strict=True):
        for p in range(s.computed, s.computed + n):
            ids.append(s.ids[p])
            pos.append(p)
            slots.append(s.pages[p // PAGE] * PAGE + p % PAGE)
        qsl.append(qsl[-1] + n)
    max_pages = max(len(s.pages) for s in seqs)
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(
            [s.computed + n for s, n in zip(seqs, new_counts, strict=True)], dtype=torch.int32
        ),
        context_lens=torch.tensor([s.computed for s in seqs], dtype=torch.int32),
        block_table=torch.tensor(
            [s.pages + [0] * (max_pages - len(s.pages)) for s in seqs], dtype=torch.int32
        ),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(new_counts),
        max_seq_len=max(s.computed + n for s, n in zip(seqs, new_counts, strict=True)),
        page_size=PAGE,
        num_decodes=sum(1 for n in new_counts if n == 1),
    )
    h = model(torch.tensor(ids), torch.tensor(pos), md, caches)
    for s, n in zip(seqs, new_counts, strict=True):
        s.computed += n
    return [h[qsl[b] : qsl[b + 1]] for b in range(len(seqs))]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_naive_and_absorbed_agree_fp32():
    model = _model("kimi")
    ids = torch.randint(0, 512, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    naive = model(torch.tensor(ids), torch.arange(len(ids)))
    caches = allocate_kv_caches(model.config, 8, PAGE, torch.float32, "cpu")
    seq = _Seq(ids, pages=[5, 2, 7, 0])  # scattered pages
    (paged,) = _step(model, caches, [seq], [len(ids)])
    assert _rel(paged, naive) <= 1e-5


def test_paged_batches_with_prefix_context_equal_one_sequence_forward():
    model = _model("deepseek")
    g = torch.Generator().manual_seed(1)
    lens = [11, 6, 9]
    seqs = []
    free = torch.randperm(20, generator=g).tolist()
    for n in lens:
        pages = [free.pop() for _ in range(-(-n // PAGE))]
        seqs.append(_Seq(torch.randint(0, 512, (n,), generator=g).tolist(), pages))
    caches = allocate_kv_caches(model.config, 20, PAGE, torch.float32, "cpu")
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    # step 1: chunked prefill of different lengths; step 2: decodes first, then prefill chunks
    # with context; step 3: the rest
    plans = [[5, 3, 4], [1, 1, 3], [5, 2, 2]]
    order = [[0, 1, 2], [1, 0, 2], [0, 1, 2]]
    for plan, perm in zip(plans, order, strict=True):
        batch = [seqs[i] for i in perm]
        outs = _step(model, caches, batch, plan)
        for i, o in zip(perm, outs, strict=True):
            got[i].append(o)
    for s, parts in zip(seqs, got, strict=True):
        assert s.computed == len(s.ids)
        ref = model(torch.tensor(s.ids), torch.arange(len(s.ids)))
        assert _rel(torch.cat(parts), ref) <= 1e-5


def test_backend_masks_by_position():
    """A query must not see cache entries at positions after its own."""
    be = TorchMLABackend()
    L, R, H = 8, 4, 2
    cache = torch.zeros(2, PAGE, L + R)
    latent, k_pe = torch.randn(3, L), torch.randn(3, R)
    be.store(cache, latent, k_pe, torch.tensor([4, 5, 6]))
    md = AttentionMetadata(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        context_lens=torch.tensor([0], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=torch.tensor([4, 5, 6]),
        max_query_len=3,
        max_seq_len=3,
        page_size=PAGE,
    )
    out = be.forward(torch.randn(3, H, L), torch.randn(3, H, R), cache, md, 0.5)
    # the first token sees only itself: its output is exactly its own latent
    torch.testing.assert_close(out[0], latent[0].expand(H, L))
    assert torch.equal(cache[1, :3, :L], latent) and torch.equal(cache[1, :3, L:], k_pe)


def test_paged_bf16_close_to_naive_bf16():
    """The default serving dtype: cache, absorbed weights and backend all in bf16."""
    from k2serve.config import ModelConfig

    cfg = ModelConfig.from_hf(tiny_config("kimi", "int4"))
    model = load_model(
        None, dtype=torch.bfloat16, load_format="dummy", config=cfg, seed=5, progress=False
    )
    ids = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    naive = model(torch.tensor(ids), torch.arange(len(ids))).float()
    caches = allocate_kv_caches(model.config, 4, PAGE, torch.bfloat16, "cpu")
    seq = _Seq(ids, pages=[3, 1, 2])
    parts = _step(model, caches, [seq], [6]) + _step(model, caches, [seq], [4])
    assert caches[0].dtype == torch.bfloat16
    assert _rel(torch.cat(parts).float(), naive) <= 3e-2


def test_bad_inputs_are_clear_errors():
    import pytest

    model = _model("kimi")
    with pytest.raises(ValueError, match="1-D"):
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))
    seq = _Seq([1, 2, 3], pages=[0])
    with pytest.raises(ValueError, match="kv_caches"):
        _step(model, None, [seq], [3])
    with pytest.raises(ValueError, match="num_pages"):
        allocate_kv_caches(model.config, 0, PAGE, torch.float32, "cpu")
