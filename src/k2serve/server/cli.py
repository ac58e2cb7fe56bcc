"""`k2serve serve`: flags (vLLM names, plus the guides' spellings), then start-up by phase.

`run` goes: `_parse` (flags, guide spellings, EngineConfig) -> `_check` (this machine's
hardware, `k2serve.server.machine`; the checkpoint directory; sampling defaults) -> a worker
node (`--node-rank` > 0) runs its ranks headless, node 0 goes on: `launch.bind` (the port,
before anything loads) -> `launch.load_engine` -> `launch.serve` (app, start-up log, uvicorn).

Invariants:
- Engine flags come from `EngineConfig.add_cli_args`, so serve / generate / chat agree on names
  and defaults; server flags are added here.
- SIGTERM (or Ctrl-C): stop accepting connections, answer new /v1 requests and /health with
  503, let in-flight requests finish for up to --drain-timeout seconds; what still runs then is
  aborted and ends cleanly (an error event + [DONE] for streams, a 503 otherwise); shut the
  engine down and exit 0. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys

from k2serve import envs
from k2serve.server.launch import StartupError, bind, load_engine, serve

logger = logging.getLogger("k2serve.server")

_PARSERS = ("kimi_k2",)  # the Kimi dialect is always parsed; flags kept for vLLM habits


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a whole number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def _json_flag(text: str, ok, what: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    return _json_flag(text, lambda v: isinstance(v, dict), "a JSON object")


def _json_list(text: str) -> list:
    def ok(v) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    return _json_flag(text, ok, "a JSON list of strings")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from k2serve.engine.config import EngineConfig

    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory, as `vllm serve MODEL` (same as --model)",
    )
    EngineConfig.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, as a file path or the template itself "
        "(default: the checkpoint's own, else a built-in K2-Thinking one)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM compatibility; k2serve runs no code from the checkpoint",
    )
    g.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use; the first is reported in responses "
        "(default: the model directory's name)",
    )
    env_key = envs.api_key()
    g.add_argument(
        "--api-key",
        nargs="+",
        default=[env_key] if env_key else None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/*; several keys (as vLLM) are each "
        "accepted, and a stored response belongs to the key that created it "
        "(default: $K2SERVE_API_KEY)",
    )
    g.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",
        "--disable-log-requests",
        dest="disable_access_log",
        action="store_true",
        help="no per-request INFO line (client, method, path, status, tokens, latency); "
        "rejections (4xx) and client disconnects are still logged. The vLLM names are "
        "aliases (k2serve never logs prompts)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=_PARSERS,
        default="kimi_k2",
        help="parse Kimi tool calls into tool_calls (default kimi_k2)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=_PARSERS,
        default="kimi_k2",
        help="split <think> reasoning into reasoning_content (default kimi_k2); thinking is on "
        "by default when the chat template supports it, off with "
        "--default-chat-template-kwargs '{\"thinking\": false}'",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        default=True,
        help="accepted for vLLM compatibility; tool_choice=auto is always on",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        help="JSON merged under each request's chat_template_kwargs, e.g. '{\"thinking\": false}'",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for what a request leaves unset: 'auto' (the checkpoint's "
        "generation_config.json, default), 'vllm' (none: temperature 1.0...) or a directory "
        "holding a generation_config.json",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='CORS origins as a JSON list (default ["*"], as vLLM); [] turns CORS off',
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="larger request bodies get 413 (default 32 MiB)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=_seconds,
        default=60.0,
        help="seconds a client may take to send a request's headers (from connecting) and, "
        "separately, its body (from the headers); slower connections are closed, a late "
        "body gets 408 (default 60; 0 = no limit)",
    )
    g.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="encode special-token strings written in chat messages, names and tools as "
        "control tokens, as vLLM does (default: as text, so a client cannot forge a turn)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM (default 30)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    _add_media_arguments(parser)
    _add_multinode_arguments(parser)
    from k2serve.server.guide_args import add_guide_arguments

    add_guide_arguments(parser)  # last: it skips the spellings defined above


# ---- K2.5 images (issue #25): where image URLs may be fetched from; see multimodal.media ------
# (--limit-mm-per-prompt and --mm-encoder-tp-mode are EngineConfig fields: engine flags)
VISION_DEMO = "kimi-k2.5-demo"  # `k2serve serve kimi-k2.5-demo`: the bundled K2.5 demo


def _add_media_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("images (K2.5)")
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="directory under which file:// image URLs may be read (default: file:// refused)",
    )
    g.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        help="only image URLs on these hosts (and their subdomains) are fetched; they may be "
        "private or loopback addresses (default: any public host)",
    )
    g.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds to fetch one image URL (default 10)",
    )
    g.add_argument(
        "--max-image-bytes",
        type=int,
        default=20 * 1024 * 1024,
        help="largest image a URL may return, in bytes (default 20 MiB)",
    )


# ---- multi-node (issue #17): --headless, --dist-init-addr; see k2serve.distributed.nodes ------
def _add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-node (--nnodes, --node-rank, --master-addr/-port above)")
    g.add_argument(
        "--headless",
        action="store_true",
        help="a worker node (--node-rank >= 1): run this node's ranks for node 0, no HTTP "
        "server (implied by --node-rank >= 1, as SGLang)",
    )
    g.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="node 0's address as SGLang spells it: same as --master-addr HOST --master-port PORT",
    )


def _apply_dist_init_addr(args: argparse.Namespace) -> None:
    """--dist-init-addr HOST:PORT -> args.master_addr / args.master_port (ValueError if bad)."""
    value = args.dist_init_addr
    if value is None:
        return
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr {value!r} is not HOST:PORT")
    args.master_addr, args.master_port = host, int(port)


def _run_headless(args: argparse.Namespace, cfg) -> int:
    from k2serve.distributed.headless import run_headless
    from k2serve.distributed.nodes import NodeSpec

    # ---- issue 29 (data parallel): a headless node holds data-parallel ranks ----
    if cfg.data_parallel_size > 1:
        from k2serve.distributed.dp_layout import dp_node_spec

        spec = dp_node_spec(cfg)
        if spec is None or spec.node_rank == 0:
            print(
                "k2serve serve: --headless with --data-parallel-size runs the ranks of another "
                "node: give --data-parallel-size-local L (< the size) and "
                "--data-parallel-start-rank R (R >= L); rank 0's node serves HTTP",
                file=sys.stderr,
            )
            return 2
        return run_headless(spec, cfg.device, cfg.model)
    # ---- end issue 29 ----
    if cfg.nnodes < 2 or cfg.node_rank == 0:
        print(
            "k2serve serve: --headless runs a worker node: give --nnodes N (N >= 2) and "
            "--node-rank R (1 <= R < N); node 0 serves HTTP without --headless",
            file=sys.stderr,
        )
        return 2
    try:
        spec = NodeSpec.from_engine_config(cfg)
        host, port = spec.control_address
        logger.info(
            "worker node %d of %d%s: no HTTP server here; checkpoint %s; waiting up to "
            "%ds for node 0 at %s:%d (node 0 listens once it has loaded its own shard)",
            cfg.node_rank,
            cfg.nnodes,
            "" if args.headless else " (--node-rank > 0: runs as --headless)",
            f"{cfg.model} found" if cfg.model else "at node 0's --model path",
            cfg.dist_join_timeout,
            host,
            port,
        )
        return run_headless(spec, cfg.device, cfg.model)
    except ValueError as e:
        print(f"k2serve serve: {e}", file=sys.stderr)
        return 2


# ---- end multi-node -----------------------------------------------------------------------------


def missing_model_message(model: str) -> str:
    """Why MODEL cannot be served, and, for a hub id or a known name, how to fetch it."""
    from k2serve.config import KNOWN_MODELS

    if os.path.exists(model):
        return f"--model {model!r} is not a directory"
    key = model.lower()
    hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) is not None
    # a path whose last part names a known checkpoint (models/Kimi-K2.5): download it there
    leaf = os.path.basename(os.path.normpath(model))
    known = {repo.split("/")[-1].lower(): name for name, (_, repo) in KNOWN_MODELS.items()}
    if leaf.lower() in known and model.lower() not in {r.lower() for _, r in KNOWN_MODELS.values()}:
        if leaf != model:
            return (
                f"--model {model!r} does not exist yet; fetch it there first:\n"
                f"    k2serve download {known[leaf.lower()]} --dir {model}\n"
                f"then run:\n    k2serve serve {model}"
            )
    if not hub and key not in KNOWN_MODELS:
        return f"--model {model!r} is not a directory (no such path)"
    target = "./" + (model.rsplit("/", 1)[-1] if hub else KNOWN_MODELS[key][1].split("/")[-1])
    return (
        f"--model {model!r} is not a local directory; k2serve serves checkpoints from disk. "
        f"Fetch it first:\n    k2serve download {model} --dir {target}\n"
        f"then run:\n    k2serve serve {target}"
    )


def _read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the template text itself (as vLLM); checked here."""
    if value is None:
        return None
    text = value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif not any(c in value for c in "{%"):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    from k2serve.tokenizer.chat_template import ChatTemplateError, compile_template

    try:
        compile_template(text)
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from None
    return text


def _given_fields(args: argparse.Namespace, argv: list[str]) -> set[str]:
    """EngineConfig fields set on the command line: changed from the default, or spelled out."""
    from dataclasses import fields

    from k2serve.engine.config import EngineConfig

    defaults = EngineConfig()
    named = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    return {
        f.name
        for f in fields(EngineConfig)
        if f.name in named or getattr(args, f.name, None) != getattr(defaults, f.name)
    }


def _parse(args: argparse.Namespace):
    """Phase 1, flags: guide spellings, MODEL vs --model, EngineConfig. -> (cfg, chat template)."""
    from k2serve.engine.config import EngineConfig
    from k2serve.server.guide_args import apply_guide_flags, env_warnings

    argv = list(getattr(args, "cli_argv", None) or sys.argv[1:])
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise StartupError(
                f"MODEL {args.model_tag!r} and --model {args.model!r} differ; give one"
            )
        args.model = args.model_tag
    if args.model == VISION_DEMO and not os.path.isdir(args.model):  # the bundled K2.5 demo
        from k2serve.demo import vision_demo_path

        args.model = os.fspath(vision_demo_path())
        args.served_model_name = args.served_model_name or [VISION_DEMO]
    try:
        apply_guide_flags(args, argv)
        if args.trust_remote_code:
            logger.info("--trust-remote-code: k2serve runs no code from the checkpoint")
        for line in env_warnings():
            logger.warning("%s", line)
        _apply_dist_init_addr(args)
        cfg = EngineConfig.from_cli_args(args)
        chat_template = _read_chat_template(args.chat_template)
    except ValueError as e:
        raise StartupError(str(e)) from None
    args.given_fields = _given_fields(args, argv)
    return cfg, chat_template


def _check(args: argparse.Namespace, cfg):
    """Phase 2, this machine and the model: the hardware the flags ask for, the checkpoint
    directory, its sampling defaults. -> (cfg, model_dir, sampling defaults)."""
    from k2serve.server.machine import check_machine

    try:
        cfg = check_machine(cfg, args.given_fields, getattr(args, "guide_numa_nodes", None))
    except ValueError as e:
        raise StartupError(str(e)) from None
    model_dir = cfg.model
    if model_dir is None and cfg.node_rank > 0:
        return cfg, None, None  # a worker without --model reads node 0's path when it joins
    if model_dir is None:
        from k2serve.demo import demo_path

        try:
            model_dir = os.fspath(demo_path())
        except FileNotFoundError as e:
            raise StartupError(str(e)) from None
        cfg = cfg.replace(model=model_dir)
    if not os.path.isdir(model_dir):
        raise StartupError(missing_model_message(model_dir))
    if cfg.node_rank > 0:
        return cfg, model_dir, None  # a worker node: node 0 owns the sampling defaults
    from k2serve.server.generation_config import load_generation_defaults

    try:
        sampling_defaults = load_generation_defaults(args.generation_config, model_dir)
    except ValueError as e:
        raise StartupError(str(e)) from None
    try:  # a bad checkpoint is reported as such, before the port is even looked at
        from k2serve.config import ModelConfig

        ModelConfig.from_hf(model_dir)
    except (ValueError, OSError) as e:
        raise StartupError(f"cannot load {model_dir}: {e}") from None
    return cfg, model_dir, sampling_defaults


def run(args: argparse.Namespace) -> int:
    """`k2serve serve`, phase by phase: flags, machine and model, engine, HTTP server."""
    try:
        cfg, chat_template = _parse(args)
        if args.headless and cfg.node_rank == 0:
            return _run_headless(args, cfg)  # says what --headless needs
        cfg, model_dir, sampling_defaults = _check(args, cfg)
        if cfg.node_rank > 0 or cfg.data_parallel_start_rank != 0:
            # a worker node, with or without --headless (as SGLang): tensor-parallel ranks of
            # node N > 0, or data-parallel ranks from --data-parallel-start-rank on (issue 29)
            return _run_headless(args, cfg)
        sock = bind(args)
        engine = load_engine(cfg, model_dir, sock)
    except StartupError as e:
        print(f"k2serve serve: {e.message}", file=sys.stderr)
        return e.code
    try:
        return serve(args, engine, model_dir, chat_template, sampling_defaults, sock)
    except StartupError as e:
        print(f"k2serve serve: {e.message}", file=sys.stderr)
        return e.code
    finally:
        sock.close()
        engine.shutdown()
