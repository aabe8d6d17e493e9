"""Checks that run before routing and before a body is read (plain ASGI middleware).

``APIKeyCheck``: every ``/v1`` path, known or not, needs ``Authorization: Bearer KEY`` (401 first,
before a 404 for an unknown route or a 400 for a malformed body). ``BodyLimit``: a body over the
limit is refused with 413, from its ``Content-Length`` before anything is read, or as soon as a
chunked body passes the limit.
"""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import APIError


class APIKeyCheck:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            header = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(header, self.expected):
                error = APIError(
                    401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await _respond(error, scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a chunked body passes the limit: FastAPI passes HTTP exceptions on
    while it reads a body, so the app's handler answers it (413, ``request_too_large``)."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"expected a request body of at most {max_bytes} bytes (--max-request-bytes), got more")


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def error(self) -> APIError:
        return APIError(413, BodyTooLarge(self.max_bytes).detail, code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _respond(self.error(), scope, receive, send)
            return
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise
            await _respond(self.error(), scope, receive, send)


async def _respond(error: APIError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
