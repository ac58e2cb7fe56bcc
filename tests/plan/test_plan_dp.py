"""`plan` prints the DP+EP alternative with a recommendation; `deploy --parallel` writes it."""

from __future__ import annotations

import argparse
import json

from k2serve.cli import main
from k2serve.engine.config import EngineConfig


def _plan(capsys, *argv: str) -> dict:
    assert main(["plan", "--model", "kimi-k2-thinking", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_many_sequences_recommend_dp_ep_with_more_cache(capsys):
    out = _plan(capsys, "--gpus", "16xH200", "--max-num-seqs", "256")
    dp = out["dp_ep"]
    assert dp["recommend"] == "dp+ep" and dp["fits"]
    assert dp["data_parallel_size"] == 16 and (384 + dp["num_redundant_experts"]) % 16 == 0
    # whole sequences per GPU: more cached tokens in all than TP's replicated cache
    assert dp["kv_cache_tokens_total"] > out["kv_cache_tokens"]
    assert sum(dp["rows"].values()) <= 141 * 10**9
    node0, node1 = dp["node_commands"]
    assert "--data-parallel-size 16" in node0 and "--data-parallel-size-local 8" in node0
    assert "--headless --data-parallel-start-rank 8" in node1
    # every printed flag parses into a valid engine config (node 1's, the headless one)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    args = node1.split(" ", 2)[2].replace('"$MASTER_ADDR"', "10.0.0.1").replace("'", "")
    argv = [a for a in args.split() if a != "--headless"]
    cfg = EngineConfig.from_cli_args(p.parse_args(argv))
    assert (cfg.data_parallel_size, cfg.data_parallel_start_rank, cfg.enable_eplb) == (16, 8, True)


def test_few_sequences_recommend_tp_and_text_shows_both(capsys):
    out = _plan(capsys, "--gpus", "8xH200", "--max-num-seqs", "8")
    assert out["dp_ep"]["recommend"] == "tp"
    assert main(["plan", "--gpus", "8xH200", "--max-num-seqs", "8"]) == 0
    text = capsys.readouterr().out
    assert "recommended: TP" in text and "--tensor-parallel-size 8" in text
    assert "--data-parallel-size 8" in text
    main(["plan", "--gpus", "1xH200", "--cpu-memory", "1TB", "--json"])
    assert "dp_ep" not in json.loads(capsys.readouterr().out)  # one GPU: no alternative


def test_deploy_writes_the_chosen_layout(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan(capsys, "--gpus", "16xH200", "--max-num-seqs", "256")))
    for parallel, want in (("auto", "--data-parallel-size"), ("tp", "--tensor-parallel-size"),
                           ("dp-ep", "--data-parallel-size")):  # fmt: skip
        out = tmp_path / parallel
        rc = main(["deploy", "k8s", "--plan", str(plan), "--out", str(out),
                   "--parallel", parallel])  # fmt: skip
        assert rc == 0
        text = (out / "leaderworkerset.yaml").read_text()
        assert want in text and "--headless" in text
