"""`k2serve chat`: chat with a model in the terminal, the answer streamed as it is generated.

    k2serve chat                       # the bundled demo checkpoint
    k2serve chat --model ./ckpt --system "Answer briefly." --temperature 0.6

Commands: /reset (forget the conversation), /exit (or Ctrl-D).
"""

from __future__ import annotations

import argparse
import sys

from k2serve.engine.config import EngineConfig
from k2serve.engine.generate_cli import add_sampling_arguments, sampling_params_from_args
from k2serve.parsers import StreamingOutputParser, parse_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(parser, max_tokens=512)
    parser.set_defaults(temperature=0.6)
    EngineConfig.add_cli_args(parser)


def stream_reply(engine, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Generate one reply with the synchronous engine, writing text as it comes.

    The raw text is returned; the terminal gets it through the Kimi parsers: the thought after a
    `(thinking)` label, then the answer on its own line, tool calls as `[tool call NAME ARGS]`,
    and never a `<think>` / tool-call marker."""
    rid = f"chat-{id(prompt_ids)}"
    engine.add_request(rid, prompt_ids, params)
    text = []
    parser = StreamingOutputParser(thinking=True)
    shown = {"reasoning": False, "content": False}

    def show(d) -> None:
        if d.reasoning_content:
            if not shown["reasoning"]:
                out.write("(thinking) ")
                shown["reasoning"] = True
            out.write(d.reasoning_content)
        if d.content:
            if shown["reasoning"] and not shown["content"]:
                out.write("\n")
            shown["content"] = True
            out.write(d.content)
        out.flush()

    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                delta = o.outputs[0].text if o.outputs else ""
                text.append(delta)
                show(parser.feed(delta))
        show(parser.finish())
        for call in parser.tool_calls:
            out.write(f"\n[tool call {call.name} {call.arguments}]")
    except KeyboardInterrupt:
        engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        out.write(" [interrupted]")
    out.write("\n")
    return "".join(text)


def run(args: argparse.Namespace) -> int:
    from k2serve.engine.dp import create_engine  # LLMEngine, or DPEngine with -dp N

    try:
        params = sampling_params_from_args(args).clone(n=1)
        engine = create_engine(EngineConfig.from_cli_args(args))
    except ValueError as e:
        print(f"k2serve chat: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if tok is None:
        print("k2serve chat: this checkpoint has no tokenizer", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    print("k2serve chat: /reset to start over, /exit or Ctrl-D to leave", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(messages), allow_special=True)
        try:
            engine.validate(ids, params)
        except ValueError as e:
            print(f"[{e}] - /reset to start over", file=sys.stderr)
            messages.pop()
            continue
        reply = parse_output(stream_reply(engine, ids, params))
        messages.append(
            {
                "role": "assistant",
                "content": reply.content or "",
                "reasoning_content": reply.reasoning_content,
            }
        )
