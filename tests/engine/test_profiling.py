"""The profiling pass's batches (engine/profiling.py): the largest prefill and decode steps are
valid flat batches that the model runs over a scratch cache; on CUDA the pass measures a peak
that grows with the step."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import needs_cuda

from k2serve.attention import allocate_kv_caches
from k2serve.engine.profiling import _metadata, _prefill_lens, profile_run


def test_prefill_lens_fill_the_step_budget_within_the_context_and_the_seqs():
    assert _prefill_lens(10, 4, 8) == [4, 4, 2]
    assert _prefill_lens(2048, 8192, 8) == [2048]
    assert _prefill_lens(100, 10, 3) == [10, 10, 10]  # no more sequences than max_num_seqs


def test_metadata_lays_each_sequence_on_its_own_pages():
    ids, pos, md, pages = _metadata([5, 3], 4, torch.device("cpu"))
    assert pages == 3 and ids.shape == pos.shape == (8,)
    assert md.block_table.tolist() == [[0, 1], [2, 0]]
    assert md.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert md.query_start_loc.tolist() == [0, 5, 8] and md.num_decodes == 0
    assert _metadata([1, 1, 1], 4, torch.device("cpu"))[2].num_decodes == 3


def test_the_model_runs_the_profile_batches(ckpt):
    """The batches are what the runner builds: the real model runs them (torch backends)."""
    from k2serve.weights.loader import load_model

    model = load_model(ckpt, dtype=torch.float32, progress=False)
    for lens in ([20, 12], [1, 1, 1, 1]):
        ids, pos, md, pages = _metadata(lens, 16, torch.device("cpu"))
        caches = allocate_kv_caches(model.config, pages, 16, torch.float32)
        hidden = model(ids, pos, attn_metadata=md, kv_caches=caches)
        assert hidden.shape == (sum(lens), model.config.hidden_size)
        assert torch.isfinite(hidden).all() and caches[0].abs().sum() > 0


@pytest.mark.gpu
@needs_cuda
def test_profiled_peak_grows_with_the_step(ckpt):
    from k2serve.weights.loader import load_model

    model = load_model(ckpt, dtype=torch.bfloat16, device="cuda", progress=False)
    kw = dict(page_size=16, max_num_seqs=8, max_model_len=4096)
    # the first pass also allocates what stays (cuBLAS's workspace, kernels' cached buffers):
    # warm up, so that the two passes compare their activations only
    profile_run(model, torch.bfloat16, torch.device("cuda"), max_num_batched_tokens=256, **kw)
    small = profile_run(model, torch.bfloat16, torch.device("cuda"), max_num_batched_tokens=256,
                        **kw)  # fmt: skip
    large = profile_run(model, torch.bfloat16, torch.device("cuda"), max_num_batched_tokens=4096,
                        **kw)  # fmt: skip
    assert 0 < small < large
