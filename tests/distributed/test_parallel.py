"""Sharded model over 2 ranks (gloo, CPU) vs the single-process model: the same logits on the
naive path and on the paged path (prefill then decodes), with and without expert parallel,
bf16 and int4 checkpoints. One worker process for the whole module."""

import pytest
import torch

from k2serve.distributed.workers import WorkerGroup
from k2serve.weights.loader import load_model

from . import rank_fns

IDS = [5, 17, 99, 3, 1000, 42, 7, 8, 1500, 64]


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(2, "cpu")
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def references(ckpts):
    out = {}
    for fmt, path in ckpts.items():
        model = load_model(path, dtype=torch.float32, progress=False)
        out[fmt] = rank_fns.logits_both_paths(model, IDS)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_sharded_logits_equal_single_process(group, ckpts, references, fmt, ep):
    sizes = group.run(rank_fns.load_shard, ckpts[fmt], ep)
    assert sizes[0] > 0 and sizes[1] > 0
    naive, paged = group.run(rank_fns.run_shard, IDS)[0]
    ref_naive, ref_paged = references[fmt]
    assert naive.shape == ref_naive.shape == (len(IDS), 2048)
    assert _rel(naive, ref_naive) < 1e-5
    assert _rel(paged, ref_paged) < 1e-5
    # the logits are not degenerate (else equality would prove little)
    assert ref_naive.std() > 0.1 and (ref_naive.argmax(-1) == naive.argmax(-1)).all()
