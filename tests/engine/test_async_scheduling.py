"""Async scheduling (engine.pipeline): the pipelined engine gives every request exactly the
tokens, text, logprobs and finish reason of the synchronous engine, frees every page, and really
runs the model on the step thread while the engine thread schedules. The fake model reads its
whole history back from the paged cache, so a placeholder filled with the wrong token, a wrong
slot or a page reused too early shows up as a wrong token."""

import argparse
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import LLMEngine
from k2serve.engine.logits_processors import BanTokens, LogitBias
from k2serve.engine.pipeline import InFlight, StepWorker, needs_sync, resolve_async_scheduling
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.scheduler import SchedulerOutput

from .conftest import draw_prompt, drive, engine_configs, make_fake_engine, run_to_completion
from .fakes import EOS, VOCAB, FakeModel, FakeTokenizer, fake_kv_caches, reference_greedy


class ThreadModel(FakeModel):
    """The fake model, noting the thread of each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return super().__call__(*args, **kw)


def make(async_scheduling: bool, **overrides) -> LLMEngine:
    kw = dict(num_kv_pages=64, page_size=4, max_model_len=256, max_num_batched_tokens=64)
    kw.update(overrides)
    return LLMEngine(
        EngineConfig(async_scheduling=async_scheduling, **kw),
        model=ThreadModel(),
        tokenizer=FakeTokenizer(),
        kv_cache_factory=fake_kv_caches,
    )


def summary(out) -> list:
    return [
        (
            o.index,
            o.token_ids,
            o.text,
            o.finish_reason,
            o.stop_reason,
            None if o.logprobs is None else [sorted(e.items()) for e in o.logprobs],
            o.cumulative_logprob,
        )
        for o in sorted(out.outputs, key=lambda o: o.index)
    ]


@st.composite
def workloads(draw):
    cfg = draw(engine_configs())
    max_model_len = cfg["max_model_len"]
    bases = [draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12)) for _ in range(2)]
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw_prompt(draw, bases, max_model_len)
        greedy = draw(st.booleans())
        params = SamplingParams(
            n=draw(st.integers(1, 3)),
            temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.3])),
            top_p=draw(st.sampled_from([1.0, 0.8])),
            top_k=draw(st.sampled_from([0, 5])),
            seed=None if greedy else draw(st.integers(0, 100)),  # seeded: batch-independent
            max_tokens=draw(st.integers(1, max_model_len - len(prompt))),
            ignore_eos=draw(st.booleans()),
            stop=draw(st.sampled_from([None, ["ab"], ["q", "zz"]])),
            stop_token_ids=draw(st.sampled_from([[], [3, 7], [11]])),
            include_stop_str_in_output=draw(st.booleans()),
            logprobs=draw(st.sampled_from([None, 0, 2])),
            logits_processors=draw(
                st.sampled_from([[], [BanTokens([3, 9, 11])], [LogitBias({5: 4.0, 7: -2.0})]])
            ),
        )
        assert not needs_sync(params)
        reqs.append((prompt, params, draw(st.integers(0, 8))))
    return cfg, reqs


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_async_gives_the_synchronous_outputs(workload):
    eng = check_equals_sync(workload, lambda cfg: make(True, **cfg))
    assert eng.spec.async_scheduling


def check_equals_sync(workload, make_async) -> LLMEngine:
    """The workload through the synchronous engine and `make_async(cfg)`'s: the same outputs,
    every forward on the step thread (overlapping the host)."""
    cfg, reqs = workload
    reqs = [(p, sp, arrival, None) for p, sp, arrival in reqs]
    ref = drive(make(False, **cfg), reqs)
    eng = make_async(cfg)
    got = drive(eng, reqs)
    assert set(got) == set(ref)
    for rid in ref:
        assert got[rid].finished
        assert summary(got[rid]) == summary(ref[rid]), rid
    assert set(eng.model.threads) == {"k2serve-step"}
    return eng


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_aborts_mid_stream_free_everything(workload, data):
    """An abort while a step is in flight: the request ends with "abort" after a prefix of its
    tokens, every page comes back, and the other requests keep their synchronous outputs."""
    cfg, reqs = workload
    aborts = [data.draw(st.one_of(st.none(), st.integers(0, 20))) for _ in reqs]
    reqs = [(p, sp, a, ab) for (p, sp, a), ab in zip(reqs, aborts, strict=True)]
    ref = drive(make(False, **cfg), [(p, sp, a, None) for p, sp, a, _ in reqs])
    got = drive(make(True, **cfg), reqs)
    for rid, out in got.items():
        assert out.finished
        for mine, theirs in zip(summary(out), summary(ref[rid]), strict=True):
            if mine[3] == "abort":
                assert mine[1] == theirs[1][: len(mine[1])]
            else:
                assert mine == theirs


def test_pipeline_is_one_step_behind_and_wastes_no_step_at_max_tokens():
    eng = make(True)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], params)
    assert eng.step() == []  # the prefill is in flight, nothing processed yet
    assert eng.pipeline.busy
    toks = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks += out.outputs[0].token_ids
            assert len(out.outputs[0].token_ids) == 1  # one token per step, never late
        eng.check_integrity()
    assert toks == reference_greedy([5, 6, 7], 5, eos=False)
    # max_tokens is known ahead: no step is computed for a token that would be dropped
    assert eng.model.calls == 5


def test_a_token_after_a_stop_is_computed_and_dropped():
    """The pipeline schedules a decode before it knows the step before ended the request;
    that token never reaches the output and its pages come back."""
    prompt = [9, 4]
    ref = reference_greedy(prompt, 40, eos=False)
    stop = ref[3]
    k = ref.index(stop)
    eng = make(True)
    eng.add_request(
        "a", prompt, SamplingParams(temperature=0.0, stop_token_ids=[stop], ignore_eos=True)
    )
    out = drive(eng, [])["a"]
    assert out.outputs[0].token_ids == ref[: k + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert eng.model.calls == k + 2  # one decode more than the synchronous engine


def test_abort_while_in_flight():
    eng = make(True)
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True))
    eng.add_request("b", [4, 5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    toks: dict = {"a": [], "b": []}
    for _ in range(4):
        for out in eng.step():
            toks[out.request_id] += out.outputs[0].token_ids
    assert eng.pipeline.busy
    eng.abort_request("a")
    eng.check_integrity()
    outs: dict = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            toks[out.request_id] += out.outputs[0].token_ids
            outs[out.request_id] = out
        eng.check_integrity()
    assert outs["a"].outputs[0].finish_reason == "abort"
    assert toks["a"] == reference_greedy([1, 2, 3], 3, eos=False)
    assert toks["b"] == reference_greedy([4, 5], 8, eos=False)
    assert eng.kv.pool.num_used_pages == 0


def test_requests_reading_the_previous_token_step_synchronously():
    """Penalties / min_tokens: the engine drains the pipeline and steps on its own thread while
    such a request is unfinished, with the synchronous engine's outputs."""
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pen = SamplingParams(temperature=0.0, max_tokens=6, presence_penalty=1.5, min_tokens=3)
    reqs = [([1, 2, 3], plain, 0, None), ([7, 8], pen, 3, None), ([4, 4], plain, 5, None)]
    ref = drive(make(False), reqs)
    eng = make(True)
    got = drive(eng, reqs)
    for rid in ref:
        assert summary(got[rid]) == summary(ref[rid])
    threads = eng.model.threads
    assert "k2serve-step" in threads and threading.main_thread().name in threads
    assert not eng._sync_reqs
    assert needs_sync(pen) and not needs_sync(plain)
    assert needs_sync(SamplingParams(min_tokens=1))
    assert needs_sync(SamplingParams(logits_processors=[lambda t, x: x]))


def test_a_failed_step_raises_from_step():
    eng = make(True)
    eng.model.fail_at_call = 2
    eng.add_request("a", [1, 2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(RuntimeError, match="device fell over"):
        for _ in range(10):
            eng.step()
    eng.shutdown()


def test_the_flag_resolves_once_into_the_spec():
    assert not make(False).spec.async_scheduling and make(False).pipeline is None
    assert make(True).spec.async_scheduling
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args([])).async_scheduling is None
    assert EngineConfig.from_cli_args(p.parse_args(["--async-scheduling"])).async_scheduling
    off = EngineConfig.from_cli_args(p.parse_args(["--no-async-scheduling"]))
    assert off.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    on, why = resolve_async_scheduling(True, tp_size=2, model=None, speculative=True,
                                       host_tier=False)  # fmt: skip
    assert not on and "tensor parallel" in why and "speculative" in why
    kw = dict(tp_size=1, model=None, speculative=False, host_tier=False)
    on, _ = resolve_async_scheduling(None, device_type="cuda", **kw)
    assert on  # the default on a GPU where nothing needs the host between steps
    on, why = resolve_async_scheduling(None, device_type="cpu", **kw)
    assert not on and "cpu device" in why  # the CPU's cores run the forward: no overlap
    on, why = resolve_async_scheduling(None, device_type="cuda", cpu_experts=True, **kw)
    assert not on and "experts on the CPU" in why
    assert resolve_async_scheduling(True, device_type="cpu", cpu_experts=True, **kw)[0]


def test_default_fake_engine_is_synchronous_on_the_cpu_and_takes_the_flag():
    assert not make_fake_engine().spec.async_scheduling
    eng = make_fake_engine(async_scheduling=True)
    assert eng.spec.async_scheduling
    eng.add_request("x", [3, 1], SamplingParams(temperature=0.0, max_tokens=4))
    out = drive(eng, [])["x"]
    assert out.outputs[0].token_ids == reference_greedy([3, 1], 4)
    assert EOS == 0


def real_outputs(ckpt, async_scheduling: bool, device: str = "cpu", **kw):
    """The tiny checkpoint's outputs for a mixed batch: greedy and seeded, n=2, stop token ids,
    max_tokens, logprobs, a prompt longer than the step budget (chunked prefill)."""
    cfg = dict(model=ckpt, device=device, dtype="float32", num_kv_pages=64, page_size=16,
               max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8)  # fmt: skip
    cfg.update(kw)
    eng = LLMEngine(EngineConfig(async_scheduling=async_scheduling, **cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 60, (n,), generator=g).tolist() for n in (3, 9, 70, 17)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
    ]
    ref = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(str(i), p, sp)
    ref = drive(eng, [])
    # the first greedy request's 5th token as a stop token: finished early in both modes
    stop = ref["0"].outputs[0].token_ids[4]
    eng.add_request("stop", prompts[0], SamplingParams(temperature=0, stop_token_ids=[stop],
                                                       max_tokens=20, ignore_eos=True))  # fmt: skip
    eng.add_request("long", prompts[2], SamplingParams(temperature=0, max_tokens=8))
    ref.update(drive(eng, []))
    assert eng.spec.async_scheduling == async_scheduling
    return eng, {rid: summary(out) for rid, out in ref.items()}


def test_tiny_model_async_equals_sync(ckpt):
    _, ref = real_outputs(ckpt, False)
    eng, got = real_outputs(ckpt, True)
    assert got == ref
    assert ref["stop"][0][3] == "stop"
    eng.shutdown()


def test_late_scheduling_waits_until_shortly_before_the_step_ends():
    """schedule_delay: the step in flight is waited on until shortly before its expected end
    (learned step times minus twice the host's time, minus 0.5 ms)."""
    w = StepWorker(runner=None)
    # learn: 1 ms + 0.25 ms a decode + 20 us a prompt token, from steps of varied shapes
    for i in range(60):
        d, p = 4 + i % 5, [0, 1000, 300][i % 3]
        w._learn(
            SchedulerOutput(num_decodes=d, num_batched_tokens=d + p), 1e-3 + d * 2.5e-4 + p * 2e-5
        )
        w.note_host_time(0.001)
    assert w.expected_seconds(
        SchedulerOutput(num_decodes=4, num_batched_tokens=4)
    ) == pytest.approx(0.002, rel=1e-2)
    assert w.expected_seconds(
        SchedulerOutput(num_decodes=4, num_batched_tokens=1004)
    ) == pytest.approx(0.022, rel=1e-2)
    assert w.host_s == pytest.approx(0.001, rel=1e-2)
    fut: Future = Future()
    long = InFlight(SchedulerOutput(num_decodes=4, num_batched_tokens=1004),
                    SimpleNamespace(sample_reqs=[]), fut)  # fmt: skip
    w.inflight = long
    assert w.schedule_delay() == 0.0  # not started yet
    long.started = time.perf_counter()
    assert 0.015 < w.schedule_delay() <= 0.9 * 0.022 - 0.0025
    w.inflight = InFlight(SchedulerOutput(num_decodes=4, num_batched_tokens=4),
                          SimpleNamespace(sample_reqs=[]), fut)  # fmt: skip
    w.inflight.started = time.perf_counter()
    assert w.schedule_delay() == 0.0  # 2 ms expected: 1.8 - 2 - 0.5 < 0, schedule at once
    w.inflight = long
    fut.set_result(([], None))
    assert w.schedule_delay() == 0.0  # done already
    t = time.perf_counter()
    w.wait(1.0)  # returns at once: the step is done
    assert time.perf_counter() - t < 0.5


def test_cuda_launch_handoff_logic_on_the_cpu():
    """The CUDA order (the engine thread waits until the next step's kernels are queued before
    processing outputs) forced on the CPU: same outputs, and the wait returns for every step."""
    eng = make(True)
    pipe = eng.pipeline
    pipe.cuda = True
    eng.runner.sampler.on_launched = pipe._on_launched
    reqs = [([1, 2, 3], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), 0, None),
            ([5] * 30, SamplingParams(temperature=0, max_tokens=4), 1, None)]  # fmt: skip
    t = time.perf_counter()
    got = drive(eng, reqs)
    assert time.perf_counter() - t < 5
    ref = drive(make(False), reqs)
    assert {k: summary(v) for k, v in got.items()} == {k: summary(v) for k, v in ref.items()}


def test_step_time_model_stays_finite_on_one_shape():
    w = StepWorker(runner=None)
    one = SchedulerOutput(num_decodes=1, num_batched_tokens=1)
    for _ in range(3000):  # C=1: every step the same shape, the forgetting decays the rest
        w._learn(one, 0.002)
    assert w.expected_seconds(one) == pytest.approx(0.002, rel=1e-2)
    est = w.expected_seconds(SchedulerOutput(num_decodes=1, num_batched_tokens=1000))
    assert 0.0 <= est < 10.0


def test_offline_llm_takes_the_flag(ckpt):
    from k2serve.engine.llm import LLM

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for flag in (False, True):
        llm = LLM(ckpt, device="cpu", dtype="float32", num_kv_pages=32, max_model_len=128,
                  async_scheduling=flag)  # fmt: skip
        assert llm.llm_engine.spec.async_scheduling is flag
        outs[flag] = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9] * 20], sp)]
        llm.llm_engine.check_integrity()
        llm.llm_engine.shutdown()
    assert outs[True] == outs[False] and all(len(t) == 6 for t in outs[True])


def test_no_late_scheduling_when_the_next_step_is_full_already():
    """schedule_delay is 0 while the waiting prompts (plus one token per running request) fill
    the next step's budget, or max_num_seqs are running: newcomers could not join that step,
    so waiting for them would only leave the device idle."""
    eng = make_fake_engine(max_num_batched_tokens=16, max_num_seqs=3, async_scheduling=True)
    sched = eng.scheduler
    assert not sched.next_step_is_full()
    eng.add_request("a", [3, 1, 4], SamplingParams(temperature=0.0, max_tokens=50))
    assert not sched.next_step_is_full()  # 3 of 16 tokens
    eng.add_request("b", list(range(1, 15)), SamplingParams(temperature=0.0, max_tokens=50))
    assert sched.next_step_is_full()  # 3 + 14 >= 16
    eng.step()  # both start (16 tokens: a whole, b chunked) and one step is in flight
    if eng.pipeline.busy:
        eng.pipeline.inflight.future.result()
    assert not sched.next_step_is_full()  # 2 running, b's 1 prompt token left + 2 decodes < 16
    w = eng.pipeline
    w.schedule_delay = lambda: 0.5  # a long step in flight: the late wait would apply
    assert eng.schedule_delay() == 0.5
    eng.add_request("c", list(range(1, 15)), SamplingParams(temperature=0.0, max_tokens=50))
    assert sched.next_step_is_full() and eng.schedule_delay() == 0.0  # c fills the budget
    eng.add_request("d", [5], SamplingParams(temperature=0.0, max_tokens=50))
    run_to_completion(eng)


# ---- launch ahead (CUDA's order, forced on the CPU) -----------------------------------------
def make_launch_ahead(monkeypatch, before_copy, **overrides) -> LLMEngine:
    """An async engine whose worker launches ahead (StepWorker(launch_ahead=True)), each
    step's host copy (PendingSample.result, on the `k2serve-result` thread) preceded by
    `before_copy()`: a device still busy, held, or failing."""
    from k2serve.engine import sampler as sampler_mod

    real = sampler_mod.PendingSample.result

    def result(self):
        before_copy()
        return real(self)

    monkeypatch.setattr(sampler_mod.PendingSample, "result", result)
    eng = make(True, **overrides)
    eng.pipeline = StepWorker(eng.runner, launch_ahead=True)
    return eng


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(workloads())
def test_launch_ahead_gives_the_synchronous_outputs(monkeypatch, workload):
    """Each host copy after a random 0-2 ms: a step is often launched before the one before it
    is complete."""
    import random

    rng = random.Random(7)
    late = lambda: time.sleep(rng.random() * 2e-3)  # noqa: E731
    eng = check_equals_sync(workload, lambda cfg: make_launch_ahead(monkeypatch, late, **cfg))
    eng.shutdown()
    assert eng.pipeline._result_thread is None


def test_launch_ahead_launches_the_next_step_before_the_sync(monkeypatch):
    """With the host copy of step N held back, step N+1's forward still runs (it needs only
    step N's tokens on the device): the worker is never waiting on a sync to launch."""
    gate = threading.Event()
    seen: list[int] = []
    eng = make_launch_ahead(monkeypatch, lambda: gate.wait(5))
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.model.threads.clear()
    worker = threading.Thread(target=lambda: [eng.step() for _ in range(2)])
    worker.start()  # step 1 submits N, step 2 submits N+1 then waits for N's result
    t = time.perf_counter()
    while len(eng.model.threads) < 2 and time.perf_counter() - t < 5:
        time.sleep(1e-3)
    seen.append(len(eng.model.threads))
    gate.set()
    worker.join(5)
    assert seen == [2]  # both forwards ran while step N's samples were held on the "device"
    eng.shutdown()


def test_launch_ahead_a_failed_host_copy_fails_that_step_and_every_later_one(monkeypatch):
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy fell over")

    eng = make_launch_ahead(monkeypatch, flaky)
    eng.add_request("a", [1, 2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    with pytest.raises(RuntimeError, match="copy fell over"):
        for _ in range(30):
            eng.step()
    # a step whose samples come after the failure fails with it (no mixed-up outputs)
    fut: Future = Future()
    eng.pipeline._results.put((InFlight(SchedulerOutput(), SimpleNamespace(sample_reqs=[]), fut),
                               [], None))  # fmt: skip
    with pytest.raises(RuntimeError, match="copy fell over"):
        fut.result(5)
    eng.shutdown()


def test_deferred_samples_equal_the_direct_ones():
    """Sampler.launch(defer=True).result() (the host copies of tokens, logprobs, ranks and top-k)
    equals the direct SamplerOutput, row for row, with mixed logprob requests."""
    from k2serve.engine.request import Request
    from k2serve.engine.sampler import PendingSample, Sampler

    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    reqs = [
        Request(f"r{i}", [1, 2], SamplingParams(temperature=0, logprobs=lp), max_tokens=4)
        for i, lp in enumerate([None, 0, 2, 5, None])
    ]
    direct = Sampler()(logits, reqs)
    pending = Sampler().launch(logits, reqs, defer=True)
    assert isinstance(pending, PendingSample)
    assert torch.equal(pending.token_ids_t, direct.token_ids_t)
    got = pending.result()
    assert got.token_ids == direct.token_ids
    assert got.logprobs == direct.logprobs and got.ranks == direct.ranks
    assert got.top_logprobs == direct.top_logprobs
    assert got.logprobs[0] is None and len(got.top_logprobs[3]) == 5 and got.top_logprobs[1] == []
