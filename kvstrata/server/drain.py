"""Graceful shutdown on SIGTERM: stop admitting, let running requests finish, then end the rest cleanly.

    SIGTERM ──► draining: every new HTTP request gets 503 (so do /health and the generation routes)
            ──► wait up to --graceful-shutdown-timeout for running requests to finish
            ──► end what is left: streams get a final event with finish_reason "abort" and [DONE],
                non-streaming requests a complete 503 JSON error; the scheduler frees their KV
            ──► uvicorn's own shutdown (connections close, lifespan ends); then the scheduler stops
A second SIGTERM or SIGINT during the drain skips to uvicorn's immediate shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Optional

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.serving.errors import ApiError

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "the server is shutting down"
FLUSH_S = 5.0          # time the handlers get to write the final events after the abort
POLL_S = 0.05


class DrainMiddleware:
    """503 for every request that arrives once the server is draining (/metrics stays open)."""

    def __init__(self, app: ASGIApp, client: SchedulerClient):
        self.app = app
        self.client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reason = self.client.draining_reason
        if scope["type"] == "http" and reason is not None and scope["path"] != "/metrics":
            err = ApiError(reason, 503)
            await JSONResponse(err.to_dict(), status_code=503, headers={"Connection": "close"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def drain(client: SchedulerClient, timeout_s: float) -> None:
    """Refuse new requests, wait up to `timeout_s` for running ones, then end the rest (see module doc)."""
    client.draining_reason = SHUTDOWN_MESSAGE
    running = len(client.sequences)
    logger.warning("shutting down: draining %d running sequences (up to %.1f s)", running, timeout_s)
    if not await _until_idle(client, timeout_s):
        ended = client.end_all(f"{SHUTDOWN_MESSAGE}; the request was aborted after the drain timeout")
        logger.warning("drain timeout: ended %d sequences with finish_reason 'abort'", ended)
        await _until_idle(client, FLUSH_S)


async def _until_idle(client: SchedulerClient, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while client.sequences:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT runs `on_drain` before the normal shutdown."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], Awaitable[None]]):
        super().__init__(config)
        self.on_drain = on_drain
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._draining = False

    async def serve(self, sockets=None) -> None:  # noqa: ANN001 (uvicorn's signature)
        """uvicorn's serve, remembering the loop for the signal handler."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """First signal: drain, then exit; any later one: uvicorn's immediate shutdown."""
        if self._draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        self._captured_signals.append(sig)     # re-raised after serve(), as uvicorn does
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.on_drain()
        except Exception:  # never let a failed drain keep the process alive
            logger.exception("graceful drain failed")
        self.should_exit = True
