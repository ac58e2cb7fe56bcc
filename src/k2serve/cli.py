"""The `k2serve` command: a thin dispatcher over one module per subcommand.

Each subcommand module defines `add_arguments(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int`. Only the chosen subcommand's module is imported, so
`k2serve plan` starts without importing torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("k2serve.server.cli", "run the OpenAI-compatible server"),
    "chat": ("k2serve.engine.chat_cli", "chat with a model in the terminal"),
    "generate": ("k2serve.engine.generate_cli", "generate a completion offline"),
    "plan": ("k2serve.plan.cli", "what fits on given hardware, how much context, what speed"),
    "deploy": ("k2serve.deploy.cli", "write Kubernetes / SLURM / systemd files from a plan"),
    "download": ("k2serve.plan.download", "download a checkpoint from the Hugging Face hub"),
    "bench": ("k2serve.bench.cli", "benchmark an OpenAI-compatible server"),
    "make-checkpoint": (
        "k2serve.weights.make_checkpoint",
        "write a small checkpoint in the real format",
    ),
}


def _build_parser(chosen: str | None):
    """-> (the `k2serve` parser, the chosen subcommand's parser or None)."""
    from k2serve import version_string

    parser = argparse.ArgumentParser(prog="k2serve", description="Serve the Kimi-K2 model family.")
    parser.add_argument("--version", action="version", version=version_string())
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen_parser = None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
            # also after the subcommand, as SGLang / vLLM take it (unset: the one above wins)
            if "--log-level" not in p._option_string_actions:
                p.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            chosen_parser = p
    return parser, chosen_parser


def unknown_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """'unrecognized arguments: --tp-szie 8 (did you mean --tp-size?)' for a subcommand."""
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    hints = []
    for a in extras:
        if a.startswith("-"):
            name = a.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            if close:
                hints.append(f"{name}: did you mean {' or '.join(close)}?")
    msg = "unrecognized arguments: " + " ".join(extras)
    return msg + ("".join(f"\n  {h}" for h in hints) if hints else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The subcommand is the first argument that names one ("--log-level WARNING serve" works).
    chosen = next((a for a in argv if a in COMMANDS), None)
    parser, sub = _build_parser(chosen)
    args, extras = parser.parse_known_args(argv)
    if extras:  # the subcommand's usage and close matches, not the top-level usage
        (sub or parser).error(unknown_message(extras, sub or parser))
    if not args.command:
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(COMMANDS[args.command][0])
    args.cli_argv = argv  # what was typed, for "was this flag given" checks
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
