"""The data-parallel flags: vLLM's spellings, SGLang's aliases, layout errors naming the flag."""

import argparse

import pytest

from k2serve.distributed.dp_layout import dp_node_spec, eplb_config
from k2serve.engine.config import EngineConfig


def _cfg(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    return EngineConfig.from_cli_args(p.parse_args(list(argv)))


def test_vllm_flags_and_node_layout():
    c = _cfg("--data-parallel-size", "16", "--data-parallel-size-local", "8",
             "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
             "--data-parallel-start-rank", "8", "--enable-expert-parallel")  # fmt: skip
    spec = dp_node_spec(c)
    assert (spec.nnodes, spec.node_rank, spec.world_size) == (2, 1, 16)
    assert (spec.master_addr, spec.master_port) == ("10.0.0.1", 13345)
    assert list(spec.local_ranks()) == list(range(8, 16))
    assert dp_node_spec(_cfg("-dp", "4")) is None  # one node
    short = _cfg("-dp", "4", "-dpl", "2", "-dpa", "h", "-dpp", "4000", "-dpr", "2")
    assert dp_node_spec(short).node_rank == 1


def test_torchrun_style_node_flags_map_to_the_dp_layout():
    c = _cfg("-dp", "16", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.2",
             "--master-port", "12000")  # fmt: skip
    assert (c.data_parallel_size_local, c.data_parallel_start_rank) == (8, 8)
    assert (c.nnodes, c.node_rank) == (1, 0)
    spec = dp_node_spec(c)
    assert (spec.node_rank, spec.master_addr, spec.master_port) == (1, "10.0.0.2", 12000)
    with pytest.raises(ValueError, match="disagrees"):
        _cfg("-dp", "16", "--nnodes", "2", "--node-rank", "1", "-dpl", "4")


def test_sglang_aliases():
    c = _cfg("-tp", "8", "--dp-size", "8", "--enable-dp-attention")
    assert (c.data_parallel_size, c.tensor_parallel_size) == (8, 1)
    assert _cfg("--dp-size", "2").data_parallel_size == 2
    with pytest.raises(ValueError, match="attention tensor parallelism"):
        _cfg("-tp", "8", "--dp-size", "2", "--enable-dp-attention")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["-dp", "2", "-tp", "2"], "data_parallel_size=2 with tensor_parallel_size=2"),
        (["-dp", "6", "-dpl", "4"], "multiple of data_parallel_size_local"),
        (["-dp", "4", "-dpl", "2", "-dpr", "1"], "data_parallel_start_rank=1"),
        (["-dp", "4", "-dpl", "2", "-dpr", "4"], "data_parallel_start_rank=4"),
        (["-dp", "0"], "data_parallel_size=0"),
        (["--enable-eplb"], "need --data-parallel-size > 1"),
        (["-dp", "2", "--eplb-config", "{bad"], "not JSON"),
        (["-dp", "2", "--eplb-config", '{"window": 3}'], "unknown key"),
        (["-dp", "2", "--eplb-config", '{"step_interval": 0}'], "step_interval=0"),
    ],
)
def test_layout_errors_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        _cfg(*argv)


def test_eplb_config_values():
    js = '{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 32}'
    c = _cfg("-dp", "2", "--enable-eplb", "--eplb-config", js)
    e = eplb_config(c)
    assert (e.window_size, e.step_interval, e.num_redundant_experts) == (1000, 3000, 32)
