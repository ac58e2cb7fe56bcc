"""Offline LLM API and the generate / chat commands on a tiny real checkpoint."""

import json

import pytest

from k2serve import LLM, SamplingParams
from k2serve.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", device="cpu", max_model_len=128, kv_cache_memory="8MiB")


def test_generate_prompt_forms_and_order(llm):
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = tok.encode("Hello there")
    many = llm.generate(["Hello there", ids, {"prompt_token_ids": ids[:2]}], p)
    assert [m.prompt_token_ids for m in many] == [ids, ids, ids[:2]]
    assert many[0].prompt == "Hello there" and many[1].prompt is None
    assert many[0].outputs[0].token_ids == many[1].outputs[0].token_ids
    assert many[0].outputs[0].text == tok.decode(many[0].outputs[0].token_ids, True)
    single = llm.generate(ids, p)
    assert len(single) == 1 and single[0].outputs[0].token_ids == many[1].outputs[0].token_ids
    two = llm.generate(["a", "b"], [p, p.clone(max_tokens=2)])
    assert [len(o.outputs[0].token_ids) for o in two] == [6, 2]
    n3 = llm.generate("abc", SamplingParams(n=3, seed=5, max_tokens=4, ignore_eos=True))[0]
    assert [o.index for o in n3.outputs] == [0, 1, 2] and n3.finished
    llm.llm_engine.check_integrity()


def test_generate_errors_queue_nothing(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match=r"max_tokens \(500\)"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=500)])
    with pytest.raises(ValueError, match="string or a list of token ids"):
        llm.generate([3.5])
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()


def test_chat_renders_template(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(msgs), allow_special=True)
    assert len(llm.chat([msgs, msgs], SamplingParams(max_tokens=2))) == 2


def test_generate_command(ckpt, capsys):
    rc = cli_main(
        [
            "generate",
            "--model",
            ckpt,
            "--prompt-ids",
            "5,6,7",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--max-model-len",
            "64",
            "--kv-cache-memory",
            "4MiB",
            "--dtype",
            "float32",
        ]
    )
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 1 and len(rows[0]["token_ids"]) == 5
    assert rows[0]["finish_reason"] == "length"
    rc = cli_main(["generate", "--model", ckpt, "--prompt", "x", "--top-p", "3"])
    assert rc == 2 and "top_p" in capsys.readouterr().err
