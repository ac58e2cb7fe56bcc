"""The host KV tier on CUDA (skipped without it): pinned host buffers, copies on the side stream
that do not block the host, exact round trips, and the engine's greedy outputs identical with
the tier on and off on the tiny MLA model with a device pool far smaller than the trace."""

import random
import time

import pytest
import torch

from k2serve.cache.host_tier import D2H, H2D, KVCopier, KVTransfers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _transfers(kind, pairs):
    t = KVTransfers()
    for s, d in pairs:
        t.add(kind, s, d)
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_copier_round_trip_is_exact_and_async(dtype):
    torch.manual_seed(0)
    caches = [torch.randn(512, 16, 576, device="cuda").to(dtype) for _ in range(4)]
    orig = [c.clone() for c in caches]
    cp = KVCopier(caches, num_host_pages=512)
    assert cp.host_caches[0].is_pinned() and cp.stream is not None
    t0 = time.perf_counter()
    cp.apply(_transfers(D2H, [(p, 511 - p) for p in range(512)]))
    issued = time.perf_counter() - t0
    torch.cuda.current_stream().synchronize()  # the compute stream does not wait for it
    cp.synchronize()
    for c in caches:
        c.zero_()
    load = _transfers(H2D, [(511 - p, p) for p in range(256)])
    load.seq = 1
    cp.apply(load)
    deadline = time.monotonic() + 30
    while cp.loads_done() < 1:  # a non-blocking poll, as the engine's
        assert time.monotonic() < deadline
        time.sleep(0.001)
    cp.apply(KVTransfers(wait_seq=1))  # the step that computes the restored request
    torch.cuda.current_stream().synchronize()
    for c, o in zip(caches, orig, strict=True):
        assert torch.equal(c[:256].view(torch.uint8), o[:256].view(torch.uint8))
        assert not c[256:].view(torch.uint8).any()
    cp.synchronize()
    s = cp.stats()
    assert s["bytes_d2h"] == 2 * s["bytes_h2d"] > 0 and s["seconds_d2h"] > 0
    # 512 pages x 4 layers x 18 KiB = 37.7 MB queued: the host returns well before a copy of
    # that size could finish at PCIe speed only if it was not waited for
    assert issued < 1.0


def test_write_back_before_overwrite_waits_on_the_gpu():
    """A fresh page whose write-back is in flight: the compute stream waits for it."""
    caches = [torch.full((4, 16, 64), 7.0, device="cuda", dtype=torch.bfloat16)]
    cp = KVCopier(caches, num_host_pages=4)
    t = _transfers(D2H, [(1, 2)])
    t.fresh = [1]
    cp.apply(t)
    caches[0][1].fill_(-1.0)  # "the forward" overwrites page 1 on the compute stream
    cp.synchronize()
    host_page = cp.host_caches[0][2].view(torch.bfloat16).view(16, 64)
    assert torch.equal(host_page, torch.full((16, 64), 7.0, dtype=torch.bfloat16))
    assert cp.stats()["stall_waits"] == 1


@pytest.mark.parametrize("immediate_bytes", [None, 0])  # default: small loads go with the step
def test_engine_on_cuda_tier_on_off_identical(ckpt, immediate_bytes):
    from k2serve.engine.config import EngineConfig
    from k2serve.engine.engine import LLMEngine
    from k2serve.engine.sampling_params import SamplingParams

    def run(**kw):
        cfg = dict(num_kv_pages=12, page_size=8, max_model_len=96, max_num_batched_tokens=32)
        eng = LLMEngine(EngineConfig(model=ckpt, device="cuda", **cfg, **kw))
        if eng.kv.host is not None and immediate_bytes is not None:
            eng.kv.host.immediate_bytes = immediate_bytes  # 0: every restore waits for its copy
        rng = random.Random(5)
        shared = [rng.randrange(10, 1700) for _ in range(24)]
        sessions = [shared + [rng.randrange(10, 1700) for _ in range(10)] for _ in range(4)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = []
        for turn in range(2):
            for i, s in enumerate(sessions):
                eng.add_request(f"{turn}-{i}", s, params)
                toks = []
                while eng.has_unfinished_requests():
                    for o in eng.step():
                        toks += o.outputs[0].token_ids
                    eng.check_integrity()
                outs.append(toks)
                sessions[i] = s + toks + [rng.randrange(10, 1700) for _ in range(5)]
        return outs, eng

    off, _ = run()
    on, eng = run(kv_offloading_size=0.001)
    assert on == off
    eng.runner.kv_copier.synchronize()
    s = eng.get_stats()
    assert s.host_cache_hits > 0 and s.kv_offload_bytes_h2d > 0
