"""The OpenAI-format HTTP app: routes, errors in OpenAI's shape, and the client-disconnect ->
abort path (admission is in guards.py). `build_app` serves any Backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pdserve
from pdserve import untrusted_json
from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.chat import ChatRun
from pdserve.gateway.completions import CompletionRun
from pdserve.gateway.embeddings import EmbeddingRequest, EmbeddingRun
from pdserve.gateway.guards import Admission, GuardMiddleware
from pdserve.gateway.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENCY
from pdserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pdserve.gateway.openapi import install_openapi
from pdserve.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    param_of,
)
from pdserve.gateway.responses import ResponsesRequest, ResponsesRun
from pdserve.gateway.serving import ServingContext
from pdserve.gateway.tokenization import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

logger = logging.getLogger(__name__)
fields_logger = logging.getLogger("pdserve.gateway")  # vLLM's warning on ignored fields
CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer
MAX_WARNED_FIELDS = 1000  # ignored field names logged once each, at most this many


class SSEResponse(StreamingResponse):
    """A stream of SSE events that runs `on_close` however it ends (finished, client gone)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._on_close()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable):
    """`work`'s result, or None (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def read_json(request: Request):
    """The JSON body (whatever the Content-Type: clients of OpenAI's API do not all send
    one); 400 when it is not JSON, or when a string in it holds a lone UTF-16 surrogate
    (JSON's `\\ud800` escapes allow it, and no text can encode it: tokenizers and responses
    would fail on it later)."""
    try:
        data = untrusted_json.loads(await request.body())
    except ValueError as e:  # not JSON, not UTF-8, or nested too deeply
        raise APIError(400, f"malformed JSON body: {e}") from e
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, "malformed JSON body: a string holds a lone UTF-16 surrogate "
                            f"({e.object[e.start:e.end]!r})") from e
    return data


def validate_body(request: Request, data, model: type[BaseModel]):
    """`data` as `model`; 400 naming the field when it does not fit. Fields `model` does not
    know are ignored, and logged at WARNING the first time each name is seen (as vLLM)."""
    if isinstance(data, dict):
        warned: set[str] = request.app.state.warned_fields
        unknown = sorted(k for k in data if k not in model.model_fields and k not in warned)
        if unknown and len(warned) < MAX_WARNED_FIELDS:
            # NOTE: names come from clients: the set and each log line are bounded.
            warned.update(unknown[:MAX_WARNED_FIELDS - len(warned)])
            shown = ", ".join(name[:64] for name in unknown[:20])
            more = f" and {len(unknown) - 20} more" if len(unknown) > 20 else ""
            fields_logger.warning("The following fields were present in the request but "
                                  "ignored: %s%s%s", shown, more,
                                  "; no further names are logged"
                                  if len(warned) >= MAX_WARNED_FIELDS else "")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors(), model) from e


async def parse_body(request: Request, model: type[BaseModel]):
    """The JSON body as `model` (see validate_body)."""
    return validate_body(request, await read_json(request), model)


def _validation_error(errors: list, model: type[BaseModel] | None = None) -> APIError:
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    head = msg.split(":", 1)[0]
    param = loc[0] if loc else (head if model and head in model.model_fields else param_of(msg))
    return APIError(400, f"{'.'.join(loc)}: {msg}" if loc else msg, param=param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return _error_response(_validation_error(e.errors()))

    @app.exception_handler(ValueError)
    async def value_error(request, e: ValueError):
        return _error_response(APIError(400, str(e), param=param_of(str(e))))

    @app.exception_handler(BackendError)
    async def backend_error(request, e: BackendError):
        return _error_response(APIError(e.status, str(e), e.type, code=e.code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                        "internal_error", code="internal_error"))


def build_app(backend: Backend, model_name: str | Sequence[str],
              api_key: str | Sequence[str] | None = None,
              *, tokenizer=None, max_logprobs: int | None = None,
              tool_parser: str | None = None,
              max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              metrics: GatewayMetrics | None = None, close_backend: bool = True,
              return_tokens_as_token_ids: bool = False,
              response_role: str = "assistant") -> FastAPI:
    """The OpenAI-format app over `backend`, serving it as `model_name` (vLLM's
    served_model_name: a name, or names of which the first is reported). The tokenizer (for
    chat templates and prompt lengths) is the backend's when not given; `max_logprobs` bounds
    what a request may ask for (default: the backend's); `tool_parser` (a name in
    tool_parsers.TOOL_PARSERS) enables tool_choice "auto". The backend is closed when the app
    shuts down unless `close_backend` is False."""
    info = backend.models()[0]
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names:
        raise ValueError("served_model_name: at least one name is needed")
    model_name = names[0]
    if tokenizer is None:
        tokenizer = backend.load_tokenizer()
    # NOTE: requests are built on worker threads; transformers adjusts a fast tokenizer's
    # truncation and padding state on its first encode, which must not race.
    tokenizer.encode("warm up")
    metrics = metrics or GatewayMetrics(model_name)
    ctx = ServingContext(backend, tokenizer, model_name, info.max_model_len, metrics,
                         info.max_logprobs if max_logprobs is None else max_logprobs,
                         tool_parser, dict(info.sampling_defaults), info.max_tokens_cap,
                         return_tokens_as_token_ids, response_role)
    admission = Admission(max_concurrency)
    served_names = {*names, info.id, info.root}
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if close_backend:
            await backend.close()

    app = FastAPI(title="pdserve", version=pdserve.__version__, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.ctx, app.state.admission = ctx, admission
    app.state.warned_fields = set()
    api_keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    app.add_middleware(GuardMiddleware, api_keys=api_keys, max_body_bytes=max_body_bytes,
                       metrics=metrics)
    _install_error_handlers(app)
    install_openapi(app)

    def check_model(body) -> None:
        if body.model is not None and body.model not in served_names:
            raise APIError(404, f"The model `{body.model}` does not exist.",
                           "not_found_error", "model", "model_not_found")

    async def serve(request: Request, body, run_cls):
        check_model(body)
        # Checked and tokenized, off the event loop: a constraint's grammar is compiled to
        # check it, which other clients (health checks too) must not wait for.
        run = await asyncio.to_thread(run_cls, ctx, body)
        weight = run.backend_requests
        beams = getattr(body, "use_beam_search", False) and weight == body.n
        admission.enter(weight, "n" if beams else "prompt")
        handed_off = False
        try:
            gen = await until_disconnect(request, run.start())
            if gen is None:
                return Response(status_code=CLIENT_CLOSED)
            if body.stream:
                async def close():
                    admission.leave(weight)
                    await gen.aclose()
                handed_off = True
                return SSEResponse(run.stream(gen), close)
            try:
                result = await until_disconnect(request, run.respond(gen))
            finally:
                await gen.aclose()
            if result is None:
                return Response(status_code=CLIENT_CLOSED)
            return JSONResponse(result)
        finally:
            if not handed_off:
                admission.leave(weight)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, await parse_body(request, CompletionRequest), CompletionRun)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse_body(request, ChatCompletionRequest)
        return await serve(request, body, ChatRun)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await serve(request, await parse_body(request, ResponsesRequest), ResponsesRun)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await parse_body(request, EmbeddingRequest)
        check_model(body)
        run = EmbeddingRun(ctx, body)  # checked and tokenized
        admission.enter(len(run.prompts), "input")
        try:
            result = await until_disconnect(request, run.respond())
        finally:
            admission.leave(len(run.prompts))
        if result is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(result)

    @app.post("/invocations")  # vLLM's SageMaker-compatible endpoint
    async def invocations(request: Request):
        data = await read_json(request)
        if isinstance(data, dict) and "messages" in data:
            body = validate_body(request, data, ChatCompletionRequest)
            return await serve(request, body, ChatRun)
        if isinstance(data, dict) and "prompt" in data:
            body = validate_body(request, data, CompletionRequest)
            return await serve(request, body, CompletionRun)
        raise APIError(400, "invocations: the body needs `messages` (a chat completion) or "
                            "`prompt` (a completion)")

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        body = await parse_body(request, TokenizeRequest)
        check_model(body)
        return tokenize(ctx, body)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        body = await parse_body(request, DetokenizeRequest)
        check_model(body)
        return detokenize(ctx, body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{  # one card per served name, as vLLM's
            "id": name, "object": "model", "created": created, "owned_by": "pdserve",
            "root": info.root, "parent": None, "max_model_len": info.max_model_len}
            for name in dict.fromkeys(names)]}

    @app.get("/health")
    @app.get("/ping")  # vLLM / SageMaker
    @app.post("/ping")
    async def health():
        if not await backend.health():
            raise APIError(503, "no healthy instance", "service_unavailable_error",
                           code="service_unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": pdserve.__version__}

    @app.get("/metrics")
    async def prometheus():
        try:
            stats = await backend.stats()
        except Exception:  # noqa: BLE001 - the gateway's own metrics are still worth serving
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    return app
