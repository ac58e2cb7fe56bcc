"""The engine with a host KV tier, forced on the CPU by K2SERVE_KV_HOST_TIER_ON_CPU so that its
copy path runs: greedy outputs identical with the tier on and off (and to the oracle) after
eviction and restoration with a device pool far smaller than the working set, host hits
counted (in `cached_tokens` too), preemption by swap exact, cancellation freeing both tiers,
integrity of both tiers after every step, and the flags."""

import argparse
import logging
import random

import pytest
import torch

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.sampling_params import SamplingParams

from .conftest import make_fake_engine, run_to_completion
from .fakes import reference_greedy

FAKE_PAGE_BYTES = 4 * 2 * 4  # fake cache: page_size 4 x 2 values x float32


def gib(pages: int, page_bytes: int = FAKE_PAGE_BYTES) -> float:
    """--kv-offloading-size for `pages` host pages."""
    return (pages + 0.5) * page_bytes / 2**30


@pytest.fixture
def tier_on_cpu(monkeypatch):
    monkeypatch.setenv("K2SERVE_KV_HOST_TIER_ON_CPU", "1")


def agent_turns(engine, sessions, turns, max_tokens, rng, check=None):
    """Multi-turn sessions: each turn appends the reply and a new user message."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = []
    for turn in range(turns):
        for i, s in enumerate(sessions):
            engine.add_request(f"{turn}-{i}", s, params)
        done = run_to_completion(engine)
        for i, s in enumerate(sessions):
            got = done[f"{turn}-{i}"]
            toks = got.outputs[0].token_ids
            if check is not None:
                check(s, toks)
            outs.append((toks, got.num_cached_tokens))
            sessions[i] = s + toks + [rng.randrange(1, 60) for _ in range(5)]
    return outs


@pytest.mark.parametrize("immediate_bytes", [float("inf"), 0])
def test_fake_sessions_restored_from_host_equal_oracle(fake_engine, tier_on_cpu, immediate_bytes):
    rng = random.Random(0)
    shared = [rng.randrange(1, 60) for _ in range(40)]
    sessions = [shared + [rng.randrange(1, 60) for _ in range(12)] for _ in range(6)]
    eng = fake_engine(
        num_kv_pages=24, max_model_len=96, max_num_seqs=4, kv_offloading_size=gib(400)
    )
    assert eng.kv.host is not None and eng.kv.host.num_pages == 400
    eng.kv.host.immediate_bytes = immediate_bytes  # 0: every restored request waits a step

    def check(prompt, toks):
        assert toks == reference_greedy(prompt, 6, eos=False)

    outs = agent_turns(eng, sessions, 3, 6, rng, check)
    s = eng.get_stats()
    assert s.host_cache_hits > 0 and s.kv_offload_bytes_h2d > 0 and s.kv_offload_bytes_d2h > 0
    assert s.prefix_cache_hits >= s.host_cache_hits
    # the working set (6 sessions x 60+ tokens) is 4x the device pool: later turns hit in RAM,
    # and a request's cached_tokens counts its host hits
    assert sum(c for _, c in outs[6:]) > 24 * 4
    assert 0 < s.host_cache_usage <= 1


def test_tier_on_and_off_identical_fake(fake_engine, tier_on_cpu):
    def run(**kw):
        rng = random.Random(1)
        shared = [rng.randrange(1, 60) for _ in range(30)]
        sessions = [shared + [rng.randrange(1, 60) for _ in range(9)] for _ in range(5)]
        eng = fake_engine(num_kv_pages=20, max_model_len=80, max_num_batched_tokens=16, **kw)
        return [t for t, _ in agent_turns(eng, sessions, 3, 5, rng)], eng

    off, eng_off = run()
    on, eng_on = run(kv_offloading_size=gib(300))
    assert on == off
    assert eng_off.kv.host is None and eng_on.get_stats().host_cache_hits > 0


@pytest.mark.parametrize("immediate_bytes", [float("inf"), 0])
def test_preemption_swaps_out_and_in_exactly(fake_engine, tier_on_cpu, immediate_bytes):
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 60) for _ in range(10)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    eng = fake_engine(num_kv_pages=16, max_model_len=64, kv_offloading_size=gib(200))
    eng.kv.host.immediate_bytes = immediate_bytes
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = run_to_completion(eng)
    s = eng.get_stats()
    assert s.num_preemptions > 0 and s.num_swap_outs == s.num_preemptions
    assert s.num_swap_ins == s.num_swap_outs and s.num_swapped == 0
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == reference_greedy(p, 14, eos=False)


def test_swap_falls_back_to_recompute_without_room(fake_engine, tier_on_cpu):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 60) for _ in range(10)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    eng = fake_engine(num_kv_pages=16, max_model_len=64, kv_offloading_size=gib(2))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = run_to_completion(eng)
    s = eng.get_stats()
    assert s.num_preemptions > s.num_swap_outs  # some had no room: recomputed
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == reference_greedy(p, 14, eos=False)


def test_cancelling_swapped_and_loading_requests_frees_both_tiers(fake_engine, tier_on_cpu):
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng = fake_engine(num_kv_pages=16, max_model_len=64, kv_offloading_size=gib(200))
    eng.kv.host.immediate_bytes = 0  # a restored request waits a step: cancel it then
    for i in range(6):
        eng.add_request(str(i), [rng.randrange(1, 60) for _ in range(10)], params)
    for _ in range(200):
        eng.step()
        eng.check_integrity()
        if eng.kv.host.swapped:
            break
    swapped = list(eng.kv.host.swapped)
    assert swapped
    eng.abort_request(swapped)
    eng.check_integrity()
    assert not eng.kv.host.swapped
    # a request loading its prefix from host RAM, cancelled before it computes
    prompt = [rng.randrange(1, 60) for _ in range(33)]
    eng.abort_request([str(i) for i in range(6)])
    eng.add_request("warm", prompt, SamplingParams(max_tokens=1))
    run_to_completion(eng)
    eng.add_request(
        "evict", [rng.randrange(1, 60) for _ in range(60)], SamplingParams(max_tokens=1)
    )
    run_to_completion(eng)
    eng.add_request("load", prompt, SamplingParams(max_tokens=1))
    eng.step()  # admitted with its pages being copied in
    assert eng.kv.num_pages_of(eng._requests["load"]) > 0 and eng.get_stats().host_cache_hits
    eng.abort_request("load")
    run_to_completion(eng)
    assert eng.kv.pool.num_used_pages == 0
    assert all(rc == 0 for rc in eng.kv.host.pool.ref_count)


def test_tier_off_on_cpu_without_the_knob(caplog):
    with caplog.at_level(logging.INFO, logger="k2serve.engine.kv_tier"):
        eng = make_fake_engine(kv_offloading_size=1.0)
    assert eng.kv.host is None and eng.runner.kv_copier is None
    assert "KV host tier: off" in caplog.text and "host memory already" in caplog.text


def test_flags_and_config():
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    a = p.parse_args(["--kv-offloading-size", "8", "--kv-offloading-backend", "native"])
    cfg = EngineConfig.from_cli_args(a)
    assert cfg.kv_offloading_size == 8.0 and cfg.kv_offloading_backend == "native"
    cfg = EngineConfig.from_cli_args(p.parse_args(["--swap-space", "32"]))
    assert cfg.swap_space == 32.0
    with pytest.raises(ValueError, match="LMCache is not integrated"):
        EngineConfig(kv_offloading_size=4, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="non-negative"):
        EngineConfig(kv_offloading_size=-1)
    from k2serve.engine.kv_tier import host_tier_bytes_per_rank

    assert (
        host_tier_bytes_per_rank(EngineConfig(kv_offloading_size=8, tensor_parallel_size=2))[0]
        == 4 * 2**30
    )
    assert host_tier_bytes_per_rank(EngineConfig(swap_space=3))[0] == 3 * 2**30
    assert host_tier_bytes_per_rank(EngineConfig(swap_space=3, kv_offloading_size=1))[0] == 2**30
    assert host_tier_bytes_per_rank(EngineConfig())[0] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tiny_model_tier_on_off_identical(ckpt, tier_on_cpu, kv_cache_dtype):
    """The real MLA path: 24-token pages' worth of shared context, a device pool of 12 pages of
    8 tokens, chunked prefill of 32 tokens; outputs equal the tier-off engine's."""
    from k2serve.attention import allocate_kv_caches

    base = LLMEngine(
        EngineConfig(model=ckpt, dtype="float32", device="cpu", num_kv_pages=12, page_size=8,
                     max_model_len=96, kv_cache_dtype=kv_cache_dtype)
    )  # fmt: skip
    page_bytes = sum(c[0].numel() * c.element_size() for c in base.runner.kv_caches)

    def run(**kw):
        eng = LLMEngine(
            EngineConfig(model=ckpt, dtype="float32", device="cpu", num_kv_pages=12, page_size=8,
                         max_model_len=96, max_num_batched_tokens=32,
                         kv_cache_dtype=kv_cache_dtype, **kw),
            model=base.model,
            tokenizer=base.tokenizer,
            kv_cache_factory=lambda n, ps, dt, dev: allocate_kv_caches(
                base.model_config, n, ps, dt, dev),
        )  # fmt: skip
        rng = random.Random(5)
        shared = [rng.randrange(10, 1700) for _ in range(24)]
        sessions = [shared + [rng.randrange(10, 1700) for _ in range(10)] for _ in range(4)]
        return [t for t, _ in agent_turns(eng, sessions, 2, 4, rng)], eng

    torch.manual_seed(0)
    off, _ = run()
    on, eng = run(kv_offloading_size=gib(64, page_bytes))
    assert on == off
    s = eng.get_stats()
    assert s.host_cache_hits > 0 and s.kv_offload_bytes_h2d > 0


def test_metrics_scraped_with_vllm_names(fake_engine, tier_on_cpu):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from k2serve.server.metrics import ServerMetrics

    off = {f.name for f in text_string_to_metric_families(
        generate_latest(ServerMetrics(fake_engine(), "m").registry).decode())}  # fmt: skip
    assert "vllm:kv_offload_total_bytes" not in off  # nothing while the tier is off
    eng = fake_engine(num_kv_pages=24, max_model_len=96, kv_offloading_size=gib(400))
    rng = random.Random(6)
    shared = [rng.randrange(1, 60) for _ in range(40)]
    agent_turns(eng, [shared + [i] for i in range(6)], 2, 4, rng)
    text = generate_latest(ServerMetrics(eng, "m").registry).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    s = eng.get_stats()

    def value(name, sample, **labels):
        (v,) = [x.value for x in fams[name].samples if x.name == sample
                and all(x.labels.get(k) == w for k, w in labels.items())]  # fmt: skip
        return v

    kw = dict(model_name="m")
    assert value("vllm:kv_offload_total_bytes", "vllm:kv_offload_total_bytes_total",
                 transfer_type="CPU_to_GPU", **kw) == s.kv_offload_bytes_h2d > 0  # fmt: skip
    assert value("vllm:kv_offload_total_bytes", "vllm:kv_offload_total_bytes_total",
                 transfer_type="GPU_to_CPU", **kw) == s.kv_offload_bytes_d2h > 0  # fmt: skip
    assert value("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total",
                 **kw) == s.host_cache_hits > 0  # fmt: skip
    usage = value("vllm:cpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", **kw)
    assert 0 < usage == s.host_cache_usage
    assert fams["vllm:num_requests_swapped"].type == "gauge"
    assert fams["k2serve:kv_swap_outs"].type == "counter"


def test_a_tier_bigger_than_the_free_ram_is_refused(tier_on_cpu, monkeypatch):
    import k2serve.engine.kv_tier as kt

    monkeypatch.setattr(kt, "available_memory_bytes", lambda: 10 * 2**30)
    caches = [torch.zeros(4, 16, 576, dtype=torch.bfloat16) for _ in range(2)]
    cfg = EngineConfig(kv_offloading_size=12, tensor_parallel_size=1)
    with pytest.raises(ValueError, match=r"needs 12.0 GiB of host RAM.*10.0 GiB is available"):
        kt.num_host_pages(cfg, torch.device("cpu"), caches)
    pages = kt.num_host_pages(EngineConfig(swap_space=1), torch.device("cpu"), caches)
    assert pages == 2**30 // (2 * 16 * 576 * 2)


def test_a_restored_request_computes_only_once_its_copy_is_done(fake_engine, tier_on_cpu):
    """No step waits for a load: the request waits (holding its pages) until the copier says
    its loads are done; with nothing else to do the engine waits for the copy itself."""
    rng = random.Random(7)
    eng = fake_engine(num_kv_pages=16, max_model_len=64, kv_offloading_size=gib(100))
    eng.kv.host.immediate_bytes = 0  # every load is "large"
    prompt = [rng.randrange(1, 60) for _ in range(33)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("warm", prompt, params)
    run_to_completion(eng)
    eng.add_request("evict", [rng.randrange(1, 60) for _ in range(60)], params)
    run_to_completion(eng)
    done, waits = {"seq": 0}, []
    eng.runner.kv_loads_done = lambda: done["seq"]  # the copy "is still in flight"
    eng.runner.wait_kv_loads = lambda: waits.append(1)
    eng.add_request("other", [rng.randrange(1, 60) for _ in range(5)], params)
    eng.add_request("load", prompt, params)
    outs = {}
    for _ in range(6):
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        eng.check_integrity()
    req = eng._requests["load"]
    assert req.num_computed_tokens == 32 and req.num_output_tokens == 0  # restored, waiting
    assert len(outs["other"]) == 3 and waits  # the other request went on; then idle waits
    done["seq"] = eng.kv.host.seq
    out = run_to_completion(eng)
    assert out["load"].outputs[0].token_ids == reference_greedy(prompt, 3, eos=False)
    assert out["load"].num_cached_tokens == 32
