"""The engine in a process of its own (engine.core_process), on the demo checkpoint on the
CPU with K2SERVE_ENGINE_PROCESS=1: the same tokens as the in-process engine, requests checked
before they leave the server's process, aborts free the engine's pages, a dead engine process
fails the open streams and refuses new ones, start-up errors surface as they do in-process."""

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch

from k2serve.engine.async_engine import AsyncLLMEngine
from k2serve.engine.config import EngineConfig
from k2serve.engine.core_process import use_engine_process
from k2serve.engine.errors import EngineDeadError
from k2serve.engine.sampling_params import SamplingParams

from .conftest import wait_idle

pytestmark = pytest.mark.timeout(300)


def _cfg(**kw) -> EngineConfig:
    from k2serve.demo import demo_path

    base = dict(model=os.fspath(demo_path()), device="cpu", max_model_len=256,
                num_kv_pages=64, max_num_seqs=8)  # fmt: skip
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engines():
    mp = pytest.MonkeyPatch()
    mp.setenv("K2SERVE_ENGINE_PROCESS", "1")
    remote = AsyncLLMEngine(_cfg())
    mp.setenv("K2SERVE_ENGINE_PROCESS", "0")
    local = AsyncLLMEngine(_cfg())
    mp.undo()
    yield remote, local
    remote.shutdown()
    local.shutdown()


async def _run(a, ids, params, rid=None, **kw):
    return [o async for o in a.generate(ids, params, rid, **kw)]


def _tokens(deltas):
    return [t for d in deltas for t in d.outputs[0].token_ids]


def test_where_the_engine_runs(monkeypatch):
    monkeypatch.delenv("K2SERVE_ENGINE_PROCESS", raising=False)
    assert not use_engine_process(EngineConfig(device="cpu"))  # auto: CUDA only
    monkeypatch.setattr("k2serve.engine.core_process.resolve_device",
                        lambda d: torch.device("cuda"))  # fmt: skip
    assert use_engine_process(EngineConfig(device="cuda"))
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "0")
    assert not use_engine_process(EngineConfig(device="cuda"))
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "1")
    assert use_engine_process(EngineConfig(device="cpu"))
    assert not use_engine_process(EngineConfig(device="cpu", data_parallel_size=2))
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "maybe")
    with pytest.raises(ValueError, match="K2SERVE_ENGINE_PROCESS"):
        use_engine_process(EngineConfig(device="cpu"))


def test_same_tokens_and_text_as_in_process(engines):
    remote, local = engines
    assert not remote.in_process and local.in_process
    assert remote.model is None and remote.engine.pid != os.getpid()
    assert remote.max_model_len == local.max_model_len == 256
    assert remote.spec.num_kv_pages == local.spec.num_kv_pages
    assert remote.weights_description() == local.weights_description()
    prompts = [[(5 * i + j) % 900 + 10 for j in range(4 + 3 * i)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def main(a):
        return await asyncio.gather(*(_run(a, p, greedy) for p in prompts))

    got, want = asyncio.run(main(remote)), asyncio.run(main(local))
    for p, g, w in zip(prompts, got, want, strict=True):
        assert _tokens(g) == _tokens(w) and len(_tokens(g)) == 12
        assert all(d.prompt_token_ids == p for d in g)  # put back in the server process
        assert "".join(d.outputs[0].text for d in g) == "".join(d.outputs[0].text for d in w)
        assert g[-1].finished and g[-1].outputs[0].finish_reason == "length"
    s = asyncio.run(wait_idle(remote, timeout=30))
    assert s.num_finished >= len(prompts) and s.generation_tokens >= 12 * len(prompts)


def _full(deltas):
    """(per sample index: tokens, text, logprobs, finish) of a merged stream."""
    out = deltas[0]
    for d in deltas[1:]:
        out.merge(d)
    return [(c.token_ids, c.text, c.logprobs, c.finish_reason, c.stop_reason) for c in out.outputs]


KINDS = {
    "n2_seeded": dict(n=2, temperature=0.8, seed=7, max_tokens=10),
    "logprobs": dict(temperature=0, max_tokens=6, logprobs=3),
    "stop_string": dict(temperature=0, max_tokens=40, stop=[" the"]),
    "penalties": dict(temperature=0, max_tokens=12, repetition_penalty=1.3, min_tokens=4),
    "json": dict(temperature=0, max_tokens=30, structured_outputs={"choice": ["yes", "no"]}),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_request_kinds_give_what_in_process_gives(engines, kind):
    from k2serve.structured.params import StructuredOutputsParams

    remote, local = engines
    kw = dict(KINDS[kind])
    if "structured_outputs" in kw:
        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    params = SamplingParams(**kw)
    prompt = remote.tokenizer.encode("Tell me about the weather in Paris and the sea.")
    got = asyncio.run(_run(remote, prompt, params, f"{kind}-r"))
    want = asyncio.run(_run(local, prompt, params, f"{kind}-l"))
    assert _full(got) == _full(want)
    assert len(_full(got)) == params.n


def test_images_cross_to_the_engine_process(monkeypatch, tmp_path):
    import numpy as np
    from PIL import Image

    from k2serve.weights.make_checkpoint import make_checkpoint
    from k2serve.weights.presets import preset_config

    make_checkpoint(tmp_path, preset_config("tiny-k2.5"), progress=False)
    cfg = EngineConfig(model=str(tmp_path), device="cpu", max_model_len=1024, num_kv_pages=256)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", mode)
        a = AsyncLLMEngine(cfg)
        try:
            mm = a.engine.mm
            ids, inputs = mm.process([5, 6, mm.placeholder_id, 7], [img])
            assert len(ids) > 4 and inputs
            got[mode] = _tokens(asyncio.run(_run(a, ids, greedy, mm_inputs=inputs)))
        finally:
            a.shutdown()
    assert got["1"] == got["0"] and len(got["1"]) == 6


def test_every_output_field_is_sent_or_kept_by_the_server():
    """A field added to RequestOutput must be packed (or kept server-side) explicitly."""
    from dataclasses import fields

    from k2serve.engine.core_process import PACKED_FIELDS, SERVER_SIDE_FIELDS
    from k2serve.engine.outputs import RequestOutput

    names = [f.name for f in fields(RequestOutput)]
    assert sorted(names) == sorted(PACKED_FIELDS + SERVER_SIDE_FIELDS)


def test_bad_requests_fail_in_the_server_process(engines):
    remote, _ = engines

    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _run(remote, [10**9], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="exceeds|max_model_len|too long"):
            await _run(remote, list(range(10, 300)), SamplingParams(max_tokens=2))
        bad = SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits])
        with pytest.raises(ValueError):  # a closure cannot cross to the engine process
            await _run(remote, [10, 11], bad)
        # nothing was queued or left counted
        assert remote._pending_adds == 0 and not remote._streams
        ok = await _run(remote, [10, 11], SamplingParams(temperature=0, max_tokens=3))
        assert len(_tokens(ok)) == 3

    asyncio.run(main())


def test_leaving_early_and_abort_free_the_pages(engines):
    remote, _ = engines
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = remote.generate([10, 11, 12], long, "leave")
        first = await agen.__anext__()
        assert first.outputs[0].token_ids
        await agen.aclose()  # the caller leaves: the engine process aborts it
        task = asyncio.ensure_future(_run(remote, [13, 14, 15], long, "cut"))
        await asyncio.sleep(0.2)
        remote.abort("cut")
        deltas = await task
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "abort"
        assert len(_tokens(deltas)) < 200
        return await wait_idle(remote, timeout=30)

    s = asyncio.run(main())
    assert s.kv_pages_used == 0


def test_dead_engine_process_fails_streams_and_refuses(monkeypatch):
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "1")
    a = AsyncLLMEngine(_cfg(max_model_len=4096, num_kv_pages=512))
    try:
        a.check_health()
        long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

        async def main():
            task = asyncio.ensure_future(_run(a, [10, 11], long))
            await asyncio.sleep(0.3)
            os.kill(a.engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, 30)
            with pytest.raises(EngineDeadError):
                await _run(a, [10, 11], long)

        asyncio.run(main())
        assert a.errored
        with pytest.raises(RuntimeError, match="exited"):
            a.check_health()
    finally:
        a.shutdown()


def test_start_up_errors_surface_as_in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "1")
    with pytest.raises((FileNotFoundError, ValueError, OSError)) as got:
        AsyncLLMEngine(_cfg(model=str(tmp_path / "nope")))
    monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "0")
    with pytest.raises((FileNotFoundError, ValueError, OSError)) as want:
        AsyncLLMEngine(_cfg(model=str(tmp_path / "nope")))
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_serves_from_its_own_process_with_the_same_tokens(monkeypatch):
    """On CUDA the engine runs in its own process by default, with the in-process tokens."""
    monkeypatch.delenv("K2SERVE_ENGINE_PROCESS", raising=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[(3 * i + j) % 700 + 20 for j in range(5 + 7 * i)] for i in range(5)]
    got = {}
    for mode in ("auto", "0"):
        if mode == "0":
            monkeypatch.setenv("K2SERVE_ENGINE_PROCESS", "0")
        a = AsyncLLMEngine(_cfg(device="cuda"))
        try:
            assert a.in_process == (mode == "0")

            async def main(a=a):
                return await asyncio.gather(*(_run(a, p, greedy) for p in prompts))

            got[mode] = [_tokens(d) for d in asyncio.run(main())]
            asyncio.run(wait_idle(a, timeout=30))
        finally:
            a.shutdown()
    assert got["auto"] == got["0"] and all(len(t) == 16 for t in got["auto"])


def test_a_script_without_a_main_guard_can_start_the_engine_process(tmp_path):
    """spawn re-imports the caller's __main__ in the child; the engine process must not, or a
    script whose top level builds the engine would run again there (and fail)."""
    script = tmp_path / "noguard.py"
    script.write_text(
        "import asyncio, os\n"
        "from k2serve.engine.async_engine import AsyncLLMEngine\n"
        "from k2serve.engine.config import EngineConfig\n"
        "from k2serve.engine.sampling_params import SamplingParams\n"
        "from k2serve.demo import demo_path\n"
        "a = AsyncLLMEngine(EngineConfig(model=os.fspath(demo_path()), device='cpu',\n"
        "                                max_model_len=128, num_kv_pages=16))\n"
        "p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
        "async def main():\n"
        "    return [t async for o in a.generate([10, 11], p) for t in o.outputs[0].token_ids]\n"
        "print('TOKENS', len(asyncio.run(main())), a.in_process)\n"
        "a.shutdown()\n"
    )
    env = {**os.environ, "K2SERVE_ENGINE_PROCESS": "1"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TOKENS 4 False" in r.stdout
