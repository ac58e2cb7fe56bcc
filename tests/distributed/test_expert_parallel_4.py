"""Expert-parallel MoE over 4 gloo ranks (one with no tokens) against one process."""

import pytest

from k2serve.distributed.workers import WorkerGroup

from . import rank_fns_ep
from .test_expert_parallel import IDS, check


@pytest.mark.slow
def test_ep_moe_equals_single_process_4_ranks(ckpts):
    g = WorkerGroup(4, "cpu")
    try:
        tokens = [4, 0, 7, 1]
        ids = [IDS[0], [], IDS[2], IDS[3]]
        for redundant in (0, 4):
            out = g.run(rank_fns_ep.moe_vs_single, ckpts["bf16"], redundant, tokens, ids)
            check(out, tokens, ids, 2)
    finally:
        g.shutdown()
