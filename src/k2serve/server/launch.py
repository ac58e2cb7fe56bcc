"""`k2serve serve`, phases 3 and 4: bind the port, load the engine, build the app, log what
was loaded, run uvicorn with a SIGTERM drain (see `k2serve.server.cli` for the invariants).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys

from k2serve import envs

logger = logging.getLogger("k2serve.server")


def _exit_on_lost_rank(message: str) -> None:
    """A multi-node group cannot go on without a rank: say why and exit (the orchestrator
    restarts the group), instead of leaving a server that hangs or answers 503 forever."""
    logger.critical("%s; exiting: a multi-node server cannot continue without every rank", message)
    print(f"k2serve serve: {message}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


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


class StartupError(Exception):
    """A start-up phase failed: print `message` (if any) and exit with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.message, self.code = message, code


def load_engine(cfg, model_dir: str, sock):
    """Phase 3: load the checkpoint and size the cache (closes `sock` on failure)."""
    from k2serve.distributed.workers import WorkerError
    from k2serve.engine.async_engine import AsyncLLMEngine

    logger.info("loading %s", model_dir)
    try:
        engine = AsyncLLMEngine(cfg)
    except (ValueError, FileNotFoundError, OSError) as e:  # ConfigError is a ValueError
        sock.close()
        raise StartupError(f"cannot load {model_dir}: {e}") from None
    except WorkerError as e:  # a rank failed to start, or a node never joined
        sock.close()
        raise StartupError(str(e), 1) from None
    except BaseException:
        sock.close()
        raise
    dp_nodes = (cfg.data_parallel_size_local or cfg.data_parallel_size) < cfg.data_parallel_size
    if cfg.nnodes > 1 or dp_nodes:  # several nodes: tensor parallel, or data parallel (issue 29)
        engine.set_on_failure(_exit_on_lost_rank)
    return engine


def bind(args: argparse.Namespace):
    try:
        return bind_port(args.host, args.port)
    except OSError as e:
        why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise StartupError(
            f"cannot listen on {args.host}:{args.port}: {why} (another server running? "
            "choose --port)"
        ) from None


def serve(args, engine, model_dir, chat_template, sampling_defaults, sock) -> int:
    """Phase 4: the app, the start-up log, uvicorn until SIGTERM has drained."""
    import uvicorn

    from k2serve.server.app import build_app
    from k2serve.server.limits import uvicorn_http_protocol

    # vLLM reports the --model string; the directory's name is accepted too
    base = os.path.basename(os.path.normpath(model_dir))
    names = args.served_model_name or list(dict.fromkeys([args.model or base, base]))
    if engine.tokenizer is None:
        raise StartupError(f"{model_dir} has no tokenizer files")
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
        access_log=not args.disable_access_log,
        media_policy=media_policy(args),
    )
    state = app.state.k2
    # the engine thread drops the GIL on each torch op and device sync and must get it back
    # quickly while the event loop streams (envs.GIL_SWITCH_INTERVAL_S)
    sys.setswitchinterval(envs.gil_switch_interval_s())
    logger.info("GIL switch interval %.2f ms (K2SERVE_GIL_SWITCH_INTERVAL)",
                sys.getswitchinterval() * 1e3)  # fmt: skip
    _log_startup(engine, state, model_dir, names, args)
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
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    bound = "" if host == args.host else f", bound to {args.host}"
    port = sock.getsockname()[1]  # --port 0: the one the system picked
    fmt = "serving on http://%s:%d/v1 (OpenAI API; /health, /metrics%s)"
    server = _DrainingServer.make(config, state, args.drain_timeout, (fmt, host, port, bound))
    server.run(sockets=[sock])
    if not server.started:
        raise StartupError(f"could not start on {args.host}:{args.port}", 1)
    logger.info("stopped")
    return 0


def _log_startup(engine, state, model_dir: str, names: list[str], args) -> None:
    from k2serve import version_string

    spec = engine.spec
    formats, experts = engine.weights_description()
    logger.info("%s", version_string())
    logger.info(
        "model: %s (served as %s), max_model_len %d", model_dir, ", ".join(names),
        state.max_model_len,
    )  # fmt: skip
    logger.info("weights: %s", formats)
    logger.info("experts: %s", experts)
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens, prefix caching %s",
        spec.num_kv_pages,
        spec.page_size,
        spec.kv_cache_tokens,
        "on" if engine.config.enable_prefix_caching else "off",
    )
    logger.info(
        "thinking by default: %s; api key: %s",
        state.default_thinking,
        "required" if args.api_key else "none",
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
