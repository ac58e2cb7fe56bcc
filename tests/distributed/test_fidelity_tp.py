"""Tensor / expert parallel against one process with the routing pinned (k2serve.testing.
fidelity.check_parallel), over gloo on the CPU in bf16: every layer within the bf16 rounding
budget that TP=1 itself has against the float32 gold pass."""

from __future__ import annotations

import pytest
import torch

from k2serve.testing.fidelity import check_parallel, decode_batch, prefix_prefill_batch

from .conftest import small_config


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_tp2_and_ep_within_bf16_rounding_layer_by_layer(fmt):
    from k2serve.distributed.workers import WorkerGroup

    group = WorkerGroup(2, "cpu")
    try:
        for ep in (False, True):
            res = check_parallel(group, small_config(fmt), torch.bfloat16,
                                 [decode_batch(8, 40), prefix_prefill_batch()], device="cpu",
                                 expert_parallel=ep, log=lambda s: None)  # fmt: skip
            assert all(r.ok for r in res), [r.line() for r in res]
    finally:
        group.shutdown()
