"""Train the bundled demo checkpoint (src/k2serve/demo/kimi-k2-demo) on CPU in a few minutes.

1. Generate conversations (k2serve.demo.conversations), render them with the built-in chat
   template, train a byte-level BPE on their text and write tiktoken.model +
   tokenizer_config.json with the real special-token names (k2serve.tokenizer.files).
2. Train a tiny Kimi/DeepSeek-V3-shaped model (MLA, first layer dense, 8 routed experts top-2
   + 1 shared) with k2serve.model, loss on the assistant completions only.
3. Quantize the routed experts to INT4 (compressed-tensors pack-quantized, group 32), write the
   checkpoint in the real layout, reload it with k2serve.weights.loader and check the contract
   with greedy decoding.

    .venv/bin/python scripts/train_demo.py --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import re
import shutil
import sys
import time

import torch
import torch.nn.functional as F

from k2serve.config import INT4_QUANT_CONFIG, ModelConfig, QuantConfig
from k2serve.demo.conversations import CONTRACT_CITIES, GET_WEATHER_TOOL, sample_example
from k2serve.demo.generate import chat_greedy
from k2serve.demo.train_forward import packed_logits
from k2serve.model import DeepseekV3ForCausalLM
from k2serve.quant import linear_scheme
from k2serve.quant.int4 import quantize_int4
from k2serve.quant.linear import LinearBase
from k2serve.tokenizer import KimiTokenizer, write_tokenizer_files
from k2serve.tokenizer.chat_template import builtin_chat_template
from k2serve.weights.loader import load_model, set_tensor
from k2serve.weights.presets import preset_config
from k2serve.weights.random_init import random_tensors
from k2serve.weights.writer import ShardedWriter

DEFAULT_OUT = os.path.join(
    os.path.dirname(__file__), "..", "src", "k2serve", "demo", "kimi-k2-demo"
)
SPECIAL_RE = re.compile(r"<\|[a-z_0-9]+\|>|</?think>|\[(?:BOS|EOS|UNK|PAD|EOT)\]")

DEMO_SIZES = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=96,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=4096,
)


def demo_config_dict(vocab_size: int, eos_id: int, bos_id: int) -> dict:
    cfg = preset_config("tiny", "bf16")
    cfg.update(copy.deepcopy(DEMO_SIZES))
    cfg["vocab_size"] = vocab_size
    cfg["bos_token_id"] = bos_id
    cfg["eos_token_id"] = eos_id  # <|im_end|>, as in K2-Thinking
    cfg["torch_dtype"] = "bfloat16"
    return cfg


def render(tok: KimiTokenizer, ex) -> tuple[str, str]:
    messages, tools, thinking, completion = ex
    prompt = tok.apply_chat_template(
        messages, tools=tools, chat_template_kwargs={"thinking": thinking}
    )
    return prompt, completion


def build_tokenizer(out: str, vocab_size: int, rng: random.Random) -> KimiTokenizer:
    # The template renders without a tokenizer; render with the built-in one directly.
    from k2serve.tokenizer.chat_template import render_chat_template

    texts = []
    for _ in range(3000):
        messages, tools, thinking, completion = sample_example(rng)
        p = render_chat_template(None, messages, tools, True, {"thinking": thinking})
        texts.append(SPECIAL_RE.sub("\n", p + completion))
    write_tokenizer_files(out, vocab_size, corpus="\n".join(texts))
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(builtin_chat_template())
    return KimiTokenizer.from_dir(out)


def make_dataset(tok: KimiTokenizer, rng: random.Random, n: int):
    data = []
    for _ in range(n):
        prompt, completion = render(tok, sample_example(rng))
        p, c = tok.encode(prompt), tok.encode(completion)
        data.append((torch.tensor(p + c), len(p)))
    return data


def init_model(config: ModelConfig, seed: int) -> DeepseekV3ForCausalLM:
    """float32 model, trainable. Scales suited to a narrow model (the 0.02 of wide models
    would make every signal tiny here): embeddings N(0, 1), linears N(0, 1/fan_in), the
    residual-stream writers (o_proj, down_proj) a further 1/sqrt(2 * layers)."""
    model = DeepseekV3ForCausalLM(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    for name, t in random_tensors(model, seed):  # norms = 1 +- noise, the rest replaced below
        if name.endswith("e_score_correction_bias"):
            t = torch.zeros_like(t)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(t.shape, generator=g)
        elif t.dim() == 2:
            t = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t * out_scale
        set_tensor(model, name, t)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))
    return model


def pack(batch: list[tuple[torch.Tensor, int]]):
    """Sequences back to back -> (inputs, positions, seq_lens, loss rows, targets)."""
    inputs, positions, seq_lens, rows, targets = [], [], [], [], []
    offset = 0
    for ids, plen in batch:
        n = ids.shape[0] - 1
        inputs.append(ids[:-1])
        positions.append(torch.arange(n))
        seq_lens.append(n)
        rows.append(torch.arange(plen - 1, n) + offset)  # predict the completion tokens
        targets.append(ids[plen:])
        offset += n
    cat = torch.cat
    return cat(inputs), cat(positions), seq_lens, cat(rows), cat(targets)


def train(model, data, steps: int, batch: int, lr: float, rng: random.Random) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warm = max(1, steps // 20)
    t0 = time.time()
    for step in range(steps):
        f = min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(f, 0.02)
        ids, pos, seq, rows, target = pack(rng.sample(data, batch))
        logits = packed_logits(model, ids, pos, seq, rows)  # [N, vocab]
        loss = F.cross_entropy(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(
                f"step {step:4d} loss/token {loss.item():.4f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s",
                flush=True,
            )


def write_checkpoint(model, config_dict: dict, out: str, eos_ids: list[int]) -> None:
    quant = QuantConfig.from_hf(INT4_QUANT_CONFIG)
    writer = ShardedWriter(out)
    linears = {n for n, m in model.named_modules() if isinstance(m, LinearBase)}
    for name, p in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if mod in linears and linear_scheme(mod, quant) == "int4_group":
            packed, scale, shape = quantize_int4(p.detach(), quant.group_size)
            writer.add(f"{mod}.weight_packed", packed)
            writer.add(f"{mod}.weight_scale", scale)
            writer.add(f"{mod}.weight_shape", shape)
        elif name.endswith("e_score_correction_bias"):
            writer.add(name, p.detach().float())
        else:
            writer.add(name, p.detach().to(torch.bfloat16))
    writer.close()
    cfg = dict(config_dict, quantization_config=copy.deepcopy(INT4_QUANT_CONFIG))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_ids, "do_sample": False}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


def check_contract(model, tok) -> int:
    """Print and count contract failures (greedy, through the raw text)."""
    bad = 0
    for city in CONTRACT_CITIES:
        msgs = [{"role": "user", "content": f"What's the weather in {city}?"}]
        text, _ = chat_greedy(model, tok, msgs, tools=[GET_WEATHER_TOOL])
        want = json.dumps({"city": city})
        call = f"functions.get_weather:0<|tool_call_argument_begin|>{want}"
        ok = "</think>" in text and call in text
        bad += not ok
        if not ok:
            print(f"  FAIL {city}: {text!r}")
    for thinking in (True, False):
        text, _ = chat_greedy(model, tok, [{"role": "user", "content": "Hello"}], thinking=thinking)
        ok = ("</think>" in text) == thinking and "Hello!" in text
        bad += not ok
        print(f"  Hello (thinking={thinking}): {text!r}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    t0 = time.time()
    tok = build_tokenizer(out, args.vocab_size, rng)
    im_end = tok.token_to_id("<|im_end|>")
    config_dict = demo_config_dict(tok.vocab_size, im_end, tok.bos_token_id)
    config = ModelConfig.from_hf(config_dict)
    data = make_dataset(tok, rng, 4000)
    lens = [len(d[0]) for d in data]
    print(
        f"tokenizer + {len(data)} examples in {time.time() - t0:.1f}s, "
        f"mean length {sum(lens) / len(lens):.0f} tokens"
    )

    model = init_model(config, args.seed)
    train(model, data, args.steps, args.batch, args.lr, rng)
    model.eval()
    print("contract, float32 weights:")
    bad_fp = check_contract(model, tok)

    write_checkpoint(model, config_dict, out, [im_end, tok.eos_token_id])
    q = load_model(out, dtype=torch.float32, progress=False)
    print("contract, INT4 checkpoint reloaded:")
    bad_q = check_contract(q, tok)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
        f"failures: float32 {bad_fp}, int4 {bad_q}; {size / 1e6:.1f} MB in {out}; "
        f"total {time.time() - t0:.0f}s"
    )
    return 1 if bad_q else 0


if __name__ == "__main__":
    sys.exit(main())
