"""Admission before any work: the API key, the body size, and a bound on requests in flight
(beyond it: 429 at once, never an unbounded queue)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from pdserve.gateway.protocol import APIError

if TYPE_CHECKING:  # fastapi and prometheus_client load with the app, not with the CLI
    from pdserve.gateway.metrics import GatewayMetrics

# Paths that need the API key: the OpenAI API, and vLLM's endpoints that use the model.
PROTECTED_PATHS = ("/v1", "/invocations", "/tokenize", "/detokenize")


class Admission:
    """A bound on backend requests in flight (one per prompt, per beam of a beam search):
    beyond it HTTP requests are refused, not queued."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {limit}")
        self.limit = limit
        self.in_flight = 0

    def enter(self, weight: int = 1, field: str = "prompt") -> None:
        """Take `weight` slots: 429 while they are not free, 400 naming `field` when they
        never can be."""
        if weight > self.limit:
            raise APIError(400, f"{field}: {weight} prompts (times beams) in one request, more "
                                f"than the {self.limit} this server runs at once "
                                f"(--max-concurrency)", param=field)
        if self.in_flight + weight > self.limit:
            raise APIError(429, f"too many requests in flight (limit {self.limit}); retry later",
                           "rate_limit_error", code="rate_limit_exceeded")
        self.in_flight += weight

    def leave(self, weight: int = 1) -> None:
        self.in_flight -= weight


class GuardMiddleware:
    """Before routing: the API key (on PROTECTED_PATHS), then the body size (read fully,
    replayed); counts error statuses."""

    def __init__(self, app, api_keys: tuple[str, ...], max_body_bytes: int,
                 metrics: GatewayMetrics):
        """`api_keys`: any of them is accepted (none: /v1/* is open)."""
        self.app, self.api_keys, self.max_body_bytes, self.metrics = (
            app, tuple(k.encode() for k in api_keys), max_body_bytes, metrics)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.rejected(message["status"])
            await send(message)

        # NOTE: behind --root-path, uvicorn puts the prefix in front of the path
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if (self.api_keys and path.startswith(PROTECTED_PATHS)
                and not self._authorized(scope)):
            return await _send_error(counting_send, APIError(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "authentication_error", code="invalid_api_key"))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    return await _send_error(counting_send, APIError(
                        413, f"request body larger than {self.max_body_bytes} bytes",
                        code="request_too_large"))
            receive = _replay(bytes(body), receive)
        await self.app(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = token.strip().encode()
        # Every key is compared, so the time taken does not tell which one nearly matched.
        matches = [secrets.compare_digest(given, key) for key in self.api_keys]
        return scheme.lower() == "bearer" and any(matches)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _send_error(send, e: APIError) -> None:
    from fastapi.responses import JSONResponse

    response = JSONResponse(e.body(), status_code=e.status)
    await send({"type": "http.response.start", "status": e.status,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
