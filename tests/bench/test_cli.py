"""`k2serve bench` end to end on the fake server: table, JSON, PNG, goodput, compare, bad input."""

from __future__ import annotations

import json

import pytest

from k2serve.bench.report import load_result
from k2serve.cli import main


def _bench(capsys, base_url: str, out_dir, name: str, *extra: str) -> tuple[int, str, str]:
    argv = [
        "bench",
        "--base-url",
        base_url,
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        "--disable-tqdm",
        "--request-timeout",
        "10",
        *extra,
    ]
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_run_writes_table_json_and_png(fake_server, tmp_path, capsys):
    server = fake_server(ttft_s=0.1, itl_s=0.01, faults={2: "500"})
    rc, out, _ = _bench(
        capsys,
        server.base_url,
        tmp_path,
        "a.json",
        "--num-prompts",
        "6",
        "--random-input-len",
        "20",
        "--random-output-len",
        "5",
        "--goodput",
        "ttft:1000",
        "e2el:5000",
        "--seed",
        "3",
    )
    assert rc == 0
    assert "Serving Benchmark Result" in out
    assert "Successful requests:                     5" in out
    assert "http_500:" in out
    assert "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out and "P90 E2EL (ms):" in out

    doc = load_result(tmp_path / "a.json")
    assert doc["completed"] == 5 and doc["failed"] == 1
    assert doc["errors_by_kind"] == {"http_500": 1}
    assert doc["total_output_tokens"] == 5 * 5
    assert doc["config"]["model"] == "fake-model"  # discovered from /v1/models
    assert doc["good_requests"] == 5  # generous SLOs: every successful request meets them
    assert 100 <= doc["median_ttft_ms"] <= 160
    assert len(doc["requests"]) == 6
    # the requests carried what the flags asked for
    assert all(b["stream_options"] == {"include_usage": True} for b in server.bodies)
    assert all(b["max_tokens"] == 5 and b["model"] == "fake-model" for b in server.bodies)
    assert "ignore_eos" not in server.bodies[0]

    png = (tmp_path / "a.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_goodput_counts_only_requests_meeting_the_slos(fake_server, tmp_path, capsys):
    server = fake_server(ttft_s=0.15, itl_s=0.01)
    rc, out, _ = _bench(
        capsys,
        server.base_url,
        tmp_path,
        "g.json",
        "--num-prompts",
        "4",
        "--random-output-len",
        "3",
        "--random-input-len",
        "5",
        "--no-plot",
        "--goodput",
        "ttft:100",
        "--model",
        "m",
        "--ignore-eos",
    )
    assert rc == 0
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["completed"] == 4 and doc["good_requests"] == 0 and doc["request_goodput"] == 0
    assert not (tmp_path / "g.png").exists()
    assert all(b["ignore_eos"] is True and b["model"] == "m" for b in server.bodies)


def test_compare_shows_ratios(fake_server, tmp_path, capsys):
    fast = fake_server(ttft_s=0.1, itl_s=0.01)
    slow = fake_server(ttft_s=0.3, itl_s=0.01)
    common = [
        "--num-prompts",
        "4",
        "--random-input-len",
        "5",
        "--random-output-len",
        "4",
        "--no-plot",
        "--max-concurrency",
        "4",
    ]
    assert _bench(capsys, fast.base_url, tmp_path, "fast.json", *common)[0] == 0
    assert _bench(capsys, slow.base_url, tmp_path, "slow.json", *common)[0] == 0
    rc = main(["bench", "compare", str(tmp_path / "fast.json"), str(tmp_path / "slow.json")])
    out = capsys.readouterr().out
    assert rc == 0
    row = next(line for line in out.splitlines() if line.startswith("Mean TTFT (ms)"))
    a, b, ratio = row.split()[-3:]
    assert ratio.endswith("-")  # B is worse
    assert float(ratio[:-1]) == pytest.approx(float(b) / float(a), rel=1e-3)
    assert 2.0 < float(ratio[:-1]) < 3.3  # 300 ms vs 100 ms injected
    assert "Output throughput (tok/s)" in out and "fast" in out and "slow" in out


def test_compare_reads_vllm_result_files(tmp_path, capsys):
    a = {"completed": 10, "request_throughput": 2.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": 150.0}
    b = {"completed": 10, "request_throughput": 3.0, "mean_ttft_ms": 80.0, "p99_ttft_ms": 200.0}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    lines = {ln.split("  ")[0]: ln for ln in out.splitlines()}
    assert lines["Request throughput (req/s)"].split()[-1] == "1.500+"
    assert lines["Mean TTFT (ms)"].split()[-1] == "0.800+"
    assert lines["P99 TTFT (ms)"].split()[-1] == "1.333-"


@pytest.mark.parametrize(
    "content,match",
    [(None, "no such result file"), ("{not json", "not a JSON"), ('{"a": 1}', "not a benchmark")],
)
def test_compare_bad_files(tmp_path, capsys, content, match):
    p = tmp_path / "x.json"
    if content is not None:
        p.write_text(content)
    assert main(["bench", "compare", str(p), str(p)]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,match",
    [
        (["--duration", "5"], "max-concurrency"),
        (["--goodput", "ttft=5"], "--goodput"),
        (["--goodput", "latency:5"], "--goodput"),
        (["--dataset-name", "sharegpt"], "needs --dataset-path"),
        (["--random-range-ratio", "2"], "random-range-ratio"),
        (["--request-rate", "0"], "request-rate"),
        (["--extra-body", "[1]"], "JSON object"),
        (["--num-prompts", "0"], "num-prompts"),
        (["--metric-percentiles", "0,101"], "metric-percentiles"),
    ],
)
def test_bad_flags_give_a_clear_error(capsys, args, match):
    rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", *args])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_bad_base_url_and_unreachable_model_listing(capsys):
    assert main(["bench", "--base-url", "ftp://x"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_completions_api_and_v1_base_url(fake_server, tmp_path, capsys):
    server = fake_server(ttft_s=0.01, itl_s=0.005)
    rc, out, _ = _bench(
        capsys,
        server.base_url + "/v1",
        tmp_path,
        "c.json",
        "--backend",
        "openai",
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--random-output-len",
        "3",
        "--no-plot",
    )
    assert rc == 0
    assert all("prompt" in b and "messages" not in b for b in server.bodies)
    doc = load_result(tmp_path / "c.json")
    assert doc["config"]["url"] == server.base_url + "/v1/completions"
    assert doc["total_input_tokens"] == 2 * 4  # completions: no chat template overhead


def test_all_requests_failing_exits_nonzero(fake_server, tmp_path, capsys):
    server = fake_server(faults={0: "500", 1: "429"})
    rc, out, _ = _bench(
        capsys,
        server.base_url,
        tmp_path,
        "f.json",
        "--num-prompts",
        "2",
        "--no-plot",
        "--random-input-len",
        "3",
        "--random-output-len",
        "2",
    )
    assert rc == 1
    assert "Successful requests:                     0" in out
    doc = load_result(tmp_path / "f.json")
    assert doc["mean_ttft_ms"] is None  # no data -> null, still strict JSON


def test_calibrated_prompts_hit_the_token_target(fake_server, tmp_path, capsys):
    # The fake server counts 3 tokens per word plus a chat overhead: 100 words would be 303.
    server = fake_server(ttft_s=0.0, itl_s=0.001, tokens_per_word=3)
    rc, out, _ = _bench(
        capsys, server.base_url, tmp_path, "cal.json", "--num-prompts", "3",
        "--random-input-len", "100", "--random-output-len", "2", "--no-plot",
        "--calibrate-input-len",
    )  # fmt: skip
    assert rc == 0
    assert "calibration: 3.000 tokens/word" in out
    doc = load_result(tmp_path / "cal.json")
    assert doc["config"]["calibration"]["tokens_per_word"] == pytest.approx(3.0)
    assert all(abs(r["prompt_tokens"] - 100) <= 2 for r in doc["requests"])
    assert len(server.bodies) == 2 + 3  # two probes, then the measured requests


def test_a_wrong_model_prints_the_servers_message(fake_server, tmp_path, capsys):
    server = fake_server(check_model=True)
    rc, out, _ = _bench(capsys, server.base_url, tmp_path, "m.json", "--num-prompts", "3",
                        "--model", "kimi-k2", "--random-input-len", "5", "--random-output-len",
                        "2")  # fmt: skip
    assert rc == 1
    assert "http_404:" in out
    assert "server said: The model `kimi-k2` does not exist." in out
    assert load_result(tmp_path / "m.json")["error_examples"]["http_404"].startswith("{")


def test_hf_dataset_from_a_local_file_and_trust_remote_code(fake_server, tmp_path, capsys):
    rows = [
        {"conversations": [{"from": "human", "value": "hello there"},
                           {"from": "gpt", "value": "hi " * 40}]},
        {"conversation": [{"role": "user", "content": [{"type": "image_url", "image_url": {}},
                                                       {"type": "text", "text": "what is it"}]},
                          {"role": "assistant", "content": "a cat"}]},
    ]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    server = fake_server()
    rc, out, err = _bench(capsys, server.base_url, tmp_path, "h.json", "--dataset-name", "hf",
                          "--dataset-path", str(path), "--num-prompts", "4",
                          "--trust-remote-code")  # fmt: skip
    assert rc == 0, err
    assert "--trust-remote-code changes nothing here" in err
    prompts = sorted({b["messages"][0]["content"] for b in server.bodies})
    assert prompts == ["hello there", "what is it"]
    rc, _, err = _bench(capsys, server.base_url, tmp_path, "x.json", "--dataset-name", "hf",
                        "--dataset-path", "lmarena-ai/VisionArena-Chat")  # fmt: skip
    assert rc == 2 and "looks like a hub dataset id" in err and "local files only" in err
