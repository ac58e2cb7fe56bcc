"""`k2serve generate`: complete prompts offline and print the text (streamed for one prompt).

k2serve generate --prompt "The capital of France is" --max-tokens 32 --temperature 0
k2serve generate --model ./ckpt --prompt-ids 1,2,3 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from k2serve.engine.config import EngineConfig


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)


def sampling_params_from_args(args: argparse.Namespace):
    from k2serve.engine.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_mutually_exclusive_group()
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: stdin")
    p.add_argument("--prompt-ids", help="one prompt as comma-separated token ids")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    parser.add_argument("--json", action="store_true", help="print outputs as JSON lines")
    add_sampling_arguments(parser)
    EngineConfig.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from k2serve.engine.llm import LLM

    try:
        params = sampling_params_from_args(args)
        cfg = EngineConfig.from_cli_args(args)
    except ValueError as e:
        print(f"k2serve generate: {e}", file=sys.stderr)
        return 2
    if args.prompt_ids:
        try:
            prompts = [[int(t) for t in args.prompt_ids.split(",") if t.strip()]]
        except ValueError:
            print("k2serve generate: --prompt-ids takes integers like 1,2,3", file=sys.stderr)
            return 2
    else:
        prompts = args.prompt or [sys.stdin.read()]
    kw = {k: v for k, v in vars(cfg).items() if k not in ("model", "tokenizer", "dtype", "device")}
    try:
        llm = LLM(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=cfg.device, **kw)
    except (ValueError, OSError) as e:
        print(f"k2serve generate: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"k2serve generate: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for r in outs for o in r.outputs)
    for r in outs:
        for o in r.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": r.prompt,
                            "index": o.index,
                            "text": o.text,
                            "token_ids": o.token_ids,
                            "finish_reason": o.finish_reason,
                            "stop_reason": o.stop_reason,
                        }
                    )
                )
            else:
                print(o.text if llm.get_tokenizer() is not None else o.token_ids)
    print(f"[{ntok} tokens in {dt:.2f}s, {ntok / max(dt, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
