"""Tensor-parallel engines stop their workers deterministically (LLM.close / context manager /
garbage collection, LLMEngine.shutdown, AsyncLLMEngine.shutdown), and every rank runs the
backends and KV cache dtype of the engine config."""

import gc
import multiprocessing as mp

import torch

from k2serve import LLM, SamplingParams
from k2serve.engine.async_engine import AsyncLLMEngine
from k2serve.engine.config import EngineConfig

from . import rank_fns

ENGINE = dict(device="cpu", num_kv_pages=32, page_size=4, max_model_len=64)
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _workers(llm_engine) -> list:
    return list(llm_engine.runner.group._procs)


def _assert_stopped(procs) -> None:
    assert procs and all(p.exitcode is not None for p in procs)
    assert not [c for c in mp.active_children() if c.name.startswith("k2serve-tp-worker")]
    assert not torch.distributed.is_initialized()


def test_llm_close_and_context_manager_stop_the_workers(ckpts):
    with LLM(ckpts["bf16"], tensor_parallel_size=2, **ENGINE) as llm:
        procs = _workers(llm.llm_engine)
        assert all(p.is_alive() for p in procs)
        assert len(llm.generate([[1, 2, 3]], PARAMS)[0].outputs[0].token_ids) == 4
    _assert_stopped(procs)
    llm.close()  # idempotent

    llm = LLM(ckpts["bf16"], tensor_parallel_size=2, **ENGINE)
    procs = _workers(llm.llm_engine)
    del llm
    gc.collect()
    _assert_stopped(procs)


def test_async_engine_shutdown_stops_the_workers(ckpts):
    eng = AsyncLLMEngine(EngineConfig(model=ckpts["bf16"], tensor_parallel_size=2, **ENGINE))
    procs = _workers(eng.engine)
    assert all(p.is_alive() for p in procs)
    eng.shutdown()
    _assert_stopped(procs)


def test_every_rank_applies_the_engine_backends_and_fp8_cache(ckpts):
    with LLM(
        ckpts["int4"], tensor_parallel_size=2, moe_backend="torch", attention_backend="torch",
        kv_cache_dtype="fp8", **ENGINE,
    ) as llm:  # fmt: skip
        group = llm.llm_engine.runner.group
        ranks = group.run(rank_fns.backend_settings)
        want = dict(attention="torch", moe="torch", kv="torch.float8_e4m3fn",
                    cache="torch.float8_e4m3fn")  # fmt: skip
        assert ranks == [want, want]
        outs = llm.generate([[5, 6, 7, 8], [9]], PARAMS)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
        llm.llm_engine.check_integrity()
