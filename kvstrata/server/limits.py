"""Request body size cap: a body larger than --max-request-body-bytes gets 413 without being buffered.

A declared `Content-Length` over the cap is refused without buffering a byte; a chunked body is counted
as it arrives and refused at the first chunk that crosses the cap. Before the 413 of a declared body goes
out, up to DRAIN_BYTES / DRAIN_SECONDS of the body still in flight are read and dropped: closing a socket
with unread data resets it, and the reset can destroy the 413 before the client has read it.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.serving.errors import ApiError

DRAIN_BYTES = 256 << 20     # more than this still unsent: close anyway (the client may see a reset)
DRAIN_SECONDS = 5.0


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
            await _drain(receive, min(declared, DRAIN_BYTES))
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


async def _drain(receive: Receive, limit: int) -> None:
    """Read and drop up to `limit` bytes of the request body (for at most DRAIN_SECONDS)."""
    deadline = time.monotonic() + DRAIN_SECONDS
    read = 0
    while read < limit:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return      # the client went away
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _answer(err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = JSONResponse(err.to_dict(), status_code=err.status, headers={"Connection": "close"})
    await response(scope, receive, send)
