"""`k2serve serve`: flags (vLLM names), engine start-up, the start-up log, uvicorn, SIGTERM drain.

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
import errno
import json
import logging
import os
import re
import signal
import sys

from k2serve import envs

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
    g.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $K2SERVE_API_KEY)",
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


def media_policy(args: argparse.Namespace):
    from k2serve.multimodal.media import MediaPolicy

    domains: list[str] = []
    for d in args.allowed_media_domains or ():
        domains.extend(x.strip().lower() for x in d.split(",") if x.strip())
    return MediaPolicy(
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(domains),
        max_bytes=args.max_image_bytes,
        timeout_s=args.media_fetch_timeout,
    )


# ---- multi-node (issue #17): --headless, --dist-init-addr; see k2serve.distributed.nodes ------
def _add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-node (--nnodes, --node-rank, --master-addr/-port above)")
    g.add_argument(
        "--headless",
        action="store_true",
        help="a worker node (--node-rank >= 1): run this node's ranks for node 0, no HTTP server",
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

    if cfg.nnodes < 2 or cfg.node_rank == 0:
        print(
            "k2serve serve: --headless runs a worker node: give --nnodes N (N >= 2) and "
            "--node-rank R (1 <= R < N); node 0 serves HTTP without --headless",
            file=sys.stderr,
        )
        return 2
    try:
        return run_headless(NodeSpec.from_engine_config(cfg), cfg.device, cfg.model)
    except ValueError as e:
        print(f"k2serve serve: {e}", file=sys.stderr)
        return 2


def _exit_on_lost_rank(message: str) -> None:
    """A multi-node group cannot go on without a rank: say why and exit (the orchestrator
    restarts the group), instead of leaving a server that hangs or answers 503 forever."""
    logger.critical("%s; exiting: a multi-node server cannot continue without every rank", message)
    print(f"k2serve serve: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


# ---- end multi-node -----------------------------------------------------------------------------


def _describe_weights(engine) -> tuple[str, str]:
    """(weight formats, where experts live) for the start-up log."""
    import torch

    inner = getattr(engine, "engine", engine)
    model = getattr(inner, "model", None)
    cfg = engine.model_config
    by_dtype: dict[str, int] = {}
    devices: set[str] = set()
    expert_devices: set[str] = set()
    if isinstance(model, torch.nn.Module):
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            key = str(t.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + t.numel() * t.element_size()
            devices.add(str(t.device))
            if ".experts." in name:
                expert_devices.add(str(t.device))
    quant = cfg.quant.method if cfg.quant else "bf16 (unquantized)"
    if cfg.quant and cfg.quant.method == "int4_group":
        quant = f"int4_group (group {cfg.quant.group_size})"
    elif cfg.quant and cfg.quant.method == "fp8_block":
        quant = f"fp8_block {cfg.quant.block_size[0]}x{cfg.quant.block_size[1]}"
    tensors = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items()))
    formats = f"{quant}; tensors: {tensors or 'unknown'}"
    where = ", ".join(sorted(expert_devices or devices)) or "unknown"
    experts = f"{cfg.n_routed_experts} routed x {len(cfg.moe_layers)} MoE layers on {where}"
    return formats, experts


def bind_port(host: str, port: int):
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it once the
    app is ready; until then connections are refused rather than left hanging).

    Done before the model loads, so a busy port costs nothing. Raises OSError."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn: reuse a port in TIME_WAIT; a port someone listens on still fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class _DrainingServer:
    """A uvicorn.Server whose signal handler drains instead of re-raising the signal, and that
    logs "serving on" once its socket really accepts connections."""

    @staticmethod
    def make(config, state, drain_timeout: float, serving_message: tuple = ()):
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started and serving_message:
                    logger.info(*serving_message)

            def handle_exit(self, sig, frame):  # noqa: ARG002 - uvicorn's signature
                if not state.draining:
                    name = signal.Signals(sig).name
                    logger.info(
                        "received %s: draining for up to %gs (no new connections)",
                        name,
                        drain_timeout,
                    )
                    loop = state.loop
                    if loop is not None:
                        loop.call_soon_threadsafe(
                            loop.call_later, drain_timeout, state.stop_event.set
                        )
                state.draining = True
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                else:
                    self.should_exit = True

        return Server(config)


def missing_model_message(model: str) -> str:
    """Why MODEL cannot be served, and, for a hub id or a known name, how to fetch it."""
    from k2serve.config import KNOWN_MODELS

    if os.path.exists(model):
        return f"--model {model!r} is not a directory"
    key = model.lower()
    hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) is not None
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


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from k2serve.distributed.workers import WorkerError
    from k2serve.engine.async_engine import AsyncLLMEngine
    from k2serve.engine.config import EngineConfig
    from k2serve.server.app import build_app
    from k2serve.server.limits import uvicorn_http_protocol

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(
                f"k2serve serve: MODEL {args.model_tag!r} and --model {args.model!r} differ; "
                "give one",
                file=sys.stderr,
            )
            return 2
        args.model = args.model_tag
    if args.model == VISION_DEMO and not os.path.isdir(args.model):  # the bundled K2.5 demo
        from k2serve.demo import vision_demo_path

        args.model = os.fspath(vision_demo_path())
        args.served_model_name = args.served_model_name or [VISION_DEMO]
    try:
        _apply_dist_init_addr(args)
        cfg = EngineConfig.from_cli_args(args)
        chat_template = _read_chat_template(args.chat_template)
    except ValueError as e:
        print(f"k2serve serve: {e}", file=sys.stderr)
        return 2
    if args.headless:
        return _run_headless(args, cfg)
    if cfg.node_rank != 0:
        print(
            f"k2serve serve: --node-rank {cfg.node_rank} is a worker node: add --headless "
            "(node 0 serves HTTP)",
            file=sys.stderr,
        )
        return 2
    model_dir = cfg.model
    if model_dir is None:
        from k2serve.demo import demo_path

        try:
            model_dir = os.fspath(demo_path())
        except FileNotFoundError as e:
            print(f"k2serve serve: {e}", file=sys.stderr)
            return 2
        cfg = cfg.replace(model=model_dir)
    if not os.path.isdir(model_dir):
        print(f"k2serve serve: {missing_model_message(model_dir)}", file=sys.stderr)
        return 2
    from k2serve.server.generation_config import load_generation_defaults

    try:
        sampling_defaults = load_generation_defaults(args.generation_config, model_dir)
    except ValueError as e:
        print(f"k2serve serve: {e}", file=sys.stderr)
        return 2
    # vLLM reports the --model string; the directory's name is accepted too
    base = os.path.basename(os.path.normpath(model_dir))
    names = args.served_model_name or list(dict.fromkeys([args.model or base, base]))

    try:
        sock = bind_port(args.host, args.port)
    except OSError as e:
        why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        print(
            f"k2serve serve: cannot listen on {args.host}:{args.port}: {why} "
            "(another server running? choose --port)",
            file=sys.stderr,
        )
        return 2
    logger.info("loading %s", model_dir)
    try:
        engine = AsyncLLMEngine(cfg)
    except (ValueError, FileNotFoundError, OSError) as e:  # ConfigError is a ValueError
        sock.close()
        print(f"k2serve serve: cannot load {model_dir}: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:  # a rank failed to start, or a node never joined
        sock.close()
        print(f"k2serve serve: {e}", file=sys.stderr)
        return 1
    except BaseException:
        sock.close()
        raise
    if cfg.nnodes > 1:
        from k2serve.engine.executor import MultiprocExecutor

        runner = engine.engine.runner
        assert isinstance(runner, MultiprocExecutor)  # several nodes: tensor parallel
        runner.set_on_failure(_exit_on_lost_rank)
    try:
        if engine.tokenizer is None:
            print(f"k2serve serve: {model_dir} has no tokenizer files", file=sys.stderr)
            return 2
        if chat_template is not None:
            engine.tokenizer.chat_template = chat_template
        app = build_app(
            engine,
            served_model_names=names,
            api_key=args.api_key,
            max_body_bytes=args.max_request_body_bytes,
            default_chat_template_kwargs=args.default_chat_template_kwargs,
            allowed_origins=args.allowed_origins,
            default_sampling_params=sampling_defaults,
            allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
            read_timeout=args.request_read_timeout or None,
            media_policy=media_policy(args),
        )
        state = app.state.k2
        ec = engine.config
        formats, experts = _describe_weights(engine)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        logger.info(
            "model: %s (served as %s), max_model_len %d",
            model_dir,
            ", ".join(names),
            state.max_model_len,
        )
        logger.info("weights: %s", formats)
        logger.info("experts: %s", experts)
        logger.info(
            "KV cache: %d pages x %d tokens = %d tokens, prefix caching %s",
            ec.num_kv_pages,
            ec.page_size,
            (ec.num_kv_pages or 0) * ec.page_size,  # set by the engine once it has sized it
            "on" if ec.enable_prefix_caching else "off",
        )
        logger.info(
            "thinking by default: %s; api key: %s",
            state.default_thinking,
            "required" if args.api_key else "none",
        )
        timeouts = {}
        if args.request_read_timeout:
            timeouts["http"] = uvicorn_http_protocol(args.request_read_timeout)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            **timeouts,
            # backstop only: at --drain-timeout the app itself ends what is still running
            timeout_graceful_shutdown=args.drain_timeout + 5,
            access_log=False,
        )
        bound = "" if host == args.host else f", bound to {args.host}"
        port = sock.getsockname()[1]  # --port 0: the one the system picked
        fmt = "serving on http://%s:%d/v1 (OpenAI API; /health, /metrics%s)"
        message: tuple = (fmt, host, port)
        message += (bound,)
        server = _DrainingServer.make(config, state, args.drain_timeout, message)
        server.run(sockets=[sock])
        if not server.started:
            print(f"k2serve serve: could not start on {args.host}:{args.port}", file=sys.stderr)
            return 1
        logger.info("stopped")
        return 0
    finally:
        sock.close()
        engine.shutdown()
