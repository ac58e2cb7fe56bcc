"""AsyncLLMEngine over the fake-model engine: streaming deltas, abort, early exit, queue limit."""

import asyncio
import time

import pytest

from k2serve.engine.async_engine import AsyncLLMEngine, EngineQueueFull
from k2serve.engine.sampling_params import SamplingParams

from .conftest import make_fake_engine, wait_idle
from .fakes import FakeTokenizer, reference_greedy


@pytest.fixture
def aengine():
    engines = []

    def make(**kw):
        a = AsyncLLMEngine(engine=make_fake_engine(**kw))
        engines.append(a)
        return a

    yield make
    for a in engines:
        a.shutdown()
        a.engine.check_integrity()


async def collect(a, prompt, params, rid):
    deltas = [o async for o in a.generate(prompt, params, rid)]
    return deltas


def test_concurrent_streams_match_reference(aengine):
    a = aengine()
    prompts = [[(7 * i + j) % 60 + 1 for j in range(3 + 2 * i)] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)

    async def main():
        return await asyncio.gather(
            *(collect(a, p, params, f"r{i}") for i, p in enumerate(prompts))
        )

    results = asyncio.run(main())
    tok = FakeTokenizer()
    for p, deltas in zip(prompts, results, strict=True):
        ids = [t for d in deltas for t in d.outputs[0].token_ids]
        assert ids == reference_greedy(p, 15, eos=False)
        assert "".join(d.outputs[0].text for d in deltas) == tok.decode(ids, True)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].outputs[0].finish_reason == "length"
    s = a.get_stats()
    assert s.generation_tokens == 150 and s.num_finished == 10


def test_leaving_iterator_early_aborts_and_frees_pages(aengine):
    a = aengine(max_model_len=4096, num_kv_pages=2048)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        gen = a.generate([1, 2, 3, 4, 5], params, "early")
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        # a cancelled consumer task aborts too
        task = asyncio.create_task(collect(a, [5, 6, 7], params, "cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_idle(a)

    asyncio.run(main())


def test_abort_ends_stream_with_abort_reason(aengine):
    a = aengine(max_model_len=4096, num_kv_pages=2048)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        deltas = []
        async for d in a.generate([3, 4], params, "x"):
            deltas.append(d)
            if len(deltas) == 2:
                a.abort("x")
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
        await wait_idle(a)

    asyncio.run(main())


def test_errors_before_queueing_and_queue_full(aengine):
    a = aengine(max_model_len=4096, num_kv_pages=2048, max_num_seqs=1, max_waiting=2)

    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            await a.generate([1] * 10, SamplingParams(max_tokens=5000), "bad").__anext__()
        long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        gens = [a.generate([i + 1], long, f"g{i}") for i in range(3)]
        firsts = [asyncio.ensure_future(gens[0].__anext__())]
        await firsts[0]  # g0 is running
        firsts += [asyncio.ensure_future(g.__anext__()) for g in gens[1:]]
        await asyncio.sleep(0.1)
        assert a.get_stats().num_waiting == 2
        with pytest.raises(EngineQueueFull, match="max_waiting=2"):
            await a.generate([9], long, "g3").__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await a.generate([9], long, "g0").__anext__()
        for f in firsts[1:]:  # cancelling a consumer aborts its request
            f.cancel()
        await asyncio.gather(*firsts[1:], return_exceptions=True)
        await gens[0].aclose()
        await wait_idle(a)

    asyncio.run(main())


def test_step_failure_fails_streams_and_refuses_new_requests(aengine):
    from k2serve.engine.errors import EngineDeadError

    a = aengine()
    a.engine.model.fail_at_call = 3

    async def main():
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="device fell over"):
            async for _ in a.generate([1, 2, 3], params, "doomed"):
                pass
        with pytest.raises(EngineDeadError):
            await a.generate([1], params, "after").__anext__()
        assert a.errored

    asyncio.run(main())


def test_slow_consumer_gets_waiting_deltas_merged(aengine):
    """A consumer that falls behind gets what piled up in one delta; nothing is lost or
    reordered, and the last delta still finishes the stream."""
    a = aengine()
    prompt = [5, 9, 2]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        deltas = []
        async for d in a.generate(prompt, params, "slow"):
            deltas.append(d)
            if len(deltas) == 1:
                time.sleep(0.3)  # blocks the event loop: the engine runs ahead
        return deltas

    deltas = asyncio.run(main())
    ids = [t for d in deltas for t in d.outputs[0].token_ids]
    assert ids == reference_greedy(prompt, 40, eos=False)
    assert "".join(d.outputs[0].text for d in deltas) == FakeTokenizer().decode(ids, True)
    assert len(deltas) < 40  # merged
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_one_event_loop_wakeup_per_step(aengine):
    """Outputs of one step reach their streams through one call_soon_threadsafe, not one per
    request (each call writes to the loop's self-pipe)."""
    a = aengine()
    steps = [0]
    step = a.engine.step

    def counting_step():
        out = step()
        steps[0] += bool(out)
        return out

    a.engine.step = counting_step
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[i + 1, i + 2] for i in range(8)]

    async def main():
        loop = asyncio.get_running_loop()
        calls = [0]
        orig = loop.call_soon_threadsafe

        def counting(*args, **kw):
            calls[0] += 1
            return orig(*args, **kw)

        loop.call_soon_threadsafe = counting
        results = await asyncio.gather(
            *(collect(a, p, params, f"w{i}") for i, p in enumerate(prompts))
        )
        return calls[0], results

    calls, results = asyncio.run(main())
    for p, deltas in zip(prompts, results, strict=True):
        assert [t for d in deltas for t in d.outputs[0].token_ids] == reference_greedy(
            p, 12, eos=False
        )
    assert steps[0] >= 12
    assert calls <= steps[0]  # 8 streams x 12 tokens = 96 per-request wake-ups before
