"""The kernel policy and its tuned tables (no kernels run here)."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, replace

import pytest
import torch

from k2serve import envs
from k2serve.kernels import gemv
from k2serve.kernels.policy import KernelPolicy, KernelTables, device_kind, load_tables


def test_shipped_tables_load_and_are_read_only():
    t = load_tables()
    assert t.kind == "h200"
    assert t.gemv_bf16[(2112, 7168)]["BLOCK_K"] == 1024  # q_a + kv_a
    assert t.int4_decode["w2"]["W"] == 128 and t.int4_decode_max_pairs == 256
    assert t.int4_decode_grouped["BLOCK_M"] in (1, 2, 4, 8)
    assert 0 < t.int4_decode_grouped_min_pairs <= t.int4_decode_grouped_max_pairs
    assert t.fp8_linear[(576, 7168)][0]["SPLIT_K"] == 16
    assert t.fp8_moe[0]["BLOCK_M"] == 16 and t.fp8_moe[-1]["max_pairs"] is None
    assert t.fp8_moe_generic_max_pairs == 1024  # FP8 experts: the generic kernel up to T=128 x 8
    with pytest.raises(TypeError):
        t.gemv_bf16[(1, 1)] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        t.int4_decode["W"] = 1  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        t.kind = "x"  # type: ignore[misc]


def test_unknown_kind_falls_back_to_the_default_table():
    assert load_tables("no-such-gpu") is load_tables("h200")
    assert device_kind("cpu") == "cpu"


def test_mla_decode_table_reaches_the_triton_backend():
    from k2serve.attention.triton_mla import TritonMLABackend
    from k2serve.kernels.mla_attention import CONFIG_KEYS

    p = KernelPolicy.reference()
    for fp8 in (False, True):
        cfg = p.mla_decode_config(fp8)
        assert set(cfg) <= set(CONFIG_KEYS) and {"block_m", "waves"} <= set(cfg)
    assert p.mla_decode_config(True) == dict(p.tables.mla_decode["fp8"]) | {
        k: v for k, v in p.tables.mla_decode.items() if k not in ("bf16", "fp8")
    }
    be = TritonMLABackend(decode_configs={f: p.mla_decode_config(f) for f in (False, True)})
    assert be.decode_configs[True]["block_n"] == p.tables.mla_decode["fp8"]["block_n"]


def test_malformed_table_is_a_clear_error():
    data = json.loads(json.dumps({"gemv_bf16": [], "fp8_linear": []}))
    with pytest.raises(ValueError, match="kernel table 'broken' is malformed"):
        KernelTables.from_json("broken", data)


def test_cpu_policy_turns_every_cuda_kernel_off():
    p = KernelPolicy.for_device(torch.device("cpu"))
    assert not (p.triton or p.fused_rope or p.triton_router or p.decode_gemv)
    assert not p.shared_stream
    assert p.fused_projections  # not a CUDA kernel: one CPU GEMV for q_a + kv_a, gate + up
    assert p.describe() == ""
    assert KernelPolicy.reference() == KernelPolicy()


def test_policy_reads_the_environment_once_at_build(monkeypatch):
    monkeypatch.setenv("K2SERVE_INT4_ASM", "0")
    p = KernelPolicy.for_device("cpu")
    assert p.int4_asm is False
    monkeypatch.setenv("K2SERVE_INT4_ASM", "1")
    assert p.int4_asm is False  # built once: a later change does not leak in
    assert KernelPolicy.for_device("cpu", int4_asm=False).int4_asm is False
    assert KernelPolicy.for_device("cpu").int4_asm is True
    kw = replace(p, int4_asm=True).moe_kwargs()
    assert kw["asm"] is True and kw["decode_max_pairs"] == 256
    assert kw["grouped_config"]["BLOCK_M"] == p.tables.int4_decode_grouped["BLOCK_M"]
    assert kw["grouped_min_pairs"] == p.tables.int4_decode_grouped_min_pairs
    assert kw["grouped_max_pairs"] == p.tables.int4_decode_grouped_max_pairs


def test_gemv_config_uses_the_table_then_the_rule():
    table = {(64, 512): dict(BLOCK_N=1, BLOCK_K=512, num_warps=2), (64, 1024): None}
    assert gemv.config(64, 512, table) == dict(BLOCK_N=1, BLOCK_K=512, num_warps=2)
    assert gemv.config(64, 1024, table) is None  # cuBLAS measured faster
    assert gemv.config(64, 1024) == dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4)  # the rule
    assert gemv.config(64, 100) is None


@pytest.mark.parametrize(
    "value, want", [("1", True), ("true", True), ("off", False), ("0", False), ("", True)]
)
def test_env_bool(monkeypatch, value, want):
    monkeypatch.setenv("K2SERVE_SHARED_STREAM", value)
    assert envs.shared_stream() is want


def test_env_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("K2SERVE_SHARED_STREAM", "maybe")
    with pytest.raises(ValueError, match="K2SERVE_SHARED_STREAM"):
        envs.shared_stream()
    monkeypatch.setenv("K2SERVE_DIST_TIMEOUT_S", "-3")
    with pytest.raises(ValueError, match="K2SERVE_DIST_TIMEOUT_S.*positive"):
        envs.dist_timeout_s()
    monkeypatch.setenv("K2SERVE_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        envs.dist_timeout_s()
    monkeypatch.delenv("K2SERVE_DIST_TIMEOUT_S")
    assert envs.dist_timeout_s() == 600.0


def test_tables_survive_copy_and_pickle():
    """A model is deep-copied with its layers' tables (the fidelity harness does): the
    immutable tables are shared, not copied, and pickle round-trips."""
    import copy
    import pickle

    t = load_tables()
    assert copy.deepcopy(t.gemv_bf16) is t.gemv_bf16
    p = KernelPolicy.for_device("cpu")
    assert copy.deepcopy(p) == p
    back = pickle.loads(pickle.dumps(t.int4_decode))
    assert dict(back) == dict(t.int4_decode) and back["w2"]["W"] == 128
