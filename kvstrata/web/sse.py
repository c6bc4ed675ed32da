"""HTTP plumbing both HTTP apps (server/, router/) use for streams: server-sent events and client-disconnect
detection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Optional

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops (and closes its generator) as soon as the client leaves.

    Closing the generator runs its `finally` blocks, which abort the request in the scheduler.
    """

    def __init__(self, content: Any, on_close: Optional[Callable[[], None]] = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass          # the client is gone
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()     # covers a generator that never started


def watch_disconnect(request: Request) -> asyncio.Task:
    """A task that completes when the client of `request` disconnects (the body must be read already)."""

    async def wait() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    return asyncio.ensure_future(wait())
