"""The kernel policy and its tuned tables (no kernels run here)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import FrozenInstanceError, fields, replace

import pytest
import torch

from k2serve import envs
from k2serve.kernels import gemv
from k2serve.kernels.policy import KernelPolicy, KernelTables, device_kind, load_tables


def test_shipped_tables_load_and_are_read_only():
    t = load_tables()
    assert t.kind == "h100"
    assert t.gemv_bf16[(2112, 7168)]["BLOCK_K"] == 1024  # q_a + kv_a
    assert t.int4_decode["w2"]["W"] == 128 and t.int4_decode_max_pairs == 256
    assert t.int4_decode_grouped["BLOCK_M"] in (1, 2, 4, 8)
    assert 0 < t.int4_decode_grouped_min_pairs <= t.int4_decode_grouped_max_pairs
    assert t.fp8_linear[(576, 7168)][0]["SPLIT_K"] == 16
    assert t.fp8_moe[0]["BLOCK_M"] == 16 and t.fp8_moe[-1]["max_pairs"] is None
    assert t.fp8_moe_generic_max_pairs == 2048  # FP8 experts: the generic kernel up to T=256 x 8
    with pytest.raises(TypeError):
        t.gemv_bf16[(1, 1)] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        t.int4_decode["W"] = 1  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        t.kind = "x"  # type: ignore[misc]


def test_unknown_kind_falls_back_to_the_default_table():
    assert load_tables("no-such-gpu") is load_tables("h100")
    assert device_kind("cpu") == "cpu"


def test_h200_table_is_the_h100_one_with_its_own_entries():
    """h200.json names h100.json as its base and holds only what was measured on an H200: the
    tensor-core decode MoE's configs by pair count and its upper limit, the grouped GEMV's
    lower limit."""
    h100, h200 = load_tables("h100"), load_tables("h200")
    own = {"kind", "int4_decode_mma", "int4_decode_mma_max_pairs", "int4_decode_grouped_min_pairs"}
    for f in fields(KernelTables):
        if f.name not in own:
            assert getattr(h200, f.name) == getattr(h100, f.name), f.name
    assert isinstance(h100.int4_decode_mma, Mapping)
    mma = h200.int4_decode_mma
    assert isinstance(mma, tuple) and mma[-1]["max_pairs"] is None
    assert [e["F16"] for e in mma] == [1] * len(mma)
    assert h200.int4_decode_grouped_min_pairs < h100.int4_decode_grouped_min_pairs
    assert h200.int4_decode_mma_max_pairs > h100.int4_decode_mma_max_pairs


def test_table_bases(tmp_path, monkeypatch):
    """A file's "base" kind is read first and the file's entries replace its; a base that is
    missing or leads back to the file is a clear error."""
    from k2serve.kernels import policy

    base = json.loads(policy._configs().joinpath("h100.json").read_text())
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps({"base": "a", "int4_decode_max_pairs": 7}))
    (tmp_path / "c.json").write_text(json.dumps({"base": "d"}))
    (tmp_path / "d.json").write_text(json.dumps({"base": "c"}))
    (tmp_path / "e.json").write_text(json.dumps({"base": "nowhere"}))
    monkeypatch.setattr(policy, "_configs", lambda: tmp_path)
    b = KernelTables.from_json("b", policy._read("b"))
    assert b.int4_decode_max_pairs == 7 and b.gemv_bf16 == load_tables("h100").gemv_bf16
    for name in ("c", "e"):
        with pytest.raises(ValueError, match="is not another table"):
            policy._read(name)
    with pytest.raises(ValueError, match="malformed"):  # a table's last entry must be open
        KernelTables.from_json("x", {**base, "int4_decode_mma": [{"max_pairs": 8, "F16": 1}]})


def test_mma_configs_by_pair_count(monkeypatch):
    """A table of int4_decode_mma configs: the MoE backend picks the entry by the step's
    (token, expert) pairs, and the warm-up key tells the entries apart."""
    from k2serve.kernels.fused_moe import ExpertWeights
    from k2serve.moe import fused_moe as fm

    E, D, I = 6, 256, 256  # noqa: E741
    ew = ExpertWeights("int4", torch.zeros(E, 2 * I, D // 8, dtype=torch.int32),
                       torch.zeros(E, D, I // 8, dtype=torch.int32),
                       torch.ones(E, 2 * I, D // 32, dtype=torch.bfloat16),
                       torch.ones(E, D, I // 32, dtype=torch.bfloat16), 32)  # fmt: skip
    table = [dict(max_pairs=12, F16=1, G=2, PF=4), dict(max_pairs=None, F16=1, G=4, PF=2)]
    be = fm.FusedMoEBackend(ew, mma_config=table, mma_min_pairs=8, mma_max_pairs=16)
    assert be.plan(2, 4)[0] == ("mma",) and be.plan(4, 4)[0] == ("mma",)
    assert be.config_key(2, 4)[0] == (("mma", 0),) and be.config_key(3, 4)[0] == (("mma", 0),)
    assert be.config_key(4, 4)[0] == (("mma", 1),)
    seen = []
    monkeypatch.setattr(fm, "int4_moe_mma", lambda x, w, tw, ti, cfg, active: seen.append(cfg))
    for T in (3, 4):
        be.run_path("mma", torch.zeros(T, D), torch.zeros(T, 4, dtype=torch.int64),
                    torch.ones(T, 4))  # fmt: skip
    assert [(c["G"], c["PF"]) for c in seen] == [(2, 4), (4, 2)]
    assert all("max_pairs" not in c for c in seen)
    with pytest.raises(ValueError, match="last with max_pairs None"):  # at setup, not in a step
        fm.FusedMoEBackend(ew, mma_config=table[:1], mma_min_pairs=8, mma_max_pairs=16)


def test_fp8_generic_kernel_streams_weights_wherever_auto_runs_it(monkeypatch):
    """FP8 experts under "auto": the generic kernel runs up to fp8_generic_max_pairs with its
    small-M blocks, past 4 pairs an expert too (the kernel's own rule switches to large-M
    there, 4x slower at T=256 x top-8 on a K2 layer); forced "kernel" keeps the rule."""
    from k2serve.kernels.fused_moe import ExpertWeights, kernel_config
    from k2serve.moe import fused_moe as fm

    E, D, I = 4, 256, 128  # noqa: E741
    f8 = torch.float8_e4m3fn
    ew = ExpertWeights("fp8", torch.zeros(E, 2 * I, D, dtype=f8), torch.zeros(E, D, I, dtype=f8),
                       torch.ones(E, 2, 2), torch.ones(E, 2, 1))  # fmt: skip
    small, large = (kernel_config(n, E, "fp8")["BLOCK_M"] for n in (1, 4 * E + 1))
    assert small < large
    auto = fm.FusedMoEBackend(ew, fp8_impl="auto", fp8_generic_max_pairs=40)
    assert auto.plan(5, 8)[0] == ("kernel",) and auto.plan(6, 8)[0] != ("kernel",)
    assert auto.config_key(5, 8)[0] == (("kernel", small),)  # 40 pairs: 10 an expert
    forced = fm.FusedMoEBackend(ew, fp8_impl="kernel")
    assert forced.config_key(5, 8)[0] == (("kernel", large),)
    seen = []
    monkeypatch.setattr(
        fm, "fused_moe", lambda x, w, tw, ti, cfg, active=None: seen.append(cfg["BLOCK_M"])
    )
    for be in (auto, forced):
        be.run_path("kernel", torch.zeros(5, D), torch.zeros(5, 8, dtype=torch.int64),
                    torch.ones(5, 8))  # fmt: skip
    assert seen == [small, large]


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
