"""Request body size cap: a body larger than --max-request-body-bytes gets 413 without being buffered.

A declared `Content-Length` over the cap is refused before any byte is read; a chunked body is counted
as it arrives and refused at the first chunk that crosses the cap.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.server.protocol import ApiError


class BodySizeLimitMiddleware:
    """413 for request bodies over `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _answer(self.too_large(declared), scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large(received)
            return message

        await self.app(scope, counted_receive, send)

    def too_large(self, size: int) -> ApiError:
        """The 413 error for a body of (at least) `size` bytes."""
        return ApiError(f"the request body ({size} bytes or more) exceeds the limit of {self.max_bytes} bytes "
                        f"(--max-request-body-bytes)", 413)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None     # malformed: the server's HTTP parser rejects it
    return None


async def _answer(err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(err.to_dict(), status_code=err.status, headers={"Connection": "close"})
    await response(scope, receive, send)
