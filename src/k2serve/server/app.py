"""The FastAPI app: `build_app(engine, ...)` wires routes, auth, limits, errors and metrics.

Owns: the routes (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health,
/version, /metrics, /tokenize, /detokenize) and `GuardMiddleware` (API key, request body size
limit and read deadline, per-status request counts, and the last-resort 500 that never leaks a
traceback).

Invariants:
- The app holds no global state: everything lives in `app.state.k2` (a `ServerState`), so tests
  can build many apps in one process.
- `app.state.k2.draining = True` (set on SIGTERM) makes /health answer 503 and new /v1 requests
  503, while requests already in flight run to completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k2serve import __version__, git_revision
from k2serve.engine.contract import EngineClient
from k2serve.server.access_log import log_finished, printable
from k2serve.server.auth import OWNER_SCOPE_KEY, check_authorization, needs_key
from k2serve.server.chat import ChatHandler, encode_prompt
from k2serve.server.completions import CompletionHandler
from k2serve.server.errors import APIError, bad_request, install_error_handlers
from k2serve.server.finite import SafeJSONResponse
from k2serve.server.limits import BodyTimeout, BodyTooLarge, read_body
from k2serve.server.metrics import ServerMetrics
from k2serve.server.offload import offload_json_route
from k2serve.server.openapi import install_openapi
from k2serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from k2serve.server.responses import ResponsesHandler
from k2serve.server.responses_input import ResponsesRequest
from k2serve.server.serving import ServerState
from k2serve.server.sse import ClientDisconnected, ServerStopping

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_READ_TIMEOUT = 60.0
_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/health",
    "/version",
    "/metrics",
)


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        api_key: list[str] | None,
        max_body: int,
        read_timeout: float | None = None,
        access_log: bool = True,
    ):
        self.app = app
        self.state = state
        self.api_keys = list(api_key or [])
        self.max_body = max_body
        self.read_timeout = read_timeout
        self.access_log = access_log

    async def _reply(self, send: Send, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    # the request body may be unread: never wait for it on this connection
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in _ROUTES else "other"
        status = {"code": 500, "started": False}
        error_body: list[bytes] = []  # an error response's body, for the log line
        t0 = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
            elif message["type"] == "http.response.body" and status["code"] >= 400:
                error_body.append(message.get("body", b"")[:4096])
            await send(message)

        try:
            err = self._precheck(scope, path)
            if err is not None:
                await self._reply(send_wrapper, err)
                return
            limited = await self._buffered(receive)
            if isinstance(limited, APIError):
                await self._reply(send_wrapper, limited)
                return
            await self.app(scope, limited, send_wrapper)
        except Exception:
            logger.exception(
                "unhandled error on %s %s", printable(scope.get("method", "")), printable(path)
            )
            if not status["started"]:
                await self._reply(
                    send_wrapper, APIError(500, "internal server error; see the server log")
                )
        finally:
            self.state.metrics.http_requests.labels(path=label, status=str(status["code"])).inc()
            log_finished(
                scope, status["code"], time.monotonic() - t0, b"".join(error_body), self.access_log
            )

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body is larger than the limit of {self.max_body} bytes",
            code="request_too_large",
        )

    def _precheck(self, scope: Scope, path: str) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.api_keys and needs_key(path):
            raw = headers.get(b"authorization")
            why, owner = check_authorization(raw.decode("latin-1") if raw else None, self.api_keys)
            if why is not None:
                return APIError(401, why, code="invalid_api_key")
            scope[OWNER_SCOPE_KEY] = owner
        if self.state.draining and needs_key(path):
            return APIError(503, "the server is shutting down", code="shutting_down")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.max_body:
                    return self._too_large()
            except ValueError:
                return APIError(400, "invalid Content-Length header")
        return None

    async def _buffered(self, receive: Receive) -> Receive | APIError:
        """Read the whole body under the size limit and the read deadline, then replay it;
        or the error to answer with (413, 408). See server/limits.py."""
        try:
            pending = await read_body(receive, self.max_body, self.read_timeout)
        except BodyTooLarge:
            return self._too_large()
        except BodyTimeout:
            return APIError(
                408,
                f"the request body did not arrive within {self.read_timeout:g} seconds",
                code="request_timeout",
            )

        async def replay() -> Message:
            return pending.pop(0) if pending else await receive()

        return replay


def _default_sampling_params_cls():
    from k2serve.engine.sampling_params import SamplingParams

    return SamplingParams


def build_app(
    engine: EngineClient,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | list[str] | None = None,
    max_model_len: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_thinking: bool | None = None,
    default_chat_template_kwargs: dict | None = None,
    allowed_origins: list[str] | None = None,
    tokenizer=None,
    sampling_params_cls=None,
    default_sampling_params: dict | None = None,
    allow_special_tokens_in_chat: bool = False,
    read_timeout: float | None = DEFAULT_READ_TIMEOUT,
    access_log: bool = True,
    media_policy=None,
) -> FastAPI:
    """An OpenAI-compatible app over an `AsyncLLMEngine`-like engine (see docs/interfaces.md).

    `default_thinking=None`: on when the chat template knows `<think>` (or is the built-in
    K2-Thinking one), off otherwise (K2-Instruct templates).
    `default_sampling_params`: defaults for the sampling fields a request leaves unset
    (`generation_config.load_generation_defaults`).
    `allow_special_tokens_in_chat`: encode special-token strings in chat messages as control
    tokens (vLLM's behaviour; off: they are text, so a client cannot forge turns).
    `read_timeout`: seconds a request body may take to arrive after its headers (408 after).
    `api_key`: one key or several (any of them is accepted; stored responses belong to the key
    that created them). `access_log`: one INFO line per finished request (server/access_log.py).
    `media_policy`: where image URLs may be fetched from (multimodal.media.MediaPolicy).
    """
    api_keys = [api_key] if isinstance(api_key, str) else [k for k in api_key or [] if k]
    names = list(served_model_names or ["k2serve"])
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    if default_thinking is None:
        template = getattr(tok, "chat_template", None)
        default_thinking = template is None or "<think>" in template
    max_len = max_model_len or engine.max_model_len
    state = ServerState(
        engine=engine,
        tokenizer=tok,
        model_name=names[0],
        served_names=names,
        max_model_len=max_len,
        metrics=ServerMetrics(engine, names[0], max_len),
        sampling_params_cls=sampling_params_cls or _default_sampling_params_cls(),
        default_thinking=default_thinking,
        default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
        default_sampling=dict(default_sampling_params or {}),
        allow_special_in_chat=allow_special_tokens_in_chat,
    )
    if media_policy is not None:
        state.media_policy = media_policy

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            state.cpu.shutdown()

    app = FastAPI(
        title="k2serve", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan
    )
    app.state.k2 = state
    app.router.route_class = offload_json_route(state.cpu)  # big bodies parsed off the loop
    install_error_handlers(app)
    chat, completions = ChatHandler(state), CompletionHandler(state)
    responses = ResponsesHandler(state, chat)
    started = int(time.time())

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(ServerStopping)
    async def _stopping(request: Request, exc: ServerStopping):
        msg = "the server is shutting down (drain timeout reached)"
        return APIError(503, msg, code="shutting_down").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        out = await chat.create(body, request)
        return out if isinstance(out, Response) else await state.cpu.run(SafeJSONResponse, out)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        out = await completions.create(body, request)
        return out if isinstance(out, Response) else await state.cpu.run(SafeJSONResponse, out)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        out = await responses.create(body, request)
        return out if isinstance(out, Response) else await state.cpu.run(SafeJSONResponse, out)

    # one route for both methods, so a 405 / OPTIONS lists both in its Allow header
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def response_by_id(response_id: str, request: Request):
        owner = request.scope.get(OWNER_SCOPE_KEY)
        if request.method == "DELETE":
            return responses.delete(response_id, owner)
        return responses.get(response_id, owner)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        data = [
            {
                "id": n,
                "object": "model",
                "created": started,
                "owned_by": "k2serve",
                "root": names[0],
                "max_model_len": state.max_model_len,
            }
            for n in names
        ]
        return {"object": "list", "data": data}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        state.check_model(model_id)
        return (await models())["data"][names.index(model_id)]

    # NOTE: these build their JSON answer in the pool too: 20M token ids take seconds to
    # encode, which FastAPI would otherwise do on the event loop.
    def _tokenize(body: TokenizeRequest) -> Response:
        if body.messages is None:
            ids = state.tokenizer.encode(body.prompt, allow_special=True)  # raw, as vLLM
        else:  # the same ids a chat request gets
            ids = encode_prompt(state, body, body.add_generation_prompt)[1]
        out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        return SafeJSONResponse(out)

    def _detokenize(body: DetokenizeRequest) -> Response:
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"tokens has ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="tokens"
            )
        return SafeJSONResponse({"prompt": state.tokenizer.decode(body.tokens)})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        return await state.cpu.run(_tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        return await state.cpu.run(_detokenize, body)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if engine.errored:
            raise APIError(503, "the engine has stopped; see the server log", code="engine_dead")
        try:
            engine.check_health()
        except Exception as e:
            raise APIError(503, f"the engine is unhealthy: {e}", code="engine_dead") from None
        return Response(status_code=200)

    revision = git_revision()  # once: a checkout's commit, None from a wheel

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": __version__, "git_revision": revision}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(
            state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    install_openapi(app, api_key_required=bool(api_keys))
    app.add_middleware(
        GuardMiddleware,
        state=state,
        api_key=api_keys,
        max_body=max_body_bytes,
        read_timeout=read_timeout,
        access_log=access_log,
    )
    if allowed_origins:  # outermost, so browser preflights (OPTIONS) never need the key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app
