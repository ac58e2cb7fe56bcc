"""MoE over expert parallelism with all-to-all dispatch/combine (gloo, CPU) against the
single-process MoE: with 2 and 4 ranks, with and without redundant replicas, and with a rank
that has no tokens (it still takes part in every all-to-all)."""

import pytest

from k2serve.distributed.workers import WorkerGroup

from . import rank_fns_ep

IDS = [[5, 17, 99, 3, 1000], [42, 7], [8, 1500, 64], [11]]


@pytest.fixture(scope="module")
def group2():
    g = WorkerGroup(2, "cpu")
    yield g
    g.shutdown()


def check(results, tokens, ids, k):
    for r, (diffs, _equal, rel, pairs) in enumerate(results):
        # NOTE: bitwise equal as a rule; a replica's rows may go through a GEMM of another
        # height than in one process, which can change the last float32 bit
        assert max(diffs) <= 1e-6, f"rank {r}: MoE differs from one process by {diffs}"
        assert rel < 1e-6, f"rank {r}: logits differ by {rel}"
        # the rank recorded its own pairs: MoE layers (2) x its tokens x k, layer and model calls
        assert pairs == 2 * (tokens[r] + len(ids[r])) * k


@pytest.mark.parametrize("redundant", [0, 2], ids=["plain", "redundant"])
@pytest.mark.parametrize("tokens", [[6, 3], [0, 5]], ids=["busy", "idle-rank"])
def test_ep_moe_equals_single_process_2_ranks(group2, ckpts, redundant, tokens):
    ids = IDS[:2] if tokens[0] else [[], IDS[1]]
    out = group2.run(rank_fns_ep.moe_vs_single, ckpts["bf16"], redundant, tokens, ids)
    check(out, tokens, ids, 2)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_eplb_rebalance_moves_weights_mid_run(group2, ckpts, fmt):
    out = group2.run(rank_fns_ep.rebalance_mid_run, ckpts[fmt], 2, 6)
    for r, (eq, n, (before, after), held) in enumerate(out):
        assert max(eq) <= 1e-6, f"rank {r}: output changed across the rebalance: {eq}"
        assert n == 1
        assert after <= before
        print(f"rank {r}: imbalance {before:.3f} -> {after:.3f}, holds {held}")
    # the two ranks hold, together, every logical expert of every layer
    for layer in range(2):
        assert set(out[0][3][layer]) | set(out[1][3][layer]) == set(range(8))
