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
from k2serve.parsers import parse_output


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


def _template_thinks(tok) -> bool:
    """Thinking is on when the chat template knows `<think>` (or is the built-in K2-Thinking
    one), as the server decides it."""
    template = getattr(tok, "chat_template", None)
    return template is None or "<think>" in template


def format_reply(parsed) -> str:
    """A parsed reply as `k2serve chat` prints it: `(thinking) THOUGHT`, then the answer on its
    own line, then one `[tool call NAME ARGS]` line per call; never a raw marker."""
    lines = []
    if parsed.reasoning_content:
        lines.append(f"(thinking) {parsed.reasoning_content}")
    if parsed.content:
        lines.append(parsed.content)
    lines += [f"[tool call {c.name} {c.arguments}]" for c in parsed.tool_calls]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_mutually_exclusive_group()
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: stdin")
    p.add_argument("--prompt-ids", help="one prompt as comma-separated token ids")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message; the reply is shown as `k2serve chat` shows it "
        "(the thought after '(thinking)', then the answer, tool calls as [tool call NAME ARGS])",
    )
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
    tok = llm.get_tokenizer()
    thinking = args.chat and _template_thinks(tok)
    for r in outs:
        for o in r.outputs:
            parsed = None
            if args.chat and tok is not None:
                parsed = parse_output(
                    o.text, thinking=thinking, truncated=o.finish_reason == "length"
                )
            if args.json:
                rec: dict[str, object] = {
                    "prompt": r.prompt,
                    "index": o.index,
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                if parsed is not None:
                    rec["reasoning_content"] = parsed.reasoning_content
                    rec["content"] = parsed.content
                    rec["tool_calls"] = [
                        {"id": c.id, "name": c.name, "arguments": c.arguments}
                        for c in parsed.tool_calls
                    ]
                print(json.dumps(rec))
            elif parsed is not None:
                print(format_reply(parsed))
            else:
                print(o.text if tok is not None else o.token_ids)
    print(f"[{ntok} tokens in {dt:.2f}s, {ntok / max(dt, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return 0
