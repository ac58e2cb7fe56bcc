"""The deployment guides' flags (k2serve.server.guide_flags), walked entry by entry on the real
`k2serve serve` parser; the machine checks with an injected machine; docs/flags.md is current."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest

from k2serve.cli import main
from k2serve.engine.config import EngineConfig
from k2serve.server.guide_args import apply_guide_flags, env_warnings, render_markdown
from k2serve.server.guide_flags import ALL_FLAGS, ENV_VARS, STATUSES, GuideFlag
from k2serve.server.machine import Machine, check_machine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from k2serve.server.cli import add_arguments

    p = argparse.ArgumentParser(prog="k2serve serve")
    add_arguments(p)
    return p


# what a flag needs beside it to make a valid engine config
NEEDS = {"--kt-enable-dynamic-expert-update": ["--num-gpu-experts", "8"]}


def _argv(f: GuideFlag, spelling: str, value: str | None = None) -> list[str]:
    if f.switch:
        return [spelling, *NEEDS.get(spelling, [])]
    return [spelling, f.example if value is None else value]


def _cases():
    for f in ALL_FLAGS:
        for s in f.spellings:
            yield pytest.param(f, s, id=s)


def test_the_table_is_well_formed():
    seen: set[str] = set()
    for f in ALL_FLAGS:
        assert f.status in STATUSES
        assert f.source
        if f.status in ("implemented", "alias"):
            assert f.target, f
        else:
            assert f.why, f
        for s in f.spellings:
            assert s not in seen, f"{s} twice in the table"
            seen.add(s)
    assert {"--speculative-config", "--swap-space", "--mm-encoder-tp-mode"} <= seen


@pytest.mark.parametrize("f, spelling", list(_cases()))
def test_every_guide_flag_parses_and_does_what_the_table_says(
    parser, f, spelling, monkeypatch, caplog
):
    # --kt-cpuinfer sets K2SERVE_CPU_THREADS: setenv first so that the test's end restores it
    monkeypatch.setenv("K2SERVE_CPU_THREADS", "1")
    monkeypatch.delenv("K2SERVE_CPU_THREADS")
    if f.status == "implemented":
        assert spelling in parser._option_string_actions
        assert f.target in parser._option_string_actions
        parser.parse_args(_argv(f, spelling))
        return
    args = parser.parse_args(_argv(f, spelling))
    argv = _argv(f, spelling)
    if f.status == "refuse":
        with pytest.raises(ValueError) as e:
            apply_guide_flags(args, argv)
        assert spelling in str(e.value) and f.why in str(e.value)
        return
    if f.status == "one":
        with pytest.raises(ValueError, match="not built"):
            apply_guide_flags(parser.parse_args(_argv(f, spelling, "2")), argv)
    with caplog.at_level(logging.WARNING, logger="k2serve.server"):
        warnings = apply_guide_flags(args, argv)
    if f.status == "alias":
        assert not warnings
        _check_alias(args, f)
    elif f.status == "pending":
        assert warnings == [f"{spelling} {f.example} is accepted but not active in this build "
                            f"({f.why})"]  # fmt: skip
    else:  # warn, one
        assert len(warnings) == 1 and warnings[0].startswith(spelling)
        assert warnings[0] in caplog.text
    EngineConfig.from_cli_args(args)  # what the server then builds is valid


def _check_alias(args, f: GuideFlag) -> None:
    dest = f.target.lstrip("-").replace("-", "_")
    if f.convert == "cpu_threads":
        assert os.environ["K2SERVE_CPU_THREADS"] == f.example
    elif f.convert == "numa_nodes":
        assert args.guide_numa_nodes == int(f.example)
    elif f.convert == "tokens_to_pages":
        assert args.num_kv_pages == int(f.example) // args.page_size
    elif f.convert == "ep_size":
        assert args.enable_expert_parallel is False  # --ep 1 with -tp 1
    elif f.convert == "off":
        assert getattr(args, dest.removeprefix("no_")) is False
    elif f.switch:
        assert getattr(args, dest) is True
    else:
        assert str(getattr(args, dest)) == f.example


def test_log_level_after_the_subcommand(capsys):
    assert main(["serve", "--log-level", "warning", "--tp", "8"]) == 2  # parsed; no GPU here
    assert "add --device cpu" in capsys.readouterr().err


def test_value_spellings(parser):
    args = parser.parse_args(
        ["--kv-cache-dtype", "fp8_e4m3", "--load-format", "compressed-tensors"]
    )
    warnings = apply_guide_flags(args, [])
    assert (args.kv_cache_dtype, args.load_format) == ("fp8", "auto")
    assert "INT4" in warnings[0] and "config.json" in warnings[0]
    args = parser.parse_args(["--chunked-prefill-size", "-1"])
    apply_guide_flags(args, [])
    assert args.enable_chunked_prefill is False
    args = parser.parse_args(["--tp", "4", "--ep-size", "4"])
    apply_guide_flags(args, [])
    assert (args.tensor_parallel_size, args.enable_expert_parallel) == (4, True)
    with pytest.raises(ValueError, match="--ep-size 2: expert parallelism spans"):
        apply_guide_flags(parser.parse_args(["--tp", "4", "--ep-size", "2"]), [])
    with pytest.raises(ValueError, match="e4m3"):
        apply_guide_flags(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]), [])
    args = parser.parse_args(["--attention-backend", "flashinfer", "--cuda-graph-bs", "1", "2"])
    warnings = apply_guide_flags(args, [])
    assert args.attention_backend == "auto" and "auto|torch|triton" in warnings[0]
    assert warnings[1].startswith("--cuda-graph-bs 1 2 changes nothing here")
    with pytest.raises(SystemExit):  # --dp-size is the parser's own int option (issue 29)
        parser.parse_args(["--dp-size", "two"])


def test_env_vars_of_the_guides_warn():
    assert env_warnings({"VLLM_USE_DEEP_GEMM": "1", "HF_HOME": "/x"}) == [
        "VLLM_USE_DEEP_GEMM is set and changes nothing here: k2serve's FP8 GEMMs are its own "
        "Triton kernels"
    ]
    assert {s for _, s, _ in ENV_VARS} <= set(STATUSES)


def test_docs_page_is_generated_from_the_table():
    text = (ROOT / "docs" / "flags.md").read_text()
    assert text == render_markdown(), "regenerate: python -m k2serve.server.guide_args"
    for f in ALL_FLAGS:
        assert f"`{f.spellings[0]}`" in text


def test_unknown_flags_print_serve_usage_with_close_matches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tp-szie", "8", "--mem-fraction-statik", "0.8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: k2serve serve")
    assert "unrecognized arguments: --tp-szie" in err
    assert "--tp-szie: did you mean --tp-size" in err
    assert "--mem-fraction-statik: did you mean --mem-fraction-static" in err


def test_version_names_the_package_and_the_checkout(capsys):
    import k2serve

    with pytest.raises(SystemExit):
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"k2serve {k2serve.__version__}")
    if (ROOT / ".git").exists():
        assert f"(git {k2serve.git_revision()})" in out


# ---- the machine the flags ask for ---------------------------------------------------------
NO_GPU = Machine(num_gpus=0, cpus=(0, 1), numa_nodes=((0, 1),))
TWO_GPUS = Machine(num_gpus=2, cpus=tuple(range(8)), numa_nodes=((0, 1, 2, 3), (4, 5, 6, 7)))


def test_gpu_flags_without_a_gpu_need_device_cpu(caplog):
    for cfg, flag in (
        (EngineConfig(tensor_parallel_size=8), "--tensor-parallel-size 8"),
        (EngineConfig(num_gpu_experts=60), "--num-gpu-experts 60"),
        (EngineConfig(device="cuda"), "--device cuda"),
    ):
        with pytest.raises(ValueError, match=f"{flag} asks for GPUs.*add --device cpu"):
            check_machine(cfg, set(), machine=NO_GPU)
    with caplog.at_level(logging.INFO, logger="k2serve.server"):
        out = check_machine(
            EngineConfig(device="cpu", num_gpu_experts=60, gpu_memory_utilization=0.8,
                         enforce_eager=True),
            {"gpu_memory_utilization", "enforce_eager", "num_gpu_experts"},
            machine=NO_GPU,
        )  # fmt: skip
    assert out.num_gpu_experts is None  # every expert on the CPU
    text = caplog.text
    assert "--gpu-memory-utilization does nothing on the CPU" in text
    assert "--enforce-eager does nothing on the CPU" in text
    assert "every expert is computed on the CPU" in text
    assert "node 0: CPUs 0-1" in text and "on the GPU" not in text.replace("--num-gpu", "")


def test_gpu_counts_threads_and_numa_beyond_the_machine_are_errors(monkeypatch, caplog):
    with pytest.raises(ValueError, match="needs 4 GPUs on this node; 2 visible"):
        check_machine(EngineConfig(tensor_parallel_size=4), set(), machine=TWO_GPUS)
    monkeypatch.setenv("K2SERVE_CPU_THREADS", "192")
    with pytest.raises(ValueError, match="192 CPU threads asked.*may use 8 CPUs"):
        check_machine(EngineConfig(), set(), machine=TWO_GPUS)
    monkeypatch.setenv("K2SERVE_CPU_THREADS", "6")
    monkeypatch.setenv("K2SERVE_NUMA_TOPOLOGY", "0-95;96-191")
    with pytest.raises(ValueError, match="names CPUs 8-191 this process cannot use"):
        check_machine(EngineConfig(), set(), machine=TWO_GPUS)
    monkeypatch.delenv("K2SERVE_NUMA_TOPOLOGY")
    with pytest.raises(ValueError, match="--kt-threadpool-count 4: this machine has 2 NUMA"):
        check_machine(EngineConfig(), set(), 4, machine=TWO_GPUS)
    with caplog.at_level(logging.INFO, logger="k2serve.server"):
        check_machine(EngineConfig(num_gpu_experts=8, enable_expert_parallel=True),
                      {"enable_expert_parallel"}, 2, machine=TWO_GPUS)  # fmt: skip
    assert "--enable-expert-parallel changes nothing with one rank" in caplog.text
    assert "6 threads (K2SERVE_CPU_THREADS) of 8 CPUs, grouped by 2 NUMA" in caplog.text
    assert "node 1: CPUs 4-7" in caplog.text


def test_serve_refuses_before_loading_anything(capsys):
    assert main(["serve", "--tp", "8"]) == 2  # no GPU here
    assert "add --device cpu" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "2"]) == 2  # issue 29: DP ranks are GPUs
    err = capsys.readouterr().err
    assert "--data-parallel-size 2 asks for GPUs" in err and "add --device cpu" in err
    assert main(["serve", "--kt-gpu-experts-ratio", "0.1"]) == 2
    assert "--num-gpu-experts" in capsys.readouterr().err


def test_a_worker_node_needs_no_headless_and_says_what_it_waits_for(monkeypatch, caplog):
    import k2serve.distributed.headless as headless
    from k2serve.demo import demo_path

    calls = []
    monkeypatch.setattr(headless, "run_headless", lambda spec, dev, model: calls.append(model) or 0)
    argv = ["serve", "--device", "cpu", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
            "--dist-init-addr", "10.0.0.1:5000", "--model", str(demo_path())]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="k2serve.server"):
        assert main(argv) == 0
    assert calls == [str(demo_path())]
    assert "runs as --headless" in caplog.text
    assert "waiting up to 600s for node 0 at 10.0.0.1:5001" in caplog.text
