"""CUDA graphs of the EAGLE-3 draft's one-token steps (engine.spec_decode.eagle_graphs), run on
the CPU through the fake graph factory of tests/integration/fake_graphs.py (records the torch
ops of a capture and replays them on the captured buffers, raises on host syncs): over several
steps with continuous batching (mixed batch sizes, padded buckets, chunked prefill), the
graph-drafted tokens equal the eagerly drafted ones, in float32, for both head layouts; the
CUDA run is in test_spec_decode_gpu.py."""

import pytest
import torch
from tests.integration.fake_graphs import GraphSafeMLA, TapeGraphFactory

from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.spec_decode.eagle_graphs import draft_buckets

from .test_spec_decode import generate
from .test_spec_decode_eagle import BASE, draft_dir, eagle_engine, prompts, target  # noqa: F401


def _record(eng) -> list:
    """Wrap the engine's proposer: -> the list each step's drafts are appended to."""
    prop = eng.drafter.eagle
    inner, log = prop.propose, []

    def propose(want, sched):
        inner(want, sched)
        log.append(sorted((r.request_id, list(r.spec_token_ids)) for r, _ in want))

    prop.propose = propose
    return log


def test_draft_buckets_follow_the_target():
    buckets = (1, 2, 3, 4, 8, 16, 24, 32)
    assert draft_buckets(buckets, 8) == (1, 2, 3, 4, 8)
    assert draft_buckets(buckets, 5) == (1, 2, 3, 4, 8)
    assert draft_buckets(buckets, 64) == buckets


@pytest.mark.parametrize("layout", ["mla", "llama"])
def test_graph_drafts_equal_eager_drafts(tmp_path, target, layout):  # noqa: F811
    d = draft_dir(tmp_path, target, layout, False, 600, False)
    kw = dict(k=3, max_num_batched_tokens=24, max_num_seqs=6)
    eager = eagle_engine(target, d, **kw)
    graph = eagle_engine(target, d, **kw)
    prop = graph.drafter.eagle
    if layout == "mla":  # the head's backend (the target's, on the CPU) made graph-safe
        prop.head.midlayer.self_attn.backend = GraphSafeMLA()
    factory = TapeGraphFactory()
    prop.setup_graphs((1, 2, 4, 8), BASE["max_model_len"] // BASE["page_size"], factory)
    assert prop.graphs is not None and prop.graphs.buckets == (1, 2, 4, 8)
    logs = _record(eager), _record(graph)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ps = prompts() + prompts()[2:]  # 8 requests, one added per step: batch sizes 1..6
    ref = generate(eager, ps, params, stagger=True)
    got = generate(graph, ps, params, stagger=True)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert logs[1] == logs[0]  # every step's drafts, request by request
    assert sum(len(d) for step in logs[1] for _, d in step) > 100
    assert graph.drafter.stats.num_accepted_tokens == eager.drafter.stats.num_accepted_tokens
    replays = {bs: sum(g.replays for g in gs) for bs, gs in prop.graphs.runner.graphs.items()}
    assert sum(r > 0 for r in replays.values()) >= 3, replays  # several (padded) batch sizes
    assert sum(replays.values()) > 2 * len(logs[1]), replays  # the first forward's too


def test_capture_failure_leaves_eager(tmp_path, target, caplog):  # noqa: F811
    d = draft_dir(tmp_path, target, "mla", False, 600, False)
    eng = eagle_engine(target, d, k=2)
    prop = eng.drafter.eagle

    class Failing(TapeGraphFactory):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    with caplog.at_level("WARNING"):
        prop.setup_graphs((1, 2), 64, Failing())
    assert prop.graphs is None
    assert "EAGLE-3 draft CUDA graphs: off" in caplog.text
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generate(eng, prompts()[:2], params)
    assert eng.drafter.stats.num_drafts > 0


def test_paged_gqa_decode_equals_paged_gqa():
    """The graph-safe one-token attention of the Llama head (every page of the block table,
    masked) equals the eager per-sequence one."""
    from k2serve.attention.base import AttentionMetadata
    from k2serve.model.eagle3 import paged_gqa, paged_gqa_decode

    g = torch.Generator().manual_seed(0)
    H, KVH, D, ps = 8, 2, 16, 4
    flat = torch.randn(11 * ps, 2, KVH, D, generator=g)
    table = torch.tensor([[5, 1, 0], [2, 0, 0], [7, 3, 9]], dtype=torch.int32)
    lens = torch.tensor([7, 1, 12], dtype=torch.int32)
    q = torch.randn(3, H, D, generator=g)
    md = AttentionMetadata(torch.arange(4, dtype=torch.int32), lens, lens - 1, table,
                           torch.zeros(3, dtype=torch.long), 1, 12, ps, 3)  # fmt: skip
    torch.testing.assert_close(paged_gqa_decode(q, flat, md), paged_gqa(q, flat, md))
