"""ASGI middleware that tests name with `--middleware`: each marks the responses it sees."""

from __future__ import annotations

NOT_MIDDLEWARE = 3


class MarkResponses:
    """A plain ASGI middleware class: adds `x-marked-by: class` to every HTTP response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-marked-by", b"class")]
            await send(message)

        await self.app(scope, receive, marked)


async def mark_response(request, call_next):
    """An HTTP middleware function: adds `x-marked-by-function`, naming the class's mark it
    saw on the way out (so the test sees which of the two ran outside the other)."""
    response = await call_next(request)
    response.headers["x-marked-by-function"] = response.headers.get("x-marked-by", "none")
    return response
